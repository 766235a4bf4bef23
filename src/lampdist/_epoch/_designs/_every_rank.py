"""Every rank steps: gradients all-reduced, each rank's own optimizer steps the same update."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ...clique import PendingCollective
from ._exchanging import ExchangingDesign

__all__ = ["EveryRankSteps"]


@attrs.define(eq=False)
class EveryRankSteps(ExchangingDesign):
    """``step_on="every_rank"``: the gradient sums and the meta values behind them are
    all-reduced, and every rank steps its own optimizer on the same sums (one collective a
    step instead of the root design's two); the root's module buffers are broadcast after the
    step. Every rank starts from the root's optimizer state."""

    followers_step = True

    def start_exchange(self, tensors: Sequence[torch.Tensor]) -> PendingCollective:
        return self.clique.start_all_reduce(tensors)

    def publish(
        self, more: bool, non_finite: float | None, *, own_loss: torch.Tensor, epoch: int, step: int
    ) -> bool:
        if non_finite is not None:
            # Every rank steps and reads the same sum: all are here, before the step's other
            # collectives, where they gather their own losses (see _blame).
            self.non_finite.settle(epoch=epoch, step=step, summed=non_finite, own=own_loss)
        self.broadcast_module_buffers()
        return more

    def sync_optimizer_state(self) -> None:
        """Give every rank the root's optimizer state (a resumed run's, or a new one's)."""
        stepper = self.stepper
        assert stepper is not None
        state = stepper.optimizer.state_dict() if self.rank == 0 else None
        self.share_optimizer_state(state, self.device)
