"""Mistakes that cost nothing to find are reported before training, not after an epoch: a
checkpoint directory that another run holds, a resume with no epoch left to train, and bad
settings on a follower only, which the root raises as the follower's own ConfigError."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import lampdist
from lampdist import checkpoint, control
from lampdist.clique import in_process

from .reference import make_model, make_shards, mse
from .test_tcp_exactness import ROOT_DIR


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


async def run(
    directory: Path, *, max_epochs: int, resume: lampdist.Resumed | None = None
) -> tuple[lampdist.LoopState, list[int]]:
    """Two ranks in one process, checkpointing into ``directory``; and the batches trained."""
    trained: list[int] = []

    def counted(
        shard: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        for batch in shard:
            trained.append(1)
            yield batch

    shards = make_shards([[4, 4], [4, 4]], seed=5)
    with anyio.fail_after(30):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(make_model(), mse),
                    train_batches=functools.partial(counted, shard),
                )
                for shard in shards
            ],
            optimizer_factory=sgd,
            resume=resume,
            loop=lampdist.LoopOptions(
                max_epochs=max_epochs, checkpoint_state=checkpoint.to_directory(directory)
            ),
        )
    return state, trained


async def test_a_new_run_into_a_directory_of_checkpoints_is_refused_before_training(
    tmp_path: Path,
) -> None:
    await run(tmp_path, max_epochs=2)
    with pytest.raises(lampdist.CheckpointError) as caught:
        await run(tmp_path, max_epochs=2)
    error = caught.value
    assert (error.rank, error.phase) == (0, "configure")
    assert "already holds checkpoints (the newest of epoch 2) and this is a new run" in str(error)
    assert "pass resume=load_latest(directory)" in str(error)
    # Nothing was trained and nothing was written by the refused run.
    written = sorted(name for name in os.listdir(tmp_path) if name.startswith("epoch"))
    assert written == ["epoch-000001", "epoch-000002"]


async def test_a_resumed_run_behind_the_directory_is_refused_before_training(
    tmp_path: Path,
) -> None:
    await run(tmp_path, max_epochs=4)
    older = checkpoint.load_latest(tmp_path)
    assert older is not None
    await run(tmp_path / "other", max_epochs=1)
    early = checkpoint.load_latest(tmp_path / "other")  # epoch 1; tmp_path holds up to 4
    assert early is not None and early.epoch == 1
    with pytest.raises(lampdist.CheckpointError, match="newer than the run resumed at epoch 1"):
        await run(tmp_path, max_epochs=4, resume=early)


async def test_resuming_the_newest_checkpoint_is_no_reuse(tmp_path: Path) -> None:
    await run(tmp_path, max_epochs=2)
    resumed = checkpoint.load_latest(tmp_path)
    state, trained = await run(tmp_path, max_epochs=3, resume=resumed)
    assert state.epoch == 3
    assert len(trained) == 4  # one epoch: two batches on each of two ranks


async def test_resuming_with_no_epoch_left_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await run(tmp_path, max_epochs=2)
    resumed = checkpoint.load_latest(tmp_path)
    caplog.set_level(logging.WARNING, logger="lampdist")
    state, trained = await run(tmp_path, max_epochs=2, resume=resumed)
    assert (state.epoch, trained) == (2, [])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "rank 0: the run resumes at epoch 2 and max_epochs=2: no epoch is left to train; "
        "raise max_epochs to train on"
    ]


TCP_RANK = (
    "import sys, anyio; from tests.roles import tcp_rank; "
    "tcp_rank.OPTIMIZERS['none'] = lambda params: None; "  # a factory that returns no optimizer
    "anyio.run(tcp_rank.main, sys.argv[1:])"
)
"""tests/roles/tcp_rank.py, with ``--optimizer none`` besides its own choices."""


def _tcp_rank(rank: int, out: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "LAMPDIST_SECRET": "test-secret", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", TCP_RANK, "--rank", str(rank), "--nranks", "2"]
        + ["--port", str(port), "--out", str(out), *extra],
        cwd=ROOT_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    ("follower_only", "raised"),
    [
        (  # found as the follower builds its optimizer, before it joins
            ("--optimizer", "none"),
            "lampdist._errors.ConfigError: rank 1, phase 'configure': optimizer_factory must "
            "return a torch.optim.Optimizer, got NoneType",
        ),
        (  # found as the follower opens the clique, after it joined
            ("--nranks", "3"),
            "lampdist._errors.MismatchError: rank 1, phase 'clique setup': this rank expects "
            "nranks=3 but the clique id is for 2 ranks",
        ),
    ],
    ids=["no-optimizer", "nranks"],
)
def test_bad_settings_on_a_follower_only_are_the_roots_config_error(
    tmp_path: Path, follower_only: tuple[str, ...], raised: str
) -> None:
    """Two TCP processes, stepping on every rank, where only the follower's settings are bad:
    the root raises the follower's ConfigError (the same subclass, naming rank 1 and its
    phase, with its message), which the README's script turns into exit 2, rather than a
    RankFailed or a JoinTimeout."""
    design = ("--step-on", "every_rank")
    root = _tcp_rank(0, tmp_path, 0, *design)
    follower = None
    try:
        assert root.stdout is not None
        line = root.stdout.readline()
        assert line.startswith("PORT "), line + (root.stderr.read() if root.stderr else "")
        follower = _tcp_rank(1, tmp_path, int(line.split()[1]), *design, *follower_only)
        _, root_err = root.communicate(timeout=60)  # past the ranks' Timeouts.join (30 s)
        _, follower_err = follower.communicate(timeout=60)
    finally:
        for process in (root, follower):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert root.returncode == 1, root_err  # tcp_rank.py lets the error out: its traceback
    assert root_err.strip().splitlines()[-1].startswith(raised), root_err
    kind, _, where = raised.partition(": ")
    assert follower.returncode == 1, follower_err
    assert follower_err.strip().splitlines()[-1].startswith(f"{kind}: {where}"), follower_err


async def test_a_followers_bad_settings_reach_the_root_and_the_other_followers() -> None:
    """Three ranks in this process, stepping on every rank; rank 1's optimizer factory
    returns no optimizer once rank 2 has joined: the root raises rank 1's ConfigError (not
    after ``Timeouts.join``) and tells rank 2, which names it."""
    rank_2_joined = threading.Event()

    def no_optimizer(params: Iterable[torch.nn.Parameter]) -> Any:  # on rank 1's thread
        rank_2_joined.wait(30)
        return None

    shards = make_shards([[4, 4]] * 3, seed=5)
    data = [
        lampdist.ModelWithData(
            model=lampdist.SupervisedModel(make_model(), mse), train_batches=lambda s=shard: s
        )
        for shard in shards
    ]
    step = lampdist.StepOptions(step_on="every_rank")
    timeouts = lampdist.Timeouts(join=20)
    cliques = in_process(["cpu"] * 3)
    root, followers = control.local_channels(3)
    outcome: dict[int, BaseException | None] = {}

    async def run_root() -> None:
        try:
            await lampdist.drive_distributed_training(
                nranks=3,
                device="cpu",
                control=root,
                data=data[0],
                optimizer_factory=sgd,
                loop=lampdist.LoopOptions(max_epochs=2),
                step=step,
                timeouts=timeouts,
                cliques=cliques,
            )
            outcome[0] = None
        except Exception as exc:
            outcome[0] = exc

    async def run_follower(rank: int, factory: Any) -> None:
        try:
            async with followers[rank - 1] as channel:
                await lampdist.follow_distributed_training(
                    rank=rank,
                    nranks=3,
                    device="cpu",
                    control=channel,
                    data=data[rank],
                    optimizer_factory=factory,
                    step=step,
                    timeouts=timeouts,
                    cliques=cliques,
                )
            outcome[rank] = None
        except Exception as exc:
            outcome[rank] = exc

    async def let_rank_1_fail() -> None:
        await root.wait_for_peers(1, 20)  # rank 2: rank 1 is still building its optimizer
        rank_2_joined.set()

    with anyio.fail_after(15):  # within Timeouts.join, which the root waited out before
        async with root, anyio.create_task_group() as group:
            group.start_soon(run_root)
            group.start_soon(run_follower, 1, no_optimizer)
            group.start_soon(run_follower, 2, sgd)
            group.start_soon(let_rank_1_fail)
    said = "rank 1, phase 'configure': optimizer_factory must return a torch.optim.Optimizer"
    for rank in (0, 1):  # the root raises the follower's own error
        error = outcome[rank]
        assert type(error) is lampdist.ConfigError, repr(error)
        assert (error.rank, error.phase) == (1, "configure") and str(error).startswith(said)
    told = outcome[2]
    assert isinstance(told, lampdist.RankFailed) and (told.rank, told.phase) == (0, "stop")
    assert f"ConfigError: {said}" in str(told), told
