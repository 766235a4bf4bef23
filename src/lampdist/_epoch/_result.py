"""What a pass measured."""

from __future__ import annotations

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
