"""Loading a chosen checkpoint: by its path, a symlink to it or a copy of it, by its URL in an
object store (a real S3 endpoint, moto's server), by epoch; ``train(resume=path)``; the CLI's
``--epoch``; and the errors of a bad choice."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import anyio
import pytest
import torch

import lampdist
from lampdist import checkpoint
from lampdist._checkpoint import write_checkpoint
from lampdist._checkpoint._rng import capture_rng_states
from lampdist.cli import main

from ..roles.reference import make_model, make_shards, mse
from .checkpoint_writer import expected_state
from .test_checkpoint import assert_identical


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def write_epochs(directory: Path, *epochs: int) -> None:
    for epoch in epochs:
        state, lr_state = expected_state(epoch)
        write_checkpoint(
            directory, state, lr_state, capture_rng_states(), keep=5, check=lambda: None
        )


def names(directory: Path) -> list[str]:
    """The checkpoints' names in ``directory`` (the writer's lock file left out)."""
    return sorted(path.name for path in directory.iterdir() if path.name.startswith("epoch-"))


def model_of(epoch: int) -> dict[str, torch.Tensor]:
    return dict(expected_state(epoch)[0].model_state)


def test_a_chosen_epoch_loads_by_path_and_by_epoch(tmp_path: Path) -> None:
    write_epochs(tmp_path, 1, 2, 3)
    for resumed in (
        checkpoint.load(tmp_path / "epoch-000002"),
        checkpoint.load(str(tmp_path / "epoch-000002")),
        checkpoint.load(tmp_path, epoch=2),
    ):
        assert resumed.epoch == 2
        assert resumed.path == tmp_path / "epoch-000002"
        assert_identical(dict(resumed.training_state.model_state), model_of(2))
    assert checkpoint.load(tmp_path, epoch=2, restore_rng=True).rng_states is not None


def test_a_symlinked_or_copied_checkpoint_loads_as_the_original(tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    write_epochs(run, 1, 2)
    other.mkdir()
    (other / "epoch-000001").symlink_to(run / "epoch-000001", target_is_directory=True)
    shutil.copytree(run / "epoch-000002", tmp_path / "my-best")
    assert_identical(dict(checkpoint.load(other / "epoch-000001").training_state.model_state),
                     model_of(1))  # fmt: skip
    assert_identical(dict(checkpoint.load(tmp_path / "my-best").training_state.model_state),
                     model_of(2))  # fmt: skip
    latest = checkpoint.load_latest(other)  # the run directory of links counts them
    assert latest is not None and latest.epoch == 1
    assert [item.name for item in checkpoint_list(other)] == ["epoch-000001"]


def checkpoint_list(directory: Path) -> list[lampdist._checkpoint.Listed]:
    from lampdist._checkpoint import list_checkpoints

    return list_checkpoints(directory, verify=True)


def test_pruning_a_symlinked_checkpoint_removes_the_link_not_its_target(tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    write_epochs(run, 1)
    other.mkdir()
    (other / "epoch-000001").symlink_to(run / "epoch-000001", target_is_directory=True)
    state, lr_state = expected_state(2)
    write_checkpoint(other, state, lr_state, capture_rng_states(), keep=1, check=lambda: None)
    left = sorted(path.name for path in other.iterdir() if path.name != ".lock")
    assert left == ["epoch-000002"]  # the link is gone, no leftover of it
    assert checkpoint.load(run / "epoch-000001").epoch == 1  # the target is whole


def test_a_checkpoint_loads_by_its_url(s3_url: str) -> None:
    anyio.run(_write_to_url, s3_url)
    resumed = checkpoint.load(f"{s3_url}/epoch-000001")
    assert resumed.path == f"{s3_url}/epoch-000001" and resumed.epoch == 1
    assert_identical(dict(resumed.training_state.model_state), model_of(1))
    assert checkpoint.load(s3_url, epoch=2).epoch == 2
    with pytest.raises(lampdist.ConfigError, match="run's checkpoint directory"):
        checkpoint.load(s3_url)
    with pytest.raises(lampdist.ConfigError, match=r"holds no checkpoint of epoch 7"):
        checkpoint.load(s3_url, epoch=7)


async def _write_to_url(url: str) -> None:
    write = checkpoint.to_url(url, keep=5)
    for epoch in (1, 2):
        state, lr_state = expected_state(epoch)
        await write(state, lr_state)


def test_bad_choices_are_config_errors_saying_what_to_pass(tmp_path: Path) -> None:
    write_epochs(tmp_path / "run", 1, 3)
    (tmp_path / "empty").mkdir()
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: checkpoint.load(tmp_path / "run", epoch=2), r"epoch=2: .* epochs \[1, 3\]"),
        (lambda: checkpoint.load(tmp_path / "run"), "not one checkpoint: pass one of its"),
        (lambda: checkpoint.load(tmp_path / "empty"), "is no checkpoint .*manifest.json"),
        (lambda: checkpoint.load(tmp_path / "nowhere"), "is no directory"),
        (lambda: checkpoint.load(tmp_path / "run", epoch="2"), "epoch='2': pass an int"),  # type: ignore[arg-type]
    ]
    for call, match in cases:
        with pytest.raises(lampdist.ConfigError, match=match):
            call()


def test_a_damaged_chosen_checkpoint_is_an_error_not_skipped(tmp_path: Path) -> None:
    write_epochs(tmp_path, 1, 2)
    target = tmp_path / "epoch-000002" / "model.tensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    with pytest.raises(lampdist.CheckpointError, match=r"epoch-000002 is damaged .*model\.tensors"):
        checkpoint.load(tmp_path / "epoch-000002")


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


async def _train(out: Path, *, max_epochs: int, resume: object = None) -> lampdist.LoopState:
    module = make_model()
    shard = make_shards([[6, 5, 7]], seed=21)[0]
    return await lampdist.train(
        data=lampdist.ModelWithData(
            model=lampdist.SupervisedModel(module, mse),
            train_batches=functools.partial(list, shard),
        ),
        optimizer_factory=adamw,
        loop=lampdist.LoopOptions(
            max_epochs=max_epochs, checkpoint_state=checkpoint.to_directory(out, keep=5)
        ),
        resume=resume,  # type: ignore[arg-type]
        launch=lampdist.launch.LaunchEnv(rank=0, nranks=1),
        stop_on_signals=False,
    )


def losses(state: lampdist.LoopState) -> list[float]:
    return [point.training_loss for point in state.learning_curve]


async def test_train_resumes_from_the_path_of_a_chosen_checkpoint(tmp_path: Path) -> None:
    """``resume=`` takes a checkpoint's path (``os.PathLike`` or ``str``): the run goes on
    from that epoch and ends as the uninterrupted one (its curve, bit for bit)."""
    first = await _train(tmp_path / "a", max_epochs=3)
    again = await _train(tmp_path / "b", max_epochs=3, resume=tmp_path / "a" / "epoch-000001")
    assert again.epoch == 3
    assert losses(again) == losses(first)
    assert names(tmp_path / "b") == ["epoch-000002", "epoch-000003"]
    from_str = await _train(tmp_path / "c", max_epochs=3, resume=str(tmp_path / "a/epoch-000002"))
    assert losses(from_str) == losses(first)
    assert names(tmp_path / "c") == ["epoch-000003"]
    with pytest.raises(lampdist.ConfigError, match=r"resume=int: pass a checkpoint\.Resumed"):
        await _train(tmp_path / "d", max_epochs=1, resume=3)


def test_the_cli_takes_an_epoch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    write_epochs(run, 1, 2, 3)
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "consolidate", str(run), str(out), "--epoch", "2"]) == 0
    assert "epoch-000002" in capsys.readouterr().out
    assert_identical(torch.load(out, weights_only=True), model_of(2))
    assert (
        main(["checkpoint", "export", str(run), str(out), "--format", "torch", "--epoch", "1"]) == 0
    )
    assert_identical(torch.load(out, weights_only=True), model_of(1))
    assert main(["checkpoint", "consolidate", str(run), str(out), "--epoch", "9"]) == 2
    error = capsys.readouterr().err
    assert "holds no checkpoint of epoch 9 (it holds those of epochs [1, 2, 3])" in error
