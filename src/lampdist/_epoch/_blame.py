"""What a failed step names: the ranks whose own loss was not finite, the batch a model raised on.

A step's summed loss says that some rank's loss was not finite, not whose. Every rank knows its
own loss of the step before the exchange sums it, so once the summed loss has turned out not
finite (the rare path, never a normal step) the ranks all-gather their own losses of that step
in one extra collective, and the error or the skip warning names the ranks. Every rank must
join that all-gather at the same point of the same step, which the design's
``names_every_rank`` decides from what every rank shares (the device type and the options):

- on the CPU, every stepping rank reads each step's summed values on the host right after the
  exchange (reading there waits for nothing), and with ``step_on="root"`` the followers read
  the root values that come with the parameters, where the root asks for the own losses;
- on CUDA a step's values are read back some steps later, each rank at its own pace, unless
  the skip policy or float16 loss scaling makes every stepping rank read them at once (and
  with ``step_on="root"`` only float16 loss scaling makes the followers read the root values
  every step). Elsewhere a rank names only itself: its own loss of that step, read back then.

A rank alone names itself: its loss is the summed loss.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import torch

from .._errors import NonFiniteLoss
from ._shard import AllGather

__all__ = [
    "NonFiniteSteps",
    "describe_any_batch",
    "describe_batch",
    "describe_losses",
    "non_finite_error",
]

logger = logging.getLogger(__name__)

_SHOWN_RANKS = 8
"""Ranks a message names one by one; the rest are counted."""
_SHOWN_ITEMS = 8
"""Items of a batch's list, tuple or dict that its description shows; the rest are counted."""


def describe_losses(summed: float, losses: Mapping[int, float], *, nranks: int) -> str:
    """What a step's non-finite ``summed`` loss says about its ranks, from ``losses`` (each
    known rank's own loss of the step: every rank's, or one rank's own only)::

        the loss of rank 1 was nan (the summed loss of the step is nan)
    """
    total = f"the summed loss of the step is {summed}"
    bad = sorted((rank, value) for rank, value in losses.items() if not math.isfinite(value))
    complete = len(losses) >= nranks
    if bad:
        unknown = "" if complete else "; the other ranks' own losses were not gathered"
        return f"{_name_losses(bad)} ({total}{unknown})"
    if complete:
        return f"every rank's own loss was finite, their sum was not ({total})"
    known = ", ".join(str(rank) for rank in sorted(losses))
    return (
        f"the loss of rank {known} was finite, another rank's was not ({total}; the other "
        "ranks' own losses were not gathered)"
    )


def _name_losses(bad: list[tuple[int, float]]) -> str:
    if len(bad) == 1:
        ((rank, value),) = bad
        return f"the loss of rank {rank} was {value}"
    shown = bad[:_SHOWN_RANKS]
    values = {str(value) for _, value in bad}
    if len(values) == 1:
        ranks = _join([str(rank) for rank, _ in shown], len(bad) - len(shown))
        return f"the losses of ranks {ranks} were {values.pop()}"
    ranks = _join([f"{rank} ({value})" for rank, value in shown], len(bad) - len(shown))
    return f"the losses of ranks {ranks} were not finite"


def _join(items: list[str], more: int) -> str:
    if more:
        return f"{', '.join(items)} and {more} more"
    return ", ".join(items[:-1]) + f" and {items[-1]}"


@attrs.define(eq=False)
class NonFiniteSteps:
    """A stepping rank's handling of a step whose summed loss was not finite: find out whose
    own loss was not (with every rank, through ``gather``, where the design names every rank), then
    raise :class:`NonFiniteLoss` or log that the step is skipped, as ``policy`` says. Runs on
    the rank's compute thread, on the rare path only."""

    rank: int
    nranks: int
    policy: Literal["raise", "skip"]
    gather: AllGather | None
    """Every rank's own loss of the step, gathered; ``None`` where the ranks cannot all be
    asked (then a rank names itself only)."""

    def own_losses(self, own: torch.Tensor) -> dict[int, float]:
        """Every rank's own loss of the step, in one all-gather that every rank joins (a
        follower of the root too, with the root's ask); without ``gather``, this rank's."""
        mine = own.detach().to(torch.float64).reshape(1)
        if self.gather is None:
            return {self.rank: float(mine.item())}
        every = torch.zeros(self.nranks, dtype=torch.float64, device=mine.device)
        self.gather(every, mine)
        return dict(enumerate(every.tolist()))

    def settle(self, *, epoch: int, step: int, summed: float, own: torch.Tensor) -> None:
        """Name the ranks and raise (policy ``"raise"``) or log the skipped step."""
        losses = self.own_losses(own)
        if self.policy == "raise":
            raise non_finite_error(
                rank=self.rank,
                epoch=epoch,
                step=step,
                summed=summed,
                losses=losses,
                nranks=self.nranks,
            )
        logger.warning(
            "epoch %d, step %d: skipping the step: %s",
            epoch,
            step,
            describe_losses(summed, losses, nranks=self.nranks),
            extra={"rank": self.rank, "epoch": epoch},
        )


def non_finite_error(
    *,
    rank: int,
    epoch: int,
    step: int,
    summed: float,
    losses: Mapping[int, float],
    nranks: int,
    lag: int | None = None,
) -> NonFiniteLoss:
    """The :class:`NonFiniteLoss` of rank ``rank`` for a step, naming the ranks (see
    :func:`describe_losses`); ``lag`` says that on CUDA the check may come that many steps
    after the step."""
    late = ""
    if lag is not None:
        late = f" (on CUDA the check may lag the step by up to {lag} steps)"
    return NonFiniteLoss(
        f"epoch {epoch}, step {step}: {describe_losses(summed, losses, nranks=nranks)}; pass "
        f"non_finite_loss='skip' to skip such steps{late}",
        rank=rank,
        phase="train",
    )


def describe_batch(inputs: Any, target: Any) -> str:
    """A batch's shapes and dtypes, for an error message (``inputs float32[16, 7], target
    float32[16, 1]``; nested tuples, lists and dicts alike)."""
    return f"inputs {_describe(inputs, 0)}, target {_describe(target, 0)}"


def describe_any_batch(batch: Any) -> str:
    """A batch of any shape, for an error message (``batch {'input_ids': int64[4, 9]}``;
    nested dicts, tuples and lists, and the fields of attrs and dataclass instances)."""
    return f"batch {_describe(batch, 0)}"


def _describe(value: Any, depth: int) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(str(size) for size in value.shape)}]"
    if depth < 4 and not isinstance(value, type):
        if attrs.has(type(value)):
            fields = {f.name: getattr(value, f.name) for f in attrs.fields(type(value))}
            return f"{type(value).__name__}{_describe(fields, depth)}"
        if dataclasses.is_dataclass(value):
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
            return f"{type(value).__name__}{_describe(fields, depth)}"
    if depth >= 4 or not isinstance(value, Mapping | list | tuple):
        return type(value).__name__
    items = list(value.items()) if isinstance(value, Mapping) else list(enumerate(value))
    parts = [
        f"{key!r}: {_describe(item, depth + 1)}"
        if isinstance(value, Mapping)
        else _describe(item, depth + 1)
        for key, item in items[:_SHOWN_ITEMS]
    ]
    if len(items) > _SHOWN_ITEMS:
        parts.append(f"... {len(items) - _SHOWN_ITEMS} more")
    if isinstance(value, Mapping):
        return "{" + ", ".join(parts) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(parts) + "]"
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"
