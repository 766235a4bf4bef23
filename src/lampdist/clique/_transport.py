"""What a clique's collectives run on: a torch process group, or the ranks of this process.

:class:`~lampdist.Clique` checks the arguments and offers the awaitable collectives; a
:class:`Transport` starts them. Two exist: :class:`GroupTransport` over an explicit
``torch.distributed`` process group (NCCL or Gloo, across processes), and the in-process
transport of ``_local`` (the ranks of one process, which issue every collective together).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import attrs
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (  # torch.distributed does not re-export these two
    AllgatherOptions,
    ReduceScatterOptions,
)

from .._errors import Phase
from ._bridge import Failure, PendingCollective, Then
from ._gather import GATHER_MAX_BYTES, GatherReduce
from ._group import Group

__all__ = ["GroupTransport", "Transport"]


class Transport(Protocol):
    """Starts one rank's collectives; every method may be called from any thread, with
    arguments that the clique has checked (tensors dense, contiguous, on the device and not
    empty; sizes that fit)."""

    def broadcast(self, tensors: tuple[torch.Tensor, ...], root: int) -> PendingCollective: ...

    def reduce(self, tensors: tuple[torch.Tensor, ...], root: int) -> PendingCollective: ...

    def all_reduce(self, tensors: tuple[torch.Tensor, ...]) -> PendingCollective: ...

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective: ...

    def barrier(self) -> PendingCollective: ...

    def abort(self, reason: str) -> None:
        """Break the clique on purpose (see :meth:`~lampdist.Clique.abort`)."""

    def abandon(self, reason: str) -> None:
        """Break the clique and leave what is in flight behind (see
        :meth:`~lampdist.Clique.abandon`)."""

    def explain(self, exc: BaseException, phase: Phase) -> Failure | None:
        """What the clique knows of a failure seen outside it (see
        :meth:`~lampdist.Clique.explain`)."""

    def end_process(self, rank: int) -> int | None:
        """End ``rank``'s process if it is on this machine (see
        :meth:`~lampdist.Clique.end_process`)."""


@attrs.define(eq=False)
class GroupTransport:
    """Collectives over one rank's process group (see ``_group``)."""

    group: Group
    gather_reduce: GatherReduce | None
    """Gloo's reduce of small tensors (see ``_gather``); None on NCCL."""

    @classmethod
    def create(cls, group: Group) -> GroupTransport:
        """The transport of ``group``."""
        gather = GatherReduce(group.rank, group.nranks) if group.backend == "gloo" else None
        return cls(group=group, gather_reduce=gather)

    @property
    def _timeout(self) -> timedelta:
        seconds = self.group.collective_timeout
        return timedelta(days=365) if seconds is None else timedelta(seconds=seconds)

    def broadcast(self, tensors: tuple[torch.Tensor, ...], root: int) -> PendingCollective:
        timeout = self._timeout

        def issue(pg: Any, works: list[Any]) -> None:
            for tensor in tensors:
                options = dist.BroadcastOptions()
                options.rootRank, options.rootTensor, options.timeout = root, 0, timeout
                works.append(pg.broadcast([tensor], options))

        return self.group.start("broadcast", issue, nbytes=_nbytes(tensors))

    def reduce(self, tensors: tuple[torch.Tensor, ...], root: int) -> PendingCollective:
        timeout = self._timeout
        gather = self.gather_reduce

        def issue(pg: Any, works: list[Any]) -> None:
            for tensor in tensors:
                if gather is not None and tensor.nbytes <= GATHER_MAX_BYTES:
                    gather.issue(pg, tensor, root, timeout, works)
                    continue
                options = dist.ReduceOptions()
                options.rootRank, options.rootTensor, options.timeout = root, 0, timeout
                works.append(pg.reduce([tensor], options))

        return self.group.start("reduce", issue, nbytes=_nbytes(tensors))

    def all_reduce(self, tensors: tuple[torch.Tensor, ...]) -> PendingCollective:
        timeout = self._timeout

        def issue(pg: Any, works: list[Any]) -> None:
            for tensor in tensors:
                options = dist.AllreduceOptions()
                options.timeout = timeout
                works.append(pg.allreduce([tensor], options))

        return self.group.start("all_reduce", issue, nbytes=_nbytes(tensors))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective:
        timeout = self._timeout
        if self.group.backend == "gloo":
            # Gloo's reduce-scatter gives no future to follow: sum a copy of the whole input
            # and take this rank's chunk once the sum is complete (on Gloo's thread).
            nranks, rank = self.group.nranks, self.group.rank

            # In place (``output`` is this rank's chunk of ``input``): sum ``input`` itself.
            in_place = is_own_chunk(output, input, rank, nranks)

            def issue(pg: Any, works: list[Any]) -> None:
                options = dist.AllreduceOptions()
                options.timeout = timeout
                if in_place:
                    works.append(pg.allreduce([input], options))
                    return
                scratch = input.clone()
                mine = scratch.view(nranks, -1)[rank].view(output.shape)
                works.append(Then(pg.allreduce([scratch], options), lambda: output.copy_(mine)))

        else:

            def issue(pg: Any, works: list[Any]) -> None:
                options = ReduceScatterOptions()
                options.timeout = timeout
                works.append(pg._reduce_scatter_base(output, input, options))

        return self.group.start("reduce_scatter", issue, nbytes=input.nbytes)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective:
        timeout = self._timeout

        def issue(pg: Any, works: list[Any]) -> None:
            options = AllgatherOptions()
            options.timeout = timeout
            works.append(pg._allgather_base(output, input, options))

        return self.group.start("all_gather", issue, nbytes=output.nbytes)

    def barrier(self) -> PendingCollective:
        if self.group.backend == "gloo":

            def issue(pg: Any, works: list[Any]) -> None:
                works.append(pg.barrier(dist.BarrierOptions()))

            return self.group.start("barrier", issue)
        device = self.group.device

        def issue_on_device(pg: Any, works: list[Any]) -> None:
            works.append(pg.allreduce([torch.zeros(1, device=device)]))

        return self.group.start("barrier", issue_on_device, wait_for_device=True)

    def abort(self, reason: str) -> None:
        self.group._announce_abort(reason)

    def abandon(self, reason: str) -> None:
        self.group.abandon(reason)

    def explain(self, exc: BaseException, phase: Phase) -> Failure | None:
        return self.group.explain(exc, phase)

    def end_process(self, rank: int) -> int | None:
        return self.group.end_process(rank)

    def close(self) -> None:
        """Drop what the transport keeps (the root's gather buffers) once the clique closed."""
        if self.gather_reduce is not None:
            self.gather_reduce.clear()


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(tensor.nbytes for tensor in tensors)


def is_own_chunk(output: torch.Tensor, input: torch.Tensor, rank: int, nranks: int) -> bool:
    """Whether ``output`` is chunk ``rank`` of ``input`` split in ``nranks`` (an in-place
    reduce-scatter or all-gather)."""
    chunk = output.numel()
    return (
        output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
        and output.storage_offset() == input.storage_offset() + rank * chunk
        and input.numel() == nranks * chunk
    )
