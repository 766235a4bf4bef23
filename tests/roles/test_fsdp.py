"""``step_on="fsdp"``: FSDP2 in processes of their own over Gloo trains exactly like one process
on the concatenated batches, from a model built whole or on the meta device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lampdist

from . import tcp_rank
from .reference import make_model, make_shards, reference_training

ROOT_DIR = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not hasattr(torch.distributed, "init_process_group"), reason="torch without distributed"
)


def spawn(rank: int, nranks: int, out: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "LAMPDIST_SECRET": "test-secret", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.roles.tcp_rank", "--rank", str(rank)]
        + ["--nranks", str(nranks), "--port", str(port), "--out", str(out), *extra],
        cwd=ROOT_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_ranks(out: Path, nranks: int, *extra: str) -> list[str]:
    """Every rank of :mod:`.tcp_rank` under fsdp to the end; returns their stderr (each must
    exit 0)."""
    extra = ("--step-on", "fsdp", *extra)
    root = spawn(0, nranks, out, 0, *extra)
    followers: list[subprocess.Popen[str]] = []
    try:
        assert root.stdout is not None
        line = root.stdout.readline()
        assert line.startswith("PORT "), line + (root.stderr.read() if root.stderr else "")
        port = int(line.split()[1])
        followers = [spawn(rank, nranks, out, port, *extra) for rank in range(1, nranks)]
        results = [process.communicate(timeout=120) for process in [root, *followers]]
    finally:
        for process in [root, *followers]:
            if process.poll() is None:
                process.kill()
                process.wait()
    errors = [err for _, err in results]
    for rank, process in enumerate([root, *followers]):
        assert process.returncode == 0, f"rank {rank}: {errors[rank]}"
    return errors


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


def assert_matches(out: Path, nranks: int, expected: torch.nn.Module, curve: list[list[float]]):
    got = assembled(out, nranks)
    for name, want in expected.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-9, msg=name)
    written = json.loads((out / "curve.json").read_text())
    assert [c[0] for c in written] == pytest.approx([c[0] for c in curve], rel=1e-9)
    assert [c[1] for c in written] == pytest.approx([c[1] for c in curve], rel=1e-9)


@pytest.mark.parametrize(
    ("nranks", "accumulate", "optimizer", "clip"),
    [
        (2, 1, "sgd", None),
        (2, 3, "adamw", 0.05),
        (3, 3, "sgd", None),
        (3, 1, "adamw", 0.05),
        (2, 3, "normalized", None),
    ],
)
def test_fsdp_matches_one_process(
    tmp_path: Path, nranks: int, accumulate: int, optimizer: str, clip: float | None
) -> None:
    """Uneven and empty batches (a rank runs padding passes where it has none), accumulation
    with one gradient reduce per step, clipping by the norm over every rank's shards, and an
    optimizer that is not elementwise (each tensor's norm spans every rank's shard): the
    weights and the learning curve of one float64 process on the concatenated batches."""
    extra = ["--accumulate", str(accumulate), "--optimizer", optimizer]
    if clip is not None:
        extra += ["--clip", str(clip)]
    run_ranks(tmp_path, nranks, *extra)
    expected, train, valid = reference(nranks, optimizer=optimizer, accumulate=accumulate, clip=clip)
    assert_matches(tmp_path, nranks, expected, [[a, b] for a, b in zip(train, valid, strict=True)])


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
    root = spawn(0, 3, tmp_path, 0, "--step-on", "fsdp", "--shard-linear")
    followers: list[subprocess.Popen[str]] = []
    try:
        assert root.stdout is not None
        port = int(root.stdout.readline().split()[1])
        followers = [
            spawn(rank, 3, tmp_path, port, "--step-on", "fsdp", "--shard-linear")
            for rank in (1, 2)
        ]
        errors = [process.communicate(timeout=120)[1] for process in [root, *followers]]
    finally:
        for process in [root, *followers]:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert root.returncode != 0
    assert "ranks [1, 2] hold no element of the parameters of sharded module '2'" in errors[0]
    assert "phase 'configure'" in errors[0]
    assert not (tmp_path / "curve.json").exists()


def test_the_policy_reads_the_same_in_every_process_and_names_what_differs() -> None:
    """The agreement check compares FsdpPolicy's text: the same in another process for the
    same policy (no addresses in it), different for another parallelize or precision."""
    code = (
        "import lampdist, torch; from tests.roles import tcp_rank; "
        "print(repr(lampdist.FsdpPolicy(shard_modules=(torch.nn.Linear,), "
        "parallelize=tcp_rank.sgd, precision=lampdist.Precision(param_dtype=torch.bfloat16))))"
    )
    printed = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT_DIR, capture_output=True, text=True, check=True
    ).stdout.strip()
    here = lampdist.FsdpPolicy(
        shard_modules=(torch.nn.Linear,),
        parallelize=tcp_rank.sgd,
        precision=lampdist.Precision(param_dtype=torch.bfloat16),
    )
    assert printed == repr(here)
    assert "tests.roles.tcp_rank.sgd" in printed and "param bfloat16" in printed
    other = lampdist.FsdpPolicy(shard_modules=(torch.nn.Linear,), parallelize=tcp_rank.adamw)
    fields = dict(lampdist.StepOptions(step_on="fsdp", fsdp=here).agreed_fields())
    assert fields["fsdp"] != dict(
        lampdist.StepOptions(step_on="fsdp", fsdp=other).agreed_fields()
    )["fsdp"]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: lampdist.StepOptions(step_on="fsdp", bucket_cap_mb=25), "bucket_cap_mb"),
        (lambda: lampdist.StepOptions(step_on="fsdp", fsdp="blocks"), "FsdpPolicy"),
        (lambda: lampdist.FsdpPolicy(shard_modules=("Block",)), "module classes"),
        (lambda: lampdist.Precision(param_dtype=torch.int8), "floating torch.dtype"),
        (lambda: lampdist.FsdpPolicy(parallelize=3), "callable"),
    ],
)
def test_bad_fsdp_options_fail_when_built(make: Any, match: str) -> None:
    with pytest.raises(lampdist.ConfigError, match=match):
        make()
