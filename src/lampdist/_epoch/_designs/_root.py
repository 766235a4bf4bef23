"""Stepping on the root (lamp's design): gradients reduced to the root, parameters sent back."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from ...clique import PendingCollective
from .._clock import EXCHANGE
from .._tally import Tally
from .._values import read_root_values, root_values_receiver, write_root_values
from ._exchanging import ExchangingDesign

__all__ = ["RootSteps"]


@attrs.define(eq=False)
class RootSteps(ExchangingDesign):
    """``step_on="root"``: every rank reduces its gradient sums (and the meta values behind
    them) to the root, which divides by the clique's examples, steps and broadcasts the
    parameters, the module's buffers and its root values (whether any rank has more batches,
    the fp16 loss scale, its ask for every rank's own loss, the fp16 nominal step) behind them
    (see ``_values``).
    The followers hold no optimizer."""

    def start_exchange(self, tensors: Sequence[torch.Tensor]) -> PendingCollective:
        return self.clique.start_reduce(tensors, root=0)

    def names_every_rank(self) -> bool:
        """The followers learn of a non-finite sum from the root values: on the CPU they read
        them every step, on CUDA only with fp16 loss scaling (for the scale)."""
        return self.device.type != "cuda" or self.loss_scale.enabled

    def update(
        self,
        meta: torch.Tensor | None,
        *,
        own_loss: torch.Tensor,
        examples: int,
        learn_more: bool,
        epoch: int,
        step: int,
        tally: Tally,
    ) -> bool:
        """The root steps and publishes; a follower receives the parameters."""
        if self.stepper is None:
            self.flat.zero_gradients()  # the reduce left partial sums in them
            more = self._receive_parameters(read=learn_more, own_loss=own_loss)
            self.clock.mark(EXCHANGE)
            return more
        return super().update(
            meta,
            own_loss=own_loss,
            examples=examples,
            learn_more=learn_more,
            epoch=epoch,
            step=step,
            tally=tally,
        )

    def publish(
        self, more: bool, non_finite: float | None, *, own_loss: torch.Tensor, epoch: int, step: int
    ) -> bool:
        ask = non_finite is not None and self.non_finite.gather is not None
        self._send_parameters(more, ask=ask)
        if non_finite is not None:
            # The followers read the ask behind the parameters and gather with the root.
            self.non_finite.settle(epoch=epoch, step=step, summed=non_finite, own=own_loss)
        return more

    def _send_parameters(self, more: bool, *, ask: bool = False) -> None:
        """Broadcast the stepped parameters, and behind them the root values (with ``ask``:
        the followers are to gather their own losses of the step with the root). On CUDA the
        root's next forward only reads them, so it need not wait, unless the broadcast carries
        module buffers (which a forward in train mode may update in place); the next step's
        exchange waits for it at the latest. On the CPU the root waits: the broadcast's threads
        would compete with its forward."""
        flat = self.flat
        scale = self.loss_scale
        values = write_root_values(
            flat, more, scale.scale, self.device, ask=ask, nominal=scale.nominal
        )
        own = [] if values is None else [values]
        sent = self.clique.start_broadcast(
            [*flat.parameter_storage, *flat.module_buffers, *own], root=0
        )
        if flat.module_buffers or self.device.type != "cuda":
            sent.wait_blocking(None)
        else:
            self._sent = [sent]

    def _receive_parameters(self, *, read: bool, own_loss: torch.Tensor) -> bool:
        """Receive the root's parameters; read the root values (a host sync on CUDA) only
        when ``read``, when fp16 loss scaling needs the scale and the nominal step, or when
        the root may ask for this rank's own loss of the step (``own_loss``; see ``_blame``),
        and answer it."""
        flat = self.flat
        values = root_values_receiver(flat, self.device)
        own = [] if values is None else [values]
        self.clique.start_broadcast(
            [*flat.parameter_storage, *flat.module_buffers, *own], root=0
        ).wait_blocking(None)
        may_ask = self.non_finite.gather is not None
        if not read and not self.loss_scale.enabled and not may_ask:
            return True
        more, scale, ask, nominal = read_root_values(flat, values).tolist()
        self.loss_scale.scale, self.loss_scale.nominal = scale, int(nominal)
        if ask > 0:
            self.non_finite.own_losses(own_loss)
        return bool(more > 0)
