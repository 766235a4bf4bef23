"""In-job recovery under ``step_on="fsdp"``: what the root checks of it (see
:class:`lampdist.Recovery` and ``_epoch._designs._fsdp_replica``, where the ranks keep and
hand over their shards).

No rank holds another's shards, so after every snapshot each rank keeps its own shards and a
replica of its neighbour's (rank ``r`` holds rank ``(r + 1) % n``'s) in host memory. A lost
rank's replacement receives its shards from the survivor that holds their replica: losing
two neighbouring ranks at once loses a shard, and the root says so at once rather than wait
for replacements it could not make whole.

With ``Recovery(fsdp_replica=False)`` nothing is kept: after a loss every rank, the
replacement included, loads its shards of the newest checkpoint in the run's storage, and
the root's epoch loop starts again from that checkpoint's loop state (:class:`GoneBack`,
which the root's epochs catch), as a run resumed from it would.
"""

from __future__ import annotations

from typing import Any

from .._epoch import DESIGNS, replica_holder
from .._errors import CheckpointError, ConfigError
from .._options import LoopOptions, StepOptions
from ..checkpoint import Resumed

__all__ = [
    "GoneBack",
    "check_fsdp_recovery",
    "check_shards_kept",
    "no_checkpoint_yet",
    "recovers_from_checkpoint",
]


class GoneBack(Exception):
    """Every rank went back to the newest checkpoint, ``resume``: the root's epochs start
    again from its loop state, at pass ``pass_index`` (raised by the recovery, caught by the
    root's epoch loop)."""

    def __init__(self, resume: Resumed, pass_index: int) -> None:
        super().__init__(f"back to the checkpoint of epoch {resume.epoch - 1}")
        self.resume, self.pass_index = resume, pass_index


def recovers_from_checkpoint(step: StepOptions, loop: LoopOptions) -> bool:
    """Whether a loss goes back to the newest checkpoint (fsdp without its replica)."""
    recovery = loop.recovery
    return (
        recovery is not None
        and not recovery.fsdp_replica
        and DESIGNS[step.step_on].loads_checkpoints
    )


def check_fsdp_recovery(step: StepOptions, loop: LoopOptions) -> None:
    """Raise :class:`ConfigError` for ``Recovery(fsdp_replica=False)`` under fsdp without a
    ``checkpoint_state`` (a lost rank's shards would be nowhere) or with
    ``snapshot_every_steps`` (no snapshot is kept: a loss goes back to the checkpoint)."""
    if not recovers_from_checkpoint(step, loop):
        return
    assert loop.recovery is not None
    every = loop.recovery.snapshot_every_steps
    if every is not None:
        raise ConfigError(
            f"Recovery(fsdp_replica=False, snapshot_every_steps={every!r}) under "
            f"step_on={step.step_on!r}: without the replica no snapshot is kept and a loss "
            "goes back to the newest checkpoint, so there is no snapshot to take every "
            f"{every} steps: pass snapshot_every_steps=None, or fsdp_replica=True",
            rank=0,
            phase="configure",
        )
    if loop.checkpoint_state is not None:
        return
    raise ConfigError(
        f"Recovery.fsdp_replica=False under step_on={step.step_on!r} goes back to the newest "
        "checkpoint after a loss, and LoopOptions.checkpoint_state is None: pass "
        "checkpoint_state=checkpoint.to_directory(path) (or to_url(...)), or "
        "Recovery(fsdp_replica=True) (one extra shard of host memory per rank)",
        rank=0,
        phase="configure",
    )


def no_checkpoint_yet(lost: set[int], where: Any, phase: str, epoch: int) -> CheckpointError:
    """The error that ends a run under ``fsdp_replica=False`` when ranks are lost before the
    run's storage ``where`` holds a checkpoint to go back to."""
    return CheckpointError(
        f"rank(s) {sorted(lost)} were lost in phase {phase!r} of epoch {epoch} before "
        f"{where} held a checkpoint: Recovery(fsdp_replica=False) goes back to the newest "
        "one; start the run again (or pass Recovery(fsdp_replica=True))",
        rank=min(lost),
        phase="recover",
    )


def check_shards_kept(step: StepOptions, lost: set[int], nranks: int) -> None:
    """Under fsdp, raise :class:`CheckpointError` naming the ranks when a lost rank's replica
    was held by a rank lost too (two neighbouring ranks lost at once)."""
    if not DESIGNS[step.step_on].loads_checkpoints:
        return
    for rank in sorted(lost):
        holder = replica_holder(rank, nranks)
        if holder in lost:
            raise CheckpointError(
                f"ranks {holder} and {rank} were lost together: rank {holder} held the only "
                f"replica of rank {rank}'s shards (step_on='fsdp' keeps one replica, on the "
                "rank before), so they are lost; resume the run from its newest checkpoint",
                rank=rank,
                phase="recover",
            )
