"""In-job recovery under ``step_on="fsdp"`` without the neighbour replica
(``Recovery(fsdp_replica=False)``), with real processes over Gloo and TCP: a follower killed
in the middle of a later epoch is replaced, every rank loads its shards of the newest
checkpoint, the root's epochs start again from that checkpoint, the survivors' processes
go on, and the run ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

import lampdist

from ._jobs import NEVER, Job, assert_same_run, uninterrupted
from .test_fsdp_recovery import FSDP

pytestmark = pytest.mark.skipif(
    not hasattr(__import__("torch").distributed, "init_process_group"),
    reason="torch without distributed",
)


@pytest.mark.slow  # processes started, killed and started again: run one at a time
@pytest.mark.parametrize(
    ("nranks", "lost", "die_after", "back_to", "args"),
    [
        (2, (1,), "10", 1, ["--optimizer", "adamw", "--clip", "0.05", "--accumulate", "1"]),
        # Mid-step (between the backwards of an accumulation), the newest checkpoint gone:
        # back to epoch 0's, two passes and a half.
        (3, (2,), "forward:17", 0, ["--optimizer", "sgd", "--meta", "--drop-newest"]),
        # Two neighbouring ranks at once (no replica to lose: both load the checkpoint).
        (3, (1, 2), "forward:17", 1, ["--optimizer", "adamw"]),
    ],
    ids=["2-ranks", "3-ranks-meta-two-epochs-back", "3-ranks-two-lost"],
)
def test_a_killed_fsdp_follower_goes_back_to_the_newest_checkpoint_in_job(
    tmp_path: Path,
    nranks: int,
    lost: tuple[int, ...],
    die_after: str,
    back_to: int,
    args: list[str],
) -> None:
    """The ranks ``lost`` are SIGKILLed as they take a training batch (or run a forward) in
    the middle of epoch 2 (having removed the newest checkpoint, with ``--drop-newest``); the
    same commands started again join, every rank loads its shards of the checkpoint of epoch
    ``back_to``, the epochs after it run again, and every rank's final shards, its optimizer
    state and the learning curve equal an uninterrupted run's bitwise; the root and the
    survivors are the processes that started the run."""
    args = [*FSDP, *args, "--epochs", "4"]
    want = [*args, "--checkpoint", str(tmp_path / "ck-want")]
    uninterrupted(tmp_path / "want", want, nranks=nranks)
    per_rank = {rank: ["--die-after", NEVER] for rank in range(nranks)}
    how, _, when = die_after.rpartition(":")
    for rank in lost:
        per_rank[rank] = ["--die-in-forward" if how else "--die-after", when]
    got = tmp_path / "got"
    run = [*args, "--recovery", "60", "--no-replica", "--checkpoint", str(tmp_path / "ck")]
    job = Job(got, run, per_rank, nranks=nranks)
    started = {rank: process.pid for rank, process in job.ranks.items()}
    try:
        for rank in lost:
            assert job.ranks[rank].wait(timeout=60) == -signal.SIGKILL
            job.replace(rank)
        ended = job.finish()
    finally:
        job.kill()
    for rank, (code, error) in ended.items():
        assert code == 0, f"rank {rank}: {error}"
    assert f"the run goes back to the checkpoint of epoch {back_to}" in ended[0][1]
    (event,) = [json.loads(line) for line in (got / "recovered.jsonl").open()]
    assert event["ranks"] == list(lost) and event["checkpoint_epoch"] == back_to
    assert event["epoch"] == 2 and event["pass_index"] == 2 * (back_to + 1)  # train, valid
    for rank in range(nranks):
        pid = int((got / f"pid{rank}").read_text())
        assert (pid == started[rank]) == (rank not in lost), rank
    assert_same_run(got, tmp_path / "want", nranks=nranks)


@pytest.mark.slow  # processes started, killed and started again: run one at a time
def test_a_loss_before_the_first_checkpoint_ends_the_run_naming_the_rank(tmp_path: Path) -> None:
    """Without a checkpoint to go back to (rank 1 lost in epoch 0), the root ends the run with
    a CheckpointError naming the lost rank and phase 'recover', without waiting for a
    replacement."""
    args = [*FSDP, "--epochs", "3", "--recovery", "60", "--no-replica"]
    per_rank = {0: ["--die-after", NEVER], 1: ["--die-after", "2"]}
    job = Job(tmp_path / "run", [*args, "--checkpoint", str(tmp_path / "ck")], per_rank, nranks=2)
    try:
        assert job.ranks[1].wait(timeout=60) == -signal.SIGKILL
        code, error = job.finish(timeout=30)[0]
    finally:
        job.kill()
    assert code != 0
    assert "CheckpointError" in error and "rank(s) [1] were lost in phase 'train'" in error
    assert "rank 1" in error and "phase 'recover'" in error, error


def test_fsdp_replica_off_needs_a_checkpoint_store() -> None:
    """``Recovery(fsdp_replica=False)`` under fsdp without ``checkpoint_state`` is refused
    before anything runs, naming the option; with one it is taken."""
    from lampdist._roles._fsdp_recovery import check_fsdp_recovery

    recovery = lampdist.Recovery(fsdp_replica=False)
    loop = lampdist.LoopOptions(max_epochs=1, recovery=recovery)
    fsdp = lampdist.StepOptions(step_on="fsdp")
    with pytest.raises(lampdist.ConfigError, match=r"checkpoint_state is None: pass"):
        check_fsdp_recovery(fsdp, loop)
    store = lampdist.checkpoint.to_directory("unused")
    check_fsdp_recovery(
        fsdp, lampdist.LoopOptions(max_epochs=1, recovery=recovery, checkpoint_state=store)
    )
    check_fsdp_recovery(lampdist.StepOptions(step_on="every_rank"), loop)


def test_fsdp_replica_off_refuses_snapshots_within_a_pass() -> None:
    """Without the replica no snapshot is kept (a loss goes back to the checkpoint), so
    ``snapshot_every_steps`` would bound nothing: refused, naming both options; with the
    replica, or under another design, it is taken."""
    from lampdist._roles._fsdp_recovery import check_fsdp_recovery

    store = lampdist.checkpoint.to_directory("unused")
    fsdp = lampdist.StepOptions(step_on="fsdp", steps_per_epoch=4)

    def loop(**recovery: object) -> lampdist.LoopOptions:
        settings = lampdist.Recovery(snapshot_every_steps=2, **recovery)  # type: ignore[arg-type]
        return lampdist.LoopOptions(max_epochs=1, recovery=settings, checkpoint_state=store)

    with pytest.raises(lampdist.ConfigError, match=r"fsdp_replica=False, snapshot_every_steps=2"):
        check_fsdp_recovery(fsdp, loop(fsdp_replica=False))
    check_fsdp_recovery(fsdp, loop(fsdp_replica=True))
    check_fsdp_recovery(lampdist.StepOptions(step_on="every_rank"), loop(fsdp_replica=False))
