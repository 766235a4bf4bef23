"""In-job recovery under ``step_on="fsdp"``: what the root checks of it (see
:class:`lampdist.Recovery` and ``_epoch._designs._fsdp_replica``, where the ranks keep and
hand over their shards).

No rank holds another's shards, so after every snapshot each rank keeps its own shards and a
replica of its neighbour's (rank ``r`` holds rank ``(r + 1) % n``'s) in host memory. A lost
rank's replacement receives its shards from the survivor that holds their replica: losing
two neighbouring ranks at once loses a shard, and the root says so at once rather than wait
for replacements it could not make whole.
"""

from __future__ import annotations

from .._epoch import DESIGNS, replica_holder
from .._errors import CheckpointError, ConfigError
from .._options import LoopOptions, StepOptions

__all__ = ["check_fsdp_recovery", "check_shards_kept"]


def check_fsdp_recovery(step: StepOptions, loop: LoopOptions) -> None:
    """Raise :class:`ConfigError` for ``Recovery(fsdp_replica=False)`` under fsdp (a lost
    rank's shards would then be nowhere but in a checkpoint, which in-job recovery does not
    load yet)."""
    recovery = loop.recovery
    if recovery is None or recovery.fsdp_replica or not DESIGNS[step.step_on].loads_checkpoints:
        return
    raise ConfigError(
        f"Recovery.fsdp_replica=False under step_on={step.step_on!r}: a lost rank's shards "
        "would be in no other rank's memory, and in-job recovery from the newest checkpoint "
        "is not supported: pass Recovery(fsdp_replica=True) (one extra shard of host memory "
        "per rank), or recovery=None and resume from the checkpoint after a loss",
        rank=0,
        phase="configure",
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
