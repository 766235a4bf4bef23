"""In-job recovery under ``step_on="fsdp"`` with real processes over Gloo and TCP: each rank
keeps its shards and its neighbour's in host memory after every pass, a follower killed in
the middle of a pass is replaced by the same command started again, the replacement
receives its shards from the survivors, and the run ends bitwise where an uninterrupted run
ends. Two neighbouring ranks lost at once lose a shard: the run ends naming them."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import lampdist

from ._jobs import NEVER, Job, assert_same_run, stderr, uninterrupted

pytestmark = pytest.mark.skipif(
    not hasattr(torch.distributed, "init_process_group"), reason="torch without distributed"
)

FSDP = ["--step-on", "fsdp"]


@pytest.mark.slow  # processes started, killed and started again: run one at a time
@pytest.mark.parametrize(
    ("nranks", "lost", "die_after", "args"),
    [
        (2, 1, "forward:10", ["--optimizer", "adamw", "--clip", "0.05", "--accumulate", "1"]),
        (3, 2, "5", ["--optimizer", "adamw", "--meta"]),
        (3, 1, "5", ["--optimizer", "sgd", "--window", "1", "--accumulate", "2"]),
        (2, 1, "forward:10", ["--optimizer", "sgd"]),  # lost between a step's backwards
        # windows of 6 steps snapshotted every 2 (the uninterrupted run has no recovery)
        (3, 1, "forward:11", ["--optimizer", "adamw", "--window", "6", "--snapshot-every", "2"]),
    ],
    ids=["2-ranks-clip", "3-ranks-meta", "3-ranks-windows", "2-ranks-mid-step", "3-ranks-k2"],
)
def test_a_killed_fsdp_follower_is_replaced_and_the_run_ends_as_if_nothing_happened(
    tmp_path: Path, nranks: int, lost: int, die_after: str, args: list[str]
) -> None:
    """Rank ``lost`` is SIGKILLed as it takes a training batch in the middle of a pass (with
    windows, of a later window), or (``forward:N``) as its model runs its Nth forward, the
    third step of the second epoch, after the survivors stepped twice in the pass; the same
    command started again joins, receives its shards
    of the model and the optimizer from the survivors' replicas, the survivors put theirs
    back, the pass is redone, and every rank's final shards and the learning curve equal an
    uninterrupted run's bitwise."""
    args = [*FSDP, *args, "--epochs", "3"]
    uninterrupted(tmp_path / "want", args, nranks=nranks)
    per_rank = {rank: ["--die-after", NEVER] for rank in range(nranks)}
    how, _, when = die_after.rpartition(":")
    per_rank[lost] = ["--die-in-forward" if how else "--die-after", when]
    job = Job(tmp_path / "got", [*args, "--recovery", "60"], per_rank, nranks=nranks)
    try:
        assert job.ranks[lost].wait(timeout=60) == -signal.SIGKILL
        job.replace(lost)
        ended = job.finish()
    finally:
        job.kill()
    for rank, (code, error) in ended.items():
        assert code == 0, f"rank {rank}: {error}"
    assert f"recovered rank(s) [{lost}]" in ended[0][1]
    (event,) = [json.loads(line) for line in (tmp_path / "got" / "recovered.jsonl").open()]
    assert event["ranks"] == [lost] and event["phase"] == "train"
    if "--snapshot-every" in args:  # redone from the last snapshot within the window
        assert event["from_step"] > 0 and event["from_step"] % 2 == 0, event
    assert_same_run(tmp_path / "got", tmp_path / "want", nranks=nranks)


@pytest.mark.slow  # processes started, killed and started again: run one at a time
@pytest.mark.parametrize(
    ("dies", "checkpoint"),
    [(["--die-after-ring", "4"], False), (["--die-in-write", "2"], True)],
    ids=["after-a-snapshot-the-root-did-not-take", "while-the-checkpoint-is-written"],
)
def test_a_rank_lost_between_the_roots_steps_is_recovered_in_job(
    tmp_path: Path, dies: list[str], checkpoint: bool
) -> None:
    """Rank 2 of 3 is SIGKILLed at a moment that the root does not see coming, and the run
    still ends bitwise as an uninterrupted one:

    - right after it kept its fourth snapshot (after a training pass: one after a validation
      pass holds the same weights as the one before) and exchanged it with its neighbours,
      before the root had it: every rank kept a snapshot that the root never commits, and
      the recovery goes back to the root's (the one before), on every rank (found by the
      chaos run under fsdp: a follower stalled during a snapshot);
    - as it starts writing its shards of the second checkpoint, while the others are in
      torch's distributed checkpoint's collectives with it: the root recovers it in the job
      and the checkpoint is written again."""
    args = [*FSDP, "--optimizer", "adamw", "--epochs", "3"]
    stores = (lambda name: ["--checkpoint", str(tmp_path / name)]) if checkpoint else None
    uninterrupted(tmp_path / "want", [*args, *(stores("ck-want") if stores else [])])
    per_rank = {rank: ["--die-after", NEVER] for rank in range(3)}
    per_rank[2] += dies
    run = [*args, "--recovery", "60", *(stores("ck") if stores else [])]
    job = Job(tmp_path / "got", run, per_rank)
    try:
        assert job.ranks[2].wait(timeout=60) == -signal.SIGKILL
        job.replace(2)
        ended = job.finish()
    finally:
        job.kill()
    for rank, (code, error) in ended.items():
        assert code == 0, f"rank {rank}: {error}"
    assert "recovered rank(s) [2]" in ended[0][1]
    (event,) = [json.loads(line) for line in (tmp_path / "got" / "recovered.jsonl").open()]
    assert event["phase"] == "checkpoint", event  # a snapshot's or a checkpoint's
    assert_same_run(tmp_path / "got", tmp_path / "want")


@pytest.mark.slow  # processes started, killed and started again: run one at a time
def test_two_neighbouring_ranks_lost_at_once_end_the_run_naming_them(tmp_path: Path) -> None:
    """Ranks 1 and 2 of 3 are killed together once training is well under way: rank 1 held
    the only replica of rank 2's shards, so the root ends the run at once with a
    CheckpointError naming both, rather than wait for replacements it could not make
    whole."""
    out = tmp_path / "run"
    per_rank = {rank: ["--die-after", NEVER] for rank in range(3)}
    job = Job(out, [*FSDP, "--epochs", "50", "--recovery", "60"], per_rank)
    try:
        deadline = time.monotonic() + 60
        while not (out / "trained").exists():
            assert time.monotonic() < deadline and job.ranks[0].poll() is None
            time.sleep(0.05)
        for rank in (1, 2):
            os.kill(job.ranks[rank].pid, signal.SIGKILL)
        started = time.monotonic()
        code = job.ranks[0].wait(timeout=60)
        waited = time.monotonic() - started
        error = stderr(job.ranks[0])
    finally:
        job.kill()
    assert code != 0
    assert "CheckpointError" in error and "ranks 1 and 2 were lost together" in error, error
    assert waited < 30


def test_fsdp_replica_off_is_refused() -> None:
    """``Recovery(fsdp_replica=False)`` under fsdp without ``checkpoint_state`` is refused
    before anything runs (it goes back to the newest checkpoint); a value that is not a bool
    is refused when built."""
    from lampdist._roles._fsdp_recovery import check_fsdp_recovery

    loop = lampdist.LoopOptions(max_epochs=1, recovery=lampdist.Recovery(fsdp_replica=False))
    with pytest.raises(lampdist.ConfigError, match=r"Recovery.fsdp_replica=False under"):
        check_fsdp_recovery(lampdist.StepOptions(step_on="fsdp"), loop)
    check_fsdp_recovery(lampdist.StepOptions(step_on="every_rank"), loop)
    with pytest.raises(lampdist.ConfigError, match=r"Recovery\.fsdp_replica must be True or False"):
        lampdist.Recovery(fsdp_replica="yes")  # type: ignore[arg-type]


def test_a_rank_holds_one_snapshot_between_passes_and_two_only_while_one_is_taken() -> None:
    """The memory a rank spends: after a snapshot it holds the root's last one beside the
    new one (which the root may not have taken); once a pass starts (the root took it) only
    the new one; going back restores the named one's weights."""
    from lampdist._epoch._designs._fsdp_replica import Snapshots

    module = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    snapshots = Snapshots(rank=0, nranks=1, device=torch.device("cpu"))
    snapshots.keep("in-memory:1", module, optimizer, lambda *_: None)
    first = module.weight.detach().clone()
    with torch.no_grad():
        module.weight.add_(1.0)
    snapshots.keep("in-memory:2", module, optimizer, lambda *_: None)
    assert list(snapshots.kept) == ["in-memory:1", "in-memory:2"]
    snapshots.go_back("in-memory:1", [], module, optimizer, lambda *_: None)
    assert torch.equal(module.weight, first) and list(snapshots.kept) == ["in-memory:1"]
    snapshots.keep("in-memory:3", module, optimizer, lambda *_: None)
    snapshots.taken()
    assert list(snapshots.kept) == ["in-memory:3"]
    with pytest.raises(lampdist.CheckpointError, match="holds no shards of recovery's snapshot"):
        snapshots.go_back("in-memory:1", [], module, optimizer, lambda *_: None)
