"""``checkpoint.export`` and ``lampdist checkpoint export``: the model of a root, a sharded and
an fsdp checkpoint (each from a short real run) as safetensors and torch files equal to the
model's ``state_dict``, fsdp shards consolidated one tensor at a time; ``--hf``: a directory
``from_pretrained`` loads, giving the same logits."""

from __future__ import annotations

import functools
import gc
import weakref
from collections.abc import Iterable
from pathlib import Path

import anyio
import pytest
import torch

import lampdist
from lampdist import checkpoint
from lampdist._checkpoint import sharded_weights
from lampdist.cli import main

from ..roles.reference import make_model, make_shards, mse

safetensors_torch = pytest.importorskip("safetensors.torch")


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


async def _local_run(out: Path, step_on: str) -> torch.nn.Module:
    """Two ranks in this process, 3 epochs, checkpointed, the best model kept; rank 0's
    module (holding the best model at the end)."""
    shards = make_shards([[6, 5, 7], [4, 8]], seed=21)
    valid = make_shards([[6], [5]], seed=22)
    modules = [make_model(), make_model(seed=3)]
    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(m, mse),
                train_batches=functools.partial(list, s),
                validation_batches=functools.partial(list, v),
            )
            for m, s, v in zip(modules, shards, valid, strict=True)
        ],
        optimizer_factory=adamw,
        loop=lampdist.LoopOptions(
            max_epochs=3,
            checkpoint_state=checkpoint.to_directory(out, keep=5),
            return_min_validation_loss_model=range(3),
        ),
        step=lampdist.StepOptions(step_on=step_on),  # type: ignore[arg-type]
    )
    return modules[0]


@pytest.fixture(scope="module")
def local_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """A root and a sharded run: each one's checkpoint directory and best model."""
    runs = {}
    for step_on in ("root", "sharded"):
        out = tmp_path_factory.mktemp(step_on)
        module = anyio.run(_local_run, out, step_on)
        runs[step_on] = (out, {k: v.clone() for k, v in module.state_dict().items()})
    return runs


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """An fsdp run on 2 processes, checkpointed after each of 2 epochs: its checkpoint
    directory and its final model (assembled from each rank's parts, which no rank held
    whole)."""
    from ..roles.test_fsdp import assembled, run_ranks

    base = tmp_path_factory.mktemp("fsdp")
    out, saved = base / "out", base / "saved"
    out.mkdir()
    run_ranks(out, 2, "--epochs", "2", "--checkpoint", str(saved))
    return saved, assembled(out, 2)


def read(path: Path, form: str) -> dict[str, torch.Tensor]:
    if form == "safetensors":
        return dict(safetensors_torch.load_file(path))
    return dict(torch.load(path, weights_only=True))


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("form", ["safetensors", "torch"])
@pytest.mark.parametrize("step_on", ["root", "sharded"])
def test_the_last_and_the_best_model_of_a_whole_checkpoint(
    local_runs: dict[str, tuple[Path, dict[str, torch.Tensor]]],
    tmp_path: Path,
    step_on: str,
    form: str,
) -> None:
    saved, best = local_runs[step_on]
    last = dict(checkpoint.load(saved / "epoch-000003").training_state.model_state)
    target = tmp_path / f"model.{form}"
    assert checkpoint.export(saved, target, format=form) == saved / "epoch-000003"  # type: ignore[arg-type]
    assert_equal(read(target, form), last)
    assert main(["checkpoint", "export", str(saved), str(target), "--format", form, "--best"]) == 0
    assert_equal(read(target, form), best)  # the model the run ended with
    module = make_model()
    module.load_state_dict(read(target, form))  # a plain state dict of the model


@pytest.mark.parametrize("form", ["safetensors", "torch"])
def test_an_fsdp_checkpoint_exports_whole(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, form: str
) -> None:
    saved, final = fsdp_run
    target = tmp_path / f"model.{form}"
    assert main(["checkpoint", "export", str(saved), str(target), "--format", form]) == 0
    assert_equal(read(target, form), final)
    make_model().load_state_dict(read(target, form))
    checkpoint.export(saved, target, format=form, epoch=1)  # type: ignore[arg-type]
    assert not all(torch.equal(read(target, form)[k], v) for k, v in final.items())


def test_fsdp_shards_are_read_one_tensor_at_a_time(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    """Each tensor is read only when it is due and not kept: once the caller drops one,
    nothing holds it while the next is read."""
    saved, final = fsdp_run
    weights = sharded_weights(saved / "epoch-000002" / "shards")
    assert [spec.name for spec in weights.specs] == list(final)
    previous: weakref.ref[torch.Tensor] | None = None
    count = 0
    for name, tensor in weights.read():
        if previous is not None:
            gc.collect()
            assert previous() is None, "the reader holds a tensor it yielded"
        assert torch.equal(tensor, final[name]), name
        previous = weakref.ref(tensor)
        count += 1
        del tensor
    assert count == len(final)


def test_bad_exports_are_clear_errors(
    local_runs: dict[str, tuple[Path, dict[str, torch.Tensor]]],
    fsdp_run: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    saved, _ = local_runs["root"]
    with pytest.raises(lampdist.ConfigError, match=r"format='pickle' is no export format"):
        checkpoint.export(saved, tmp_path / "m", format="pickle")  # type: ignore[arg-type]
    with pytest.raises(lampdist.ConfigError, match=r"best=True: .* holds no best model"):
        checkpoint.export(fsdp_run[0], tmp_path / "m", best=True)
    with pytest.raises(lampdist.CheckpointError, match="holds no checkpoint"):
        checkpoint.export(tmp_path / "nothing", tmp_path / "m")
    with pytest.raises(SystemExit) as exited:
        main(["checkpoint", "export", str(saved), str(tmp_path / "m"), "--format", "pickle"])
    assert exited.value.code == 2
    assert "invalid choice: 'pickle'" in capsys.readouterr().err
    assert main(["checkpoint", "export", str(saved), str(tmp_path / "m"), "--epoch", "7"]) == 2
    assert "holds no checkpoint of epoch 7" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


# ---------------------------------------------------------------------------------------------
# Hugging Face


def _gpt2() -> tuple[object, torch.nn.Module]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True
    )
    torch.manual_seed(0)
    return config, transformers.GPT2LMHeadModel(config)


async def _gpt2_run(out: Path, module: torch.nn.Module) -> None:
    """One rank, two epochs of next-token prediction on random tokens, checkpointed."""
    tokens = torch.randint(0, 61, (6, 12), generator=torch.Generator().manual_seed(1))

    def loss(outputs: object, labels: torch.Tensor) -> torch.Tensor:
        logits = outputs.logits  # type: ignore[attr-defined]
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )

    batches = [(tokens[i : i + 2], tokens[i : i + 2]) for i in range(0, 6, 2)]
    await lampdist.train(
        data=lampdist.ModelWithData(
            model=lampdist.SupervisedModel(module, loss),
            train_batches=lambda: batches,
        ),
        optimizer_factory=adamw,
        loop=lampdist.LoopOptions(max_epochs=2, checkpoint_state=checkpoint.to_directory(out)),
        launch=lampdist.launch.LaunchEnv(rank=0, nranks=1),
        stop_on_signals=False,
    )


@pytest.mark.parametrize("form", ["safetensors", "torch"])
def test_hf_export_loads_with_from_pretrained_and_gives_the_same_logits(
    tmp_path: Path, form: str
) -> None:
    transformers = pytest.importorskip("transformers")
    config, module = _gpt2()
    anyio.run(_gpt2_run, tmp_path / "run", module)
    module.eval()
    config.save_pretrained(tmp_path / "config")  # type: ignore[attr-defined]
    target = tmp_path / "hf"
    argv = ["checkpoint", "export", str(tmp_path / "run"), str(target), "--format", form]
    assert main([*argv, "--hf", str(tmp_path / "config")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(target)
    loaded.eval()
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = module(tokens).logits
        got = loaded(tokens).logits
    assert torch.equal(got, want)
    weights = "model.safetensors" if form == "safetensors" else "pytorch_model.bin"
    assert (target / weights).is_file()
    # The Python API takes the config itself; an existing directory is refused.
    with pytest.raises(lampdist.ConfigError, match="exists: pass a new directory"):
        checkpoint.export_hf(tmp_path / "run", config, target)
    checkpoint.export_hf(tmp_path / "run", config, tmp_path / "hf2", format=form)  # type: ignore[arg-type]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2").eval()
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, want)


def test_hf_export_of_another_model_names_what_differs(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    _, module = _gpt2()
    anyio.run(_gpt2_run, tmp_path / "run", module)
    other = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=16, n_layer=3, n_head=2)
    with pytest.raises(lampdist.CheckpointError, match=r"missing \['transformer.h.2"):
        checkpoint.export_hf(tmp_path / "run", other, tmp_path / "hf")
    with pytest.raises(lampdist.ConfigError, match=r"neither a config\.json nor a directory"):
        checkpoint.export_hf(tmp_path / "run", tmp_path / "nowhere", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
