"""Sharded stepping: gradients reduce-scattered, each rank steps its slice, parameters gathered."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from ..._options import StepOptions
from ...clique import PendingCollective
from .._flat import FlatParameters
from .._shard import ShardedOptimizer, check_elementwise
from .._stepper import Combine, LossScale, Stepper
from ._exchanging import ExchangingDesign

__all__ = ["ShardedSteps"]


@attrs.define(eq=False)
class ShardedSteps(ExchangingDesign):
    """``step_on="sharded"``: each rank owns a contiguous ``1/n`` of every flat buffer (see
    ``_flat``). Each gradient buffer is reduce-scattered (bucket by bucket during the last
    backward, with ``bucket_cap_mb``: the layout cuts the buffers to that size), so that each
    rank holds the sums of the slice it owns, and the meta values are all-reduced on their
    own; every rank steps its slice with its slice optimizer (see ``_shard``), whose clipping
    norm and overflow check sum one scalar over the clique, and all-gathers the parameters,
    which the next step's first forward waits for (on CUDA: its stream; the host goes on).
    Over Gloo, whose reduce-scatter costs an all-reduce of the whole buffer, the whole
    buffers are all-reduced instead and the meta values ride behind them."""

    followers_step = True
    whole_buffer_buckets = True

    @classmethod
    def lay_out(
        cls, module: torch.nn.Module, device: torch.device, nranks: int, options: StepOptions
    ) -> FlatParameters:
        return FlatParameters.create(
            module, device, shards=nranks, bucket_cap_bytes=options.bucket_cap_bytes
        )

    @classmethod
    def check_optimizer(cls, rank: int, optimizer: torch.optim.Optimizer) -> None:
        check_elementwise(rank, optimizer)

    @classmethod
    def create_stepper(
        cls,
        rank: int,
        optimizer: torch.optim.Optimizer,
        flat: FlatParameters,
        options: StepOptions,
        loss_scale: LossScale,
    ) -> Stepper:
        shard = ShardedOptimizer.create(rank, optimizer, flat)
        return Stepper.create(rank, shard.optimizer, flat, options, loss_scale, shard=shard)

    @property
    def _all_reduces_shards(self) -> bool:
        """Whether the step all-reduces whole gradient buffers, the meta values behind them,
        instead of reduce-scattering them: over Gloo, whose reduce-scatter costs an
        all-reduce of the whole buffer, so the meta values ride in it for free."""
        return self.clique.backend == "gloo"

    @property
    def meta_behind_gradients(self) -> bool:
        return self._buckets is None and self._all_reduces_shards

    @property
    def combine(self) -> Combine:
        return self._sum_over_clique

    def _sum_over_clique(self, tensor: torch.Tensor) -> None:
        """Sum a small tensor over the clique in place, and wait (the step's scalars)."""
        self.clique.start_all_reduce([tensor]).wait_blocking(None)

    def before_forward(self) -> None:
        self.settle()  # the last step's parameters, before this step's forward

    def start_exchange(self, tensors: Sequence[torch.Tensor]) -> PendingCollective:
        """Reduce-scatter one padded gradient buffer: each rank's slice to that rank."""
        (padded,) = tensors
        return self.clique.start_reduce_scatter(self.flat.shard(padded, self.rank), padded)

    def start_step_exchanges(self, meta: torch.Tensor | None) -> list[PendingCollective]:
        own: list[torch.Tensor] = [] if meta is None else [meta]
        if self._buckets is not None:
            exchanges = self._buckets.start_remaining()
        elif meta is not None:
            exchanges = [
                self.start_exchange([padded]) for padded in reversed(self.flat.padded_gradients)
            ]
        else:
            own = [*self.flat.gradient_storage]
            exchanges = []
        exchanges.append(self.clique.start_all_reduce(own))
        return exchanges

    def publish(
        self, more: bool, non_finite: float | None, *, own_loss: torch.Tensor, epoch: int, step: int
    ) -> bool:
        if non_finite is not None:
            # Every rank steps and reads the same sum: all are here, before the step's other
            # collectives, where they gather their own losses (see _blame).
            self.non_finite.settle(epoch=epoch, step=step, summed=non_finite, own=own_loss)
        self._start_parameter_gathers()
        self.broadcast_module_buffers()
        return more

    def _start_parameter_gathers(self) -> None:
        """Start gathering every rank's stepped slice into every parameter buffer, first
        layers first; the next forward waits for them (see :meth:`before_forward`)."""
        flat = self.flat
        self._sent = [
            self.clique.start_all_gather(storage, flat.shard(storage, self.rank))
            for storage in flat.parameter_storage
        ]

    def sync_optimizer_state(self) -> None:
        """Give each rank its slice of the state the root resumed from (none for a new run).
        The whole state stays in host memory: each rank moves its slice only."""
        stepper = self.stepper
        assert stepper is not None
        state = None
        if self.rank == 0:
            state, stepper.resumed_state = stepper.resumed_state, None
        self.share_optimizer_state(state, "cpu")

    def checkpoint_optimizer_state(self) -> dict[str, Any] | None:
        """The whole optimizer state, gathered from every rank's slice (a collective)."""
        stepper = self.stepper
        assert stepper is not None and stepper.shard is not None
        state = stepper.shard.full_state_dict(self.all_gather)
        return state if self.rank == 0 else None
