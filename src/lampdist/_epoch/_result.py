"""What a pass measured."""

from __future__ import annotations

from collections.abc import Mapping

import attrs

__all__ = ["PassResult"]


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
