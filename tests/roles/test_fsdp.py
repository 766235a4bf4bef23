"""``step_on="fsdp"``: FSDP2 in processes of their own over Gloo trains exactly like one process
on the concatenated batches, from a model built whole or on the meta device."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import lampdist

from . import tcp_rank
from ._launch import launch_ranks, spawn
from .metrics_reference import metric_of, plain_outputs
from .reference import make_model, make_shards, reference_training

ROOT_DIR = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not hasattr(torch.distributed, "init_process_group"), reason="torch without distributed"
)


def launch(out: Path, nranks: int, *extra: str, step_on: str = "fsdp") -> list[tuple[int, str]]:
    """Every rank of :mod:`.tcp_rank` under ``step_on`` to its end: each one's exit code and
    stderr, by rank."""
    return launch_ranks("tcp_rank", out, nranks, "--step-on", step_on, *extra)


def run_ranks(out: Path, nranks: int, *extra: str, step_on: str = "fsdp") -> list[str]:
    """:func:`launch`, every rank exiting 0; their stderr."""
    ended = launch(out, nranks, *extra, step_on=step_on)
    for rank, (code, error) in enumerate(ended):
        assert code == 0, f"rank {rank}: {error}"
    return [error for _, error in ended]


def assembled(out: Path, nranks: int) -> dict[str, torch.Tensor]:
    """The whole model from every rank's shards (FSDP2 shards dimension 0, in rank order)."""
    parts = [
        torch.load(out / f"rank{rank}.pt", weights_only=True, map_location="cpu")
        for rank in range(nranks)
    ]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def reference(
    nranks: int,
    *,
    optimizer: str = "sgd",
    accumulate: int = tcp_rank.ACCUMULATE,
    clip: float | None = None,
    start: torch.nn.Module | None = None,
    epochs: int = tcp_rank.EPOCHS,
) -> tuple[torch.nn.Module, list[float], list[float]]:
    train_sizes, valid_sizes = tcp_rank.sizes(nranks)
    return reference_training(
        start if start is not None else make_model(seed=0),
        tcp_rank.OPTIMIZERS[optimizer],
        make_shards(train_sizes, seed=1),
        make_shards(valid_sizes, seed=2),
        epochs=epochs,
        accumulate=accumulate,
        max_grad_norm=clip,
    )


def assert_matches(
    out: Path, nranks: int, expected: torch.nn.Module, curve: list[list[float]]
) -> None:
    got = assembled(out, nranks)
    for name, want in expected.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-9, msg=name)
    written = json.loads((out / "curve.json").read_text())
    assert [c[0] for c in written] == pytest.approx([c[0] for c in curve], rel=1e-9)
    assert [c[1] for c in written] == pytest.approx([c[1] for c in curve], rel=1e-9)


@pytest.mark.parametrize(
    ("nranks", "accumulate", "optimizer", "clip", "unsized"),
    [
        (2, 1, "sgd", None, False),
        (2, 3, "adamw", 0.05, False),
        (3, 3, "sgd", None, False),
        (3, 1, "adamw", 0.05, True),
        (2, 3, "normalized", None, True),
    ],
)
def test_fsdp_matches_one_process(
    tmp_path: Path, nranks: int, accumulate: int, optimizer: str, clip: float | None, unsized: bool
) -> None:
    """Uneven and empty batches (a rank runs padding passes where it has none), accumulation
    with one gradient reduce per step, clipping by the norm over every rank's shards, and an
    optimizer that is not elementwise (each tensor's norm spans every rank's shard): the
    weights and the learning curve of one float64 process on the concatenated batches. With
    sources of known length every rank knows each step's forwards; without (``unsized``) the
    ranks agree on them before each forward."""
    extra = ["--accumulate", str(accumulate), "--optimizer", optimizer]
    if unsized:
        extra.append("--unsized")
    if clip is not None:
        extra += ["--clip", str(clip)]
    run_ranks(tmp_path, nranks, *extra)
    expected, train, valid = reference(
        nranks, optimizer=optimizer, accumulate=accumulate, clip=clip
    )
    assert_matches(tmp_path, nranks, expected, [[a, b] for a, b in zip(train, valid, strict=True)])


@pytest.mark.parametrize("clip", [None, 0.05])
def test_the_gradient_norm_is_every_ranks_as_under_every_rank(
    tmp_path: Path, clip: float | None
) -> None:
    """Each pass's gradient norm (before clipping) over every rank's shards, with
    accumulation and uneven batches, equals the one ``step_on="every_rank"`` reports on the
    same batches (which equals ``clip_grad_norm_`` on one process: tests/epoch/
    test_telemetry.py), to 1e-9 in float64."""
    norms = {}
    for step_on in ("fsdp", "every_rank"):
        out = tmp_path / step_on
        out.mkdir()
        extra = ["--grad-norm", "--accumulate", "3"] + (
            [] if clip is None else ["--clip", str(clip)]
        )
        run_ranks(out, 2, *extra, step_on=step_on)
        lines = (out / "grad_norms.jsonl").read_text().splitlines()
        norms[step_on] = [json.loads(line) for line in lines]
    assert len(norms["fsdp"]) == tcp_rank.EPOCHS
    assert all(mean > 0 and largest >= mean for mean, largest in norms["fsdp"])
    for got, want in zip(norms["fsdp"], norms["every_rank"], strict=True):
        assert got == pytest.approx(want, rel=0, abs=1e-9)


def test_the_in_process_loop_refuses_fsdp() -> None:
    import anyio

    async def main() -> None:
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(make_model(), torch.nn.functional.mse_loss),
                    train_batches=list,
                )
                for _ in range(2)
            ],
            optimizer_factory=tcp_rank.sgd,
            loop=lampdist.LoopOptions(max_epochs=1),
            step=lampdist.StepOptions(step_on="fsdp"),
        )

    with pytest.raises(lampdist.ConfigError, match="one process per rank"):
        anyio.run(main)


@pytest.mark.slow
def test_a_model_built_on_the_meta_device_starts_from_the_roots_weights(tmp_path: Path) -> None:
    """Each rank builds the model on the meta device after seeding its RNG differently; each
    allocates and initializes its own shards only. On 1, 2 and 3 ranks the whole model is the
    same (every rank computed the root's values), a real initialization, and training from it
    matches one process that starts from it."""
    inits = {}
    for nranks in (1, 2, 3):
        out = tmp_path / f"init{nranks}"
        out.mkdir()
        run_ranks(out, nranks, "--meta", "--epochs", "0")
        inits[nranks] = assembled(out, nranks)
    for nranks in (2, 3):
        for name, want in inits[1].items():
            assert torch.equal(inits[nranks][name], want), (nranks, name)
    weight = inits[1]["0.weight"]
    assert 0 < weight.abs().max() <= 3**-0.5  # Linear(3, 6)'s own uniform bound
    assert len(set(weight.flatten().tolist())) == weight.numel()
    start = make_model(seed=0)
    start.load_state_dict(inits[1])
    run_ranks(tmp_path, 2, "--meta")
    expected, train, valid = reference(2, start=start)
    assert_matches(tmp_path, 2, expected, [[a, b] for a, b in zip(train, valid, strict=True)])


def test_a_sharded_module_with_nothing_on_a_rank_fails_before_training(tmp_path: Path) -> None:
    """Linear(6, 1) as a unit of its own over 3 ranks leaves ranks 1 and 2 without an element
    of it: every rank fails at setup, naming the ranks and the module."""
    ended = launch(tmp_path, 3, "--shard-linear")
    assert all(code != 0 for code, _ in ended)
    root_err = ended[0][1]
    assert "ranks [1, 2] hold no element of the parameters of sharded module '2'" in root_err
    assert "phase 'configure'" in root_err
    assert not (tmp_path / "curve.json").exists()


def test_the_policy_reads_the_same_in_every_process_and_names_what_differs() -> None:
    """The agreement check compares FsdpPolicy's text: the same in another process for the
    same policy (no addresses in it), different for another parallelize or precision."""
    code = (
        "import lampdist, torch; from tests.roles import tcp_rank; "
        "print(repr(lampdist.FsdpPolicy(shard_modules=(torch.nn.Linear,), "
        "parallelize=tcp_rank.shard_linears, "
        "precision=lampdist.Precision(param_dtype=torch.bfloat16))))"
    )
    printed = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT_DIR, capture_output=True, text=True, check=True
    ).stdout.strip()
    here = lampdist.FsdpPolicy(
        shard_modules=(torch.nn.Linear,),
        parallelize=tcp_rank.shard_linears,
        precision=lampdist.Precision(param_dtype=torch.bfloat16),
    )
    assert printed == repr(here)
    assert "tests.roles.tcp_rank.shard_linears" in printed and "param bfloat16" in printed
    other = lampdist.FsdpPolicy(shard_modules=(torch.nn.Linear,), parallelize=tcp_rank.shard_root)
    fields = dict(lampdist.StepOptions(step_on="fsdp", fsdp=here).agreed_fields())
    assert (
        fields["fsdp"]
        != dict(lampdist.StepOptions(step_on="fsdp", fsdp=other).agreed_fields())["fsdp"]
    )


def _not_a_policy() -> object:
    return lampdist.StepOptions(step_on="fsdp", fsdp="blocks")  # type: ignore[arg-type]


def _not_callable() -> object:
    return lampdist.FsdpPolicy(parallelize=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: lampdist.StepOptions(step_on="fsdp", bucket_cap_mb=25), "bucket_cap_mb"),
        (_not_a_policy, "FsdpPolicy"),
        (lambda: lampdist.FsdpPolicy(shard_modules=("Block",)), "module classes"),
        (lambda: lampdist.Precision(param_dtype=torch.int8), "floating torch.dtype"),
        (_not_callable, "callable"),
    ],
)
def test_bad_fsdp_options_fail_when_built(make: Any, match: str) -> None:
    with pytest.raises(lampdist.ConfigError, match=match):
        make()


def _parts(out: Path, nranks: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole model and the whole optimizer state (``name/key``) from every rank's part;
    each rank's part of an fsdp run is dimension 0's chunk, of a whole run the whole."""
    model = assembled(out, nranks)
    optims = [
        torch.load(out / f"optim{rank}.pt", weights_only=True, map_location="cpu")
        for rank in range(nranks)
    ]
    optimizer = {}
    for name, state in optims[0].items():
        for key, value in state.items():
            pieces = [part[name][key] for part in optims]
            whole = value if value.dim() == 0 else torch.cat(pieces)
            optimizer[f"{name}/{key}"] = whole
    return model, optimizer


def _whole(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The root's whole model and optimizer state of a run under a whole-model design."""
    model = torch.load(out / "rank0.pt", weights_only=True)
    optim = torch.load(out / "optim0.pt", weights_only=True)
    return model, {f"{n}/{k}": v for n, state in optim.items() for k, v in state.items()}


Parts = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]


def _assert_bitwise(got: Parts, want: Parts) -> None:
    for held, saved in zip(got, want, strict=True):
        assert sorted(held) == sorted(saved)
        for name, value in saved.items():
            assert torch.equal(held[name], value), name


@pytest.mark.slow
def test_checkpoints_reshard_between_rank_counts_and_designs(tmp_path: Path) -> None:
    """Every rank writes its own shards; the checkpoint loads on another number of ranks and
    under another design, each rank then holding exactly (bitwise) its part of what was
    saved, model and optimizer state: fsdp 2 -> fsdp 3 -> (trains, saves) -> fsdp 2,
    fsdp 2 -> root on 1 rank, root on 2 ranks -> fsdp 2. A resumed run ends where one
    uninterrupted process on the same data ends."""
    saved2, saved3, saved_root = tmp_path / "c2", tmp_path / "c3", tmp_path / "croot"
    runs = {name: tmp_path / name for name in ("a", "b", "c", "d", "e", "f", "g")}
    for out in runs.values():
        out.mkdir()
    # fsdp on 2 ranks, one epoch, checkpointed.
    run_ranks(runs["a"], 2, "--epochs", "1", "--optimizer", "adamw", "--checkpoint", str(saved2))
    written = _parts(runs["a"], 2)
    # fsdp on 3 ranks resumes from it (nothing to train): its shards are the saved ones.
    run_ranks(runs["b"], 3, "--epochs", "1", "--optimizer", "adamw", "--resume", str(saved2))
    _assert_bitwise(_parts(runs["b"], 3), written)
    # fsdp on 3 ranks trains an epoch on and saves; fsdp on 2 ranks resumes from that.
    extra = ("--epochs", "2", "--optimizer", "adamw")
    run_ranks(runs["c"], 3, *extra, "--resume", str(saved2), "--checkpoint", str(saved3))
    run_ranks(runs["d"], 2, *extra, "--resume", str(saved3))
    _assert_bitwise(_parts(runs["d"], 2), _parts(runs["c"], 3))
    # The root design on one rank reads the sharded checkpoint whole.
    run_whole(runs["e"], 1, "--epochs", "1", "--optimizer", "adamw", "--resume", str(saved2))
    _assert_bitwise(_whole(runs["e"]), written)
    # A checkpoint of the root design (whole state dicts) loads into fsdp on 2 ranks.
    run_whole(
        runs["f"], 2, "--epochs", "1", "--optimizer", "adamw", "--checkpoint", str(saved_root)
    )
    run_ranks(runs["g"], 2, "--epochs", "1", "--optimizer", "adamw", "--resume", str(saved_root))
    _assert_bitwise(_parts(runs["g"], 2), _whole(runs["f"]))
    # And the resumed fsdp run of the same data ends where one process ends.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    run_ranks(resumed, 2, "--epochs", "2", "--optimizer", "adamw", "--resume", str(saved2))
    expected, train, valid = reference(2, optimizer="adamw", epochs=2)
    assert_matches(resumed, 2, expected, [[a, b] for a, b in zip(train, valid, strict=True)])


@pytest.mark.slow
def test_sharded_checkpoints_in_an_object_store_are_uploaded_by_each_rank_and_reshard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``to_url``, every rank uploads its own shards under the checkpoint's ``shards/``
    prefix of a real S3 server, the root commits the manifest last; the checkpoint loads on
    another number of ranks (each rank downloading the shards) and whole under another
    design, bitwise; ``lampdist checkpoint consolidate URL`` reads it whole."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    import obstore
    from obstore.store import from_url

    from ..checkpoint.s3_server import set_environment, start_server

    server = start_server()
    try:
        set_environment(monkeypatch, server)
        url = f"s3://{server.create_bucket()}/fsdp-run"
        runs = {name: tmp_path / name for name in ("a", "b", "c")}
        for out in runs.values():
            out.mkdir()
        run_ranks(runs["a"], 2, "--epochs", "1", "--optimizer", "adamw", "--checkpoint", url)
        written = _parts(runs["a"], 2)
        keys = sorted(meta["path"] for chunk in obstore.list(from_url(url)) for meta in chunk)
        assert [key for key in keys if "/shards/" in key] == [
            "epoch-000001/shards/.metadata",
            "epoch-000001/shards/__0_0.distcp",
            "epoch-000001/shards/__1_0.distcp",
        ]
        assert "epoch-000001/manifest.json" in keys
        run_ranks(runs["b"], 3, "--epochs", "1", "--optimizer", "adamw", "--resume", url)
        _assert_bitwise(_parts(runs["b"], 3), written)
        run_whole(runs["c"], 1, "--epochs", "1", "--optimizer", "adamw", "--resume", url)
        _assert_bitwise(_whole(runs["c"]), written)
        target = tmp_path / "model.pt"
        done = subprocess.run(
            [sys.executable, "-m", "lampdist", "checkpoint", "consolidate", url, str(target)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        model = torch.load(target, weights_only=True)
        assert sorted(model) == sorted(written[0])
        assert all(torch.equal(model[name], value) for name, value in written[0].items())
    finally:
        server.kill()


def run_whole(out: Path, nranks: int, *extra: str) -> None:
    """:mod:`.tcp_rank` under the root design (whole state dicts) on ``nranks`` ranks."""
    run_ranks(out, nranks, *extra, step_on="root")


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An fsdp run on 2 ranks checkpointed after each of its 2 epochs: (its output, the
    checkpoint directory)."""
    base = tmp_path_factory.mktemp("fsdp-checkpoints")
    out, saved = base / "out", base / "saved"
    out.mkdir()
    run_ranks(out, 2, "--epochs", "2", "--checkpoint", str(saved))
    return out, saved


def test_consolidate_writes_the_whole_model(
    two_checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    """``lampdist checkpoint consolidate DIR OUT`` writes the newest checkpoint's model as one
    plain state_dict: the run's final weights, which no rank held whole."""
    out, saved = two_checkpoints
    target = tmp_path / "model.pt"
    done = subprocess.run(
        [sys.executable, "-m", "lampdist", "checkpoint", "consolidate", str(saved), str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "epoch-000002" in done.stdout
    model = torch.load(target, weights_only=True)
    final = assembled(out, 2)
    assert sorted(model) == sorted(final)
    for name, value in final.items():
        assert torch.equal(model[name], value), name
    module = make_model()
    module.load_state_dict(model)  # a plain state_dict of the model


@pytest.mark.parametrize("damage", ["flip", "remove"])
def test_a_damaged_or_missing_shard_falls_back_to_the_previous_checkpoint(
    two_checkpoints: tuple[Path, Path], tmp_path: Path, damage: str, caplog: Any
) -> None:
    _, saved = two_checkpoints
    copy = tmp_path / "saved"
    shutil.copytree(saved, copy)
    shard = copy / "epoch-000002" / "shards" / "__1_0.distcp"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
    resumed = lampdist.checkpoint.load_latest(copy)
    assert resumed is not None and resumed.epoch == 1
    assert resumed.training_state.shards is not None
    assert resumed.training_state.shards.path == copy / "epoch-000001" / "shards"
    assert resumed.training_state.shards.nranks == 2
    assert dict(resumed.training_state.shards.precision) == {
        "param_dtype": None,
        "reduce_dtype": None,
        "output_dtype": None,
    }
    assert "skipping damaged checkpoint" in caplog.text and "__1_0.distcp" in caplog.text


def test_a_checkpoint_of_another_model_fails_at_load_naming_rank_and_phase(
    two_checkpoints: tuple[Path, Path], tmp_path: Path
) -> None:
    """Resuming a wider model from the checkpoint fails on every rank before training, the
    checkpoint left as it was."""
    _, saved = two_checkpoints
    before = sorted(p.name for p in saved.iterdir())
    (root_code, root_err), (follower_code, follower_err) = launch(
        tmp_path, 2, "--width", "8", "--resume", str(saved)
    )
    assert root_code != 0 and follower_code != 0
    assert "CheckpointError" in root_err and "phase 'resume'" in root_err
    assert "does not load into this run's model" in root_err
    assert "phase 'resume'" in follower_err
    assert sorted(p.name for p in saved.iterdir()) == before
    assert not (tmp_path / "curve.json").exists()


def test_metrics_count_no_padding_pass(tmp_path: Path) -> None:
    """The padding passes of a rank without a batch add nothing to the metrics: lampdist's
    metric and a torchmetrics one equal one process's on the concatenated batches."""
    pytest.importorskip("torchmetrics")
    run_ranks(tmp_path, 2, "--metrics")
    _, training, validation = plain_outputs(
        make_model(seed=0),
        tcp_rank.sgd,
        make_shards(tcp_rank.SIZES, seed=1),
        make_shards(tcp_rank.VALID_SIZES, seed=2),
        epochs=tcp_rank.EPOCHS,
        accumulate=tcp_rank.ACCUMULATE,
    )
    squared = lampdist.Metric(lambda out, y: (((out - y) ** 2).sum(), y.numel()))
    points = json.loads((tmp_path / "metrics.json").read_text())
    assert len(points) == tcp_rank.EPOCHS
    for epoch, got in enumerate(points):
        for kind, outputs in (("training", training[epoch]), ("validation", [validation[epoch]])):
            assert got[f"{kind}_mae"] == pytest.approx(
                metric_of(tcp_rank.METRIC, outputs), rel=1e-9
            )
            assert got[f"{kind}_mse"] == pytest.approx(metric_of(squared, outputs), rel=1e-9)


@pytest.mark.slow
def test_bf16_precision_trains_like_one_process_with_the_same_policy(tmp_path: Path) -> None:
    """Precision(param_dtype=bfloat16) gathers the parameters in bfloat16 for forward and
    backward: 2 ranks end within bfloat16's rounding (1e-2) of one process under the same
    policy on each step's concatenated batches, and measurably away (over 1e-4) from the
    float64 run, so the policy took effect. (The ranks' partial sums round differently from
    one process's: the two differ by about 2e-3, bfloat16's own step at these weights.)"""
    runs = {name: tmp_path / name for name in ("two", "one", "exact")}
    for out in runs.values():
        out.mkdir()
    run_ranks(runs["two"], 2, "--bf16", "--accumulate", "1")
    run_ranks(runs["one"], 1, "--bf16", "--accumulate", "1", "--concatenated")
    run_ranks(runs["exact"], 2, "--accumulate", "1")
    two, one, exact = (
        assembled(runs["two"], 2),
        assembled(runs["one"], 1),
        assembled(runs["exact"], 2),
    )
    for name, value in two.items():
        torch.testing.assert_close(value, one[name], rtol=0, atol=1e-2, msg=name)
    assert max((two[name] - exact[name]).abs().max().item() for name in two) > 1e-4


def test_accumulation_reduces_the_gradients_once_a_step(tmp_path: Path) -> None:
    """With accumulation over 3 batches each rank runs 2 steps an epoch (5 and 4 batches,
    padding passes included) and FSDP2 reduce-scatters the gradients in each step's last
    backward only: 4 reduce-scatters in 2 epochs, not one per backward."""
    run_ranks(tmp_path, 2, "--accumulate", "3", "--count-reduces")
    for rank in range(2):
        assert json.loads((tmp_path / f"reduces{rank}.json").read_text()) == [4], rank


@pytest.mark.parametrize("accumulate", [1, 3])
def test_fsdp_alone_matches_one_process(tmp_path: Path, accumulate: int) -> None:
    """One rank under fsdp (a mesh of one) steps as a plain loop, each loss weighted by its
    share of the step's examples: on each step's concatenated batches it ends where one
    float64 process ends, with accumulation too."""
    run_ranks(tmp_path, 1, "--concatenated", "--accumulate", str(accumulate))
    expected, train, valid = reference(2, accumulate=accumulate)
    assert_matches(tmp_path, 1, expected, [[a, b] for a, b in zip(train, valid, strict=True)])


def test_a_killed_follower_ends_the_run_naming_it(tmp_path: Path) -> None:
    """A follower killed mid-run (its FSDP2 collectives gone with it): the root fails within
    seconds, naming rank 1 and the phase, and exits."""
    root = spawn("tcp_rank", 0, 2, tmp_path, 0, "--step-on", "fsdp", "--epochs", "100000")
    follower = None
    try:
        assert root.stdout is not None
        port = int(root.stdout.readline().split()[1])
        follower = spawn(
            "tcp_rank", 1, 2, tmp_path, port, "--step-on", "fsdp", "--epochs", "100000"
        )
        deadline = time.monotonic() + 120  # a training pass done: well into training
        while not (tmp_path / "trained").exists():
            assert root.poll() is None and follower.poll() is None
            assert time.monotonic() < deadline, "no training pass done within 120 s"
            time.sleep(0.05)
        assert root.poll() is None and follower.poll() is None
        follower.kill()
        killed = time.monotonic()
        _, root_err = root.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        for process in (root, follower):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert root.returncode != 0
    # the kill lands in a training or a validation pass, whichever runs then
    assert re.search(r"rank 1, phase '(train|valid)'", root_err), root_err[-2000:]
    assert took < 30  # a deadline, not a speed: the collective timeout is far longer


@pytest.mark.slow
def test_a_non_finite_loss_names_its_rank_or_is_skipped_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's second batch has a NaN target. By default every rank fails with
    NonFiniteLoss naming rank 1; with non_finite_loss='skip' every rank skips that step (in
    each epoch) and the run ends with finite weights and learning curve."""
    raised = tmp_path / "raise"
    raised.mkdir()
    (root_code, root_err), (follower_code, _) = launch(raised, 2, "--nan-at", "1")
    assert root_code != 0 and follower_code != 0
    assert "NonFiniteLoss" in root_err and "the loss of rank 1 was nan" in root_err
    skipped = tmp_path / "skip"
    skipped.mkdir()
    errors = run_ranks(skipped, 2, "--nan-at", "1", "--non-finite", "skip")
    assert errors[0].count("skipping the step: the loss of rank 1 was nan") == tcp_rank.EPOCHS
    curve = json.loads((skipped / "curve.json").read_text())
    assert all(math.isfinite(value) for point in curve for value in point)
    assert all(torch.isfinite(value).all() for value in assembled(skipped, 2).values())


@pytest.mark.slow
def test_fp16_loss_scaling_skips_and_steps_as_every_rank_does(tmp_path: Path) -> None:
    """float16 autocast with dynamic loss scaling on a loss large enough to overflow at the
    first scales: every rank of fsdp checks the overflow over all shards and skips the same
    steps as step_on='every_rank' does on whole gradients; the weights end the same, and away
    from where they started (steps were taken)."""
    fsdp, every = tmp_path / "fsdp", tmp_path / "every"
    fsdp.mkdir()
    every.mkdir()
    run_ranks(fsdp, 2, "--fp16", "--accumulate", "1")
    run_ranks(every, 2, "--fp16", "--accumulate", "1", step_on="every_rank")
    got, want = assembled(fsdp, 2), torch.load(every / "rank0.pt", weights_only=True)
    start = make_model(seed=0).float().state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
        assert (value - start[name]).abs().max() > 1e-3, name
    curves = [json.loads((out / "curve.json").read_text()) for out in (fsdp, every)]
    flat = [[value for point in curve for value in point] for curve in curves]
    assert flat[0] == pytest.approx(flat[1], rel=1e-6)


def test_a_graceful_stop_ends_the_epoch_and_checkpoints_it(tmp_path: Path) -> None:
    """The root's stop, asked for in the middle of epoch 1's training pass: every rank
    finishes that epoch (its forwards still in step), the checkpoint holds every rank's
    shards of it, and the run resumes from there to the uninterrupted run's end."""
    saved = tmp_path / "saved"
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    run_ranks(stopped, 2, "--epochs", "4", "--stop-in-epoch", "1", "--checkpoint", str(saved))
    assert len(json.loads((stopped / "curve.json").read_text())) == 2
    resumed = lampdist.checkpoint.load_latest(saved)
    assert resumed is not None and resumed.epoch == 2 and resumed.training_state.shards
    after = tmp_path / "after"
    after.mkdir()
    run_ranks(after, 2, "--epochs", "4", "--resume", str(saved))
    expected, train, valid = reference(2, epochs=4)
    assert_matches(after, 2, expected, [[a, b] for a, b in zip(train, valid, strict=True)])


def test_a_cancelled_root_ends_every_follower_naming_it(tmp_path: Path) -> None:
    """The root's task cancelled in the middle of a training pass (the followers in FSDP2's
    collectives with it): the root's clique and default group are torn down, and the
    follower fails within seconds, naming rank 0, instead of waiting in a collective."""
    started = time.monotonic()
    (root_code, root_err), (follower_code, follower_err) = launch(
        tmp_path, 2, "--epochs", "100000", "--cancel-in-epoch", "2"
    )
    took = time.monotonic() - started
    assert root_code == 0, root_err  # the root's own cancellation, caught by its script
    assert follower_code != 0
    last = follower_err.strip().splitlines()[-1]
    assert "RankFailed: rank 0" in last and "cancelled" in last, follower_err[-2000:]
    assert "TrainingError" not in follower_err  # not the model's error on rank 1
    assert took < 60  # a deadline, not a speed: the collective timeout is far longer


@pytest.mark.slow
@pytest.mark.parametrize("step_on", ["fsdp", "every_rank"])
def test_a_stalled_follower_times_out_as_a_collective_not_as_the_model(
    tmp_path: Path, step_on: str
) -> None:
    """Rank 1's source sleeps 12 s in a step; with collective_timeout 4 s the root's
    collective (FSDP2's, or the gradients' all-reduce) times out within that deadline, and the
    root reports the clique's timeout (naming the limit), not the model's error, with where
    every rank is: both at the first step, rank 1 in no collective, and under every_rank the
    root waiting in the step's all-reduce (FSDP2's collectives, in torch's default group, are
    not numbered)."""
    started = time.monotonic()
    (root_code, root_err), (follower_code, _) = launch(
        tmp_path, 2, "--stall-at", "1", "--collective-timeout", "4", step_on=step_on
    )
    took = time.monotonic() - started
    assert root_code != 0 and follower_code != 0
    assert "TrainingError" not in root_err
    tail = root_err[-3000:]
    assert re.search(r"CliqueTimeout: rank 0, .*collective_timeout=4.0 s", root_err), tail
    assert re.search(r"Where the ranks are: rank 0 at epoch 0 train step 0 ", root_err), tail
    assert re.search(
        r"rank 1 at epoch 0 train step 0 \(for [\d.]+ s\): not in a collective", root_err
    ), tail
    if step_on == "every_rank":
        assert re.search(r"rank 0 at [^;]*: waiting [\d.]+ s in all_reduce #\d+", root_err), tail
    assert took < 60
