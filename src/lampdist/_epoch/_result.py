"""What a pass measured."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["CheckpointParts", "PassResult"]


@attrs.frozen(kw_only=True)
class PassResult:
    """What a pass measured; on the root (and in every-rank stepping, on every rank) for the
    whole clique."""

    loss: float
    examples: int
    steps: int
    skipped_steps: int = 0
    metrics: Mapping[str, float | tuple[float, ...]] = attrs.field(factory=dict)
    """The pass's metrics over the clique, on the root (empty elsewhere)."""


@attrs.frozen(kw_only=True)
class CheckpointParts:
    """What the ranks hold of a checkpoint, gathered on the root: the whole optimizer state
    (the root's, or sharded, every rank's slice of it) and, per rank in rank order, its place
    in its training stream (``"position"``, ``None`` without ``steps_per_epoch``) and its RNG
    states (``"rng_tensors"``, ``"rng_json"``)."""

    optimizer_state: Mapping[str, Any]
    rank_states: tuple[dict[str, Any], ...]
    shard_records: tuple[Any, ...] = ()
    """Sharded checkpoints (fsdp): every rank's files and their checksums (``FileRecord``)."""
