"""The settings of a training rank, and the events and results of its passes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

import attrs
import torch

from .._errors import ConfigError

__all__ = ["OnPassEvent", "PassEvent", "PassResult", "StepOn", "TrainingOptions"]

StepOn = Literal["root", "every_rank"]


@attrs.frozen(kw_only=True)
class TrainingOptions:
    """How a rank trains.

    ``step_on="root"`` (lamp's design) keeps the optimizer on the root: gradients are reduced
    to it and the parameters broadcast back. ``step_on="every_rank"`` all-reduces the
    gradients and every rank steps its own optimizer (followers need ``optimizer_factory``
    too); one collective a step instead of two, the same updates. ``bucket_cap_mb`` cuts the
    gradients into buckets of about that many megabytes whose exchange starts while backward
    still runs (``None``, the default: one exchange per flat buffer after backward). ``step_on``,
    ``accumulate_gradient_over_n_batches``, ``autocast_dtype`` and ``bucket_cap_mb`` must agree
    on every rank (checked at join); ``max_grad_norm`` and ``non_finite_loss`` act where the
    optimizer steps.
    """

    accumulate_gradient_over_n_batches: int = 1
    max_grad_norm: float | None = None
    autocast_dtype: torch.dtype | None = None
    non_finite_loss: Literal["raise", "skip"] = "raise"
    step_on: StepOn = "root"
    bucket_cap_mb: float | None = None

    def __attrs_post_init__(self) -> None:
        accumulate = self.accumulate_gradient_over_n_batches
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ConfigError(
                f"accumulate_gradient_over_n_batches must be an int >= 1, got {accumulate!r}: "
                "pass 1 to step after every batch",
                phase="configure",
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(
                f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}", phase="configure"
            )
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ConfigError(
                "autocast_dtype must be torch.bfloat16, torch.float16 or None, "
                f"got {self.autocast_dtype}",
                phase="configure",
            )
        if self.non_finite_loss not in ("raise", "skip"):
            raise ConfigError(
                f"non_finite_loss must be 'raise' or 'skip', got {self.non_finite_loss!r}",
                phase="configure",
            )
        cap = self.bucket_cap_mb
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0
        ):
            raise ConfigError(
                f"bucket_cap_mb must be > 0 megabytes or None, got {cap!r}: pass None to "
                "exchange the gradients after backward",
                phase="configure",
            )
        if self.step_on not in ("root", "every_rank"):
            raise ConfigError(
                f"step_on must be 'root' or 'every_rank', got {self.step_on!r}", phase="configure"
            )

    def describe(self) -> str:
        """The settings every rank must share, for the agreement check at join."""
        return (
            f"accumulate_gradient_over_n_batches={self.accumulate_gradient_over_n_batches}, "
            f"autocast_dtype={self.autocast_dtype}, step_on={self.step_on}, "
            f"bucket_cap_mb={self.bucket_cap_mb}"
        )


@attrs.frozen(kw_only=True)
class PassEvent:
    """Progress of a pass, reported on the root: during a training pass after its first step,
    then the newest at most every 50 ms (events in between are coalesced, never waited for),
    and always at the end of every pass.

    ``batches`` counts the root's own batches so far and ``total_batches`` is the root's batch
    count when its source has a length, else ``None``; ``examples`` counts the whole clique's
    examples so far and ``loss`` is their example-weighted mean loss; ``done`` marks the last
    event of the pass.
    """

    epoch: int
    kind: Literal["train", "valid"]
    pass_index: int
    step: int
    batches: int
    total_batches: int | None
    examples: int
    loss: float
    seconds: float
    done: bool

    @property
    def examples_per_second(self) -> float:
        """Examples of the whole clique per second of this pass so far."""
        return self.examples / self.seconds if self.seconds > 0 else 0.0


OnPassEvent = Callable[[PassEvent], Awaitable[None]]
"""``async (event) -> None``, called on the root's event loop with the progress of each pass
(see :class:`PassEvent`); a pass's steps never wait for it."""


@attrs.frozen(kw_only=True)
class PassResult:
    """What a pass measured; on the root (and in every-rank stepping, on every rank) for the
    whole clique."""

    loss: float
    examples: int
    steps: int
    skipped_steps: int = 0
