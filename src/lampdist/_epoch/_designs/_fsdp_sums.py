"""One fsdp step's sums and the all-reduce of its meta values (see ``_fsdp``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

from ...clique import PendingCollective
from .._values import write_meta

if TYPE_CHECKING:
    from ._fsdp import FsdpSteps

__all__ = ["StepSums"]


@attrs.define(eq=False)
class StepSums:
    """One fsdp step's weight (``examples``: the batches' :attr:`LoadedBatch.weight`, examples
    or tokens) and float64 loss sum on this rank, and the all-reduce of its
    meta values: started before the step's last backward (:meth:`start`,
    :meth:`add_and_start`) or after it (:meth:`exchanged`)."""

    design: FsdpSteps
    examples: int = 0
    _loss: torch.Tensor | None = None
    _meta: torch.Tensor | None = None
    _pending: PendingCollective | None = None

    def add(self, loss: torch.Tensor, examples: int) -> None:
        """Add a batch's mean ``loss`` times its ``examples``."""
        weighted = loss.to(torch.float64) * examples
        self._loss = weighted if self._loss is None else self._loss + weighted
        self.examples += examples

    def loss(self) -> torch.Tensor:
        """The loss sum (zero without examples)."""
        if self._loss is None:
            self._loss = torch.zeros((), dtype=torch.float64, device=self.design.device)
        return self._loss

    def start(self) -> None:
        """Start the meta values' all-reduce (the flag of more batches set: the counts say)."""
        meta = write_meta(self.design.flat, self.examples, self.loss(), True, tail=False)
        assert meta is not None
        self._meta, self._pending = meta, self.design.start_exchange([meta])

    def add_and_start(self, examples: int) -> Callable[[torch.Tensor], None]:
        """What the last backward calls with the batch's loss before it runs."""

        def before_backward(loss: torch.Tensor) -> None:
            self.add(loss, examples)
            self.start()

        return before_backward

    def exchanged(self, more: bool) -> torch.Tensor:
        """The meta values summed over the clique (the all-reduce started now if not yet)."""
        if self._pending is None:
            meta = write_meta(self.design.flat, self.examples, self.loss(), more, tail=False)
            assert meta is not None
            self._meta, self._pending = meta, self.design.start_exchange([meta])
        self._pending.wait_blocking(None)
        assert self._meta is not None
        return self._meta
