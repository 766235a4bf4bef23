"""Two processes over TCP train exactly like one process on the concatenated batches."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

import lampdist

from . import tcp_rank
from .metrics_reference import metric_of, plain_outputs
from .reference import make_model, make_shards, mse, reference_training, shuffled

ROOT_DIR = Path(__file__).resolve().parents[2]


def spawn(rank: int, nranks: int, out: Path, port: int = 0, *extra: str) -> subprocess.Popen[str]:
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


def run_two_processes(out: Path, *extra: str) -> None:
    """A root and a follower of :mod:`.tcp_rank` to the end; both must exit 0."""
    root = spawn(0, 2, out, 0, *extra)
    follower = None
    try:
        assert root.stdout is not None
        line = root.stdout.readline()
        assert line.startswith("PORT "), line + (root.stderr.read() if root.stderr else "")
        follower = spawn(1, 2, out, int(line.split()[1]), *extra)
        _, root_err = root.communicate(timeout=60)
        _, follower_err = follower.communicate(timeout=60)
    finally:
        for process in (root, follower):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert root.returncode == 0, root_err
    assert follower is not None and follower.returncode == 0, follower_err


def assert_matches_the_reference(out: Path) -> None:
    """The weights every rank of :mod:`.tcp_rank` wrote to ``out``, and the root's learning
    curve, against the single-process reference (float64: to a few ulp)."""
    expected, train_losses, valid_losses = reference_training(
        make_model(seed=0),
        tcp_rank.sgd,
        make_shards(tcp_rank.SIZES, seed=1),
        make_shards(tcp_rank.VALID_SIZES, seed=2),
        epochs=tcp_rank.EPOCHS,
        accumulate=tcp_rank.ACCUMULATE,
    )
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt", weights_only=True, map_location="cpu")
        for name, want in expected.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-9, msg=name)
    curve = json.loads((out / "curve.json").read_text())
    assert [c[0] for c in curve] == pytest.approx(train_losses, rel=1e-9)
    assert [c[1] for c in curve] == pytest.approx(valid_losses, rel=1e-9)


@pytest.mark.parametrize("step_on", ["root", "sharded"])
def test_two_processes_match_the_reference(tmp_path: Path, step_on: str) -> None:
    run_two_processes(tmp_path, "--step-on", step_on)
    assert_matches_the_reference(tmp_path)


def test_two_processes_report_the_metrics_of_one_process(tmp_path: Path) -> None:
    """Over Gloo between processes, uneven shards with an empty batch: lampdist's metric
    and a torchmetrics one equal one process's on the concatenated batches."""
    pytest.importorskip("torchmetrics")
    run_two_processes(tmp_path, "--metrics", "--step-on", "every_rank")
    assert_matches_the_reference(tmp_path)
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
            want_mae = metric_of(tcp_rank.METRIC, outputs)
            want_mse = metric_of(squared, outputs)
            assert got[f"{kind}_mae"] == pytest.approx(want_mae, rel=1e-9), (epoch, kind)
            assert got[f"{kind}_mse"] == pytest.approx(want_mse, rel=1e-9), (epoch, kind)


def test_two_processes_shuffle_exactly_like_one_process(tmp_path: Path) -> None:
    """The shuffled loader draws each rank's order from its pass's seed, so the ranks of two
    processes see the batches the ranks of one process see: the same weights, bitwise."""
    run_two_processes(tmp_path, "--shuffle")
    train = make_shards(tcp_rank.SIZES, seed=1)
    valid = make_shards(tcp_rank.VALID_SIZES, seed=2)
    modules = [make_model(seed=0 if rank == 0 else 10 + rank) for rank in range(2)]

    async def in_one_process() -> None:
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse),
                    train_batches=shuffled(train[rank]),
                    validation_batches=functools.partial(list, valid[rank]),
                )
                for rank, module in enumerate(modules)
            ],
            optimizer_factory=tcp_rank.sgd,
            loop=lampdist.LoopOptions(max_epochs=tcp_rank.EPOCHS),
            step=lampdist.StepOptions(accumulate_gradient_over_n_batches=tcp_rank.ACCUMULATE),
        )

    anyio.run(in_one_process)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, want in modules[0].state_dict().items():
            assert torch.equal(got[name], want), (rank, name)
    # And the order did change: the batches in their stored order train other weights.
    in_order, _, _ = reference_training(
        make_model(seed=0), tcp_rank.sgd, train, valid, epochs=tcp_rank.EPOCHS
    )
    weight = modules[0].state_dict()["0.weight"]
    assert not torch.allclose(weight, in_order.state_dict()["0.weight"], atol=1e-6)
