"""The clique: an explicit torch.distributed process group as an async context manager."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta
from typing import Any, cast

import anyio
import anyio.from_thread
import anyio.to_thread
import attrs
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (  # torch.distributed does not re-export these two
    AllgatherOptions,
    ReduceScatterOptions,
)

from .._clique_id import CliqueId
from .._errors import ConfigError, MismatchError
from ._backends import prefer_nccl_cleanup
from ._bridge import PendingCollective, Then
from ._gather import GATHER_MAX_BYTES, GatherReduce
from ._group import Group

__all__ = ["Clique", "open_clique"]

logger = logging.getLogger(__name__)

_SETUP = "clique setup"


@attrs.define(eq=False)
class Clique:
    """One rank's handle on an open clique: awaitable collectives over an explicit process group.

    Get one from :func:`open_clique`. Every collective sums (``reduce``, ``all_reduce``,
    ``reduce_scatter``) or copies in place, treats each tensor of a sequence as a collective
    of its own (pass flat buffers for speed), and must be issued in the same order on every
    rank. The ``async`` methods wait without blocking the event loop; the ``start_*`` methods
    start the same collectives from any thread (autograd hooks included) and return a
    :class:`PendingCollective` to await later.

    Every collective raises :class:`~lampdist.ConfigError` for tensors that are not
    contiguous, not on :attr:`device` or of the wrong size,
    :class:`~lampdist.CollectiveFailed` (``phase`` = the collective's name) when a peer died,
    aborted or the clique is broken, :class:`~lampdist.CliqueTimeout` past the
    ``collective_timeout``, and :class:`~lampdist.CliqueError` once the clique is closed.
    After any failure the clique stays broken: leave the ``async with`` block.
    """

    rank: int
    """This rank, in ``0..nranks-1``."""
    nranks: int
    """The number of ranks of the clique."""
    device: torch.device
    """The device every tensor must live on."""
    backend: str
    """``"nccl"`` for a CUDA device, ``"gloo"`` for the CPU."""
    _group: Group = attrs.field(alias="group", repr=False)
    # Gloo's reduce of small tensors (see ``_gather``); None on NCCL.
    _gather_reduce: GatherReduce | None = attrs.field(init=False, repr=False)

    @_gather_reduce.default
    def _default_gather_reduce(self) -> GatherReduce | None:
        return GatherReduce(self.rank, self.nranks) if self.backend == "gloo" else None

    async def broadcast(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        """Copy ``root``'s tensors into every other rank's tensors, in place."""
        await self.start_broadcast(tensors, root)

    async def reduce(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        """Sum every rank's tensors into ``root``'s; the other ranks' tensors become scratch."""
        await self.start_reduce(tensors, root)

    async def all_reduce(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum every rank's tensors into every rank's tensors, in place."""
        await self.start_all_reduce(tensors)

    async def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Sum the ranks' ``input`` (``nranks`` equal chunks) and give rank ``r`` chunk ``r``.

        ``input`` has ``nranks * output.numel()`` elements.
        """
        await self.start_reduce_scatter(output, input)

    async def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Concatenate every rank's ``input`` into every rank's ``output``, in rank order.

        ``output`` has ``nranks * input.numel()`` elements.
        """
        await self.start_all_gather(output, input)

    async def barrier(self) -> None:
        """Wait until every rank has reached the barrier (on CUDA: and its GPU work before it)."""
        if self.backend == "gloo":

            def issue(pg: Any, works: list[Any]) -> None:
                works.append(pg.barrier(dist.BarrierOptions()))

            await self._group.start("barrier", issue)
        else:
            device = self.device

            def issue(pg: Any, works: list[Any]) -> None:
                works.append(pg.allreduce([torch.zeros(1, device=device)]))

            await self._group.start("barrier", issue, wait_for_device=True)

    def abort(self, reason: str) -> None:
        """Break the clique on purpose; callable from any thread.

        Every pending and later collective of this rank raises
        :class:`~lampdist.CollectiveFailed` (a thread in ``wait_blocking`` wakes at once), the
        other ranks' collectives fail with an error that names this rank and ``reason``, and
        on NCCL the communicator is aborted. It blocks briefly (it posts a notice on the
        clique's store), so call it from a worker thread in async code. Leave the ``async
        with`` block afterwards.
        """
        self._group._announce_abort(reason)

    def start_broadcast(self, tensors: Sequence[torch.Tensor], root: int = 0) -> PendingCollective:
        """Start :meth:`broadcast` and return at once; callable from any thread."""
        checked = self._tensors("broadcast", tensors)
        self._check_root("broadcast", root)
        timeout = self._op_timeout

        def issue(pg: Any, works: list[Any]) -> None:
            for tensor in checked:
                options = dist.BroadcastOptions()
                options.rootRank, options.rootTensor, options.timeout = root, 0, timeout
                works.append(pg.broadcast([tensor], options))

        return self._group.start("broadcast", issue)

    def start_reduce(self, tensors: Sequence[torch.Tensor], root: int = 0) -> PendingCollective:
        """Start :meth:`reduce` and return at once; callable from any thread."""
        checked = self._tensors("reduce", tensors)
        self._check_root("reduce", root)
        timeout = self._op_timeout
        gather = self._gather_reduce

        def issue(pg: Any, works: list[Any]) -> None:
            for tensor in checked:
                if gather is not None and tensor.nbytes <= GATHER_MAX_BYTES:
                    gather.issue(pg, tensor, root, timeout, works)
                    continue
                options = dist.ReduceOptions()
                options.rootRank, options.rootTensor, options.timeout = root, 0, timeout
                works.append(pg.reduce([tensor], options))

        return self._group.start("reduce", issue)

    def start_all_reduce(self, tensors: Sequence[torch.Tensor]) -> PendingCollective:
        """Start :meth:`all_reduce` and return at once; callable from any thread."""
        checked = self._tensors("all_reduce", tensors)
        timeout = self._op_timeout

        def issue(pg: Any, works: list[Any]) -> None:
            for tensor in checked:
                options = dist.AllreduceOptions()
                options.timeout = timeout
                works.append(pg.allreduce([tensor], options))

        return self._group.start("all_reduce", issue)

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective:
        """Start :meth:`reduce_scatter` and return at once; callable from any thread."""
        self._pair("reduce_scatter", output, input, gather=False)
        timeout = self._op_timeout
        if self.backend == "gloo":
            # Gloo's reduce-scatter gives no future to follow: sum a copy of the whole input
            # and take this rank's chunk once the sum is complete (on Gloo's thread).
            nranks, rank = self.nranks, self.rank

            def issue(pg: Any, works: list[Any]) -> None:
                scratch = input.clone()
                options = dist.AllreduceOptions()
                options.timeout = timeout
                mine = scratch.view(nranks, -1)[rank].view(output.shape)
                works.append(Then(pg.allreduce([scratch], options), lambda: output.copy_(mine)))

        else:

            def issue(pg: Any, works: list[Any]) -> None:
                options = ReduceScatterOptions()
                options.timeout = timeout
                works.append(pg._reduce_scatter_base(output, input, options))

        return self._group.start("reduce_scatter", issue)

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective:
        """Start :meth:`all_gather` and return at once; callable from any thread."""
        self._pair("all_gather", output, input, gather=True)
        timeout = self._op_timeout

        def issue(pg: Any, works: list[Any]) -> None:
            options = AllgatherOptions()
            options.timeout = timeout
            works.append(pg._allgather_base(output, input, options))

        return self._group.start("all_gather", issue)

    # -- argument checks -----------------------------------------------------------------

    @property
    def _op_timeout(self) -> timedelta:
        seconds = self._group.collective_timeout
        return timedelta(days=365) if seconds is None else timedelta(seconds=seconds)

    def _check_root(self, phase: str, root: int) -> None:
        if not 0 <= root < self.nranks:
            raise ConfigError(
                f"root must be a rank in 0..{self.nranks - 1}, got {root}",
                rank=self.rank,
                phase=phase,
            )

    def _check_tensor(self, phase: str, tensor: object) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(
                f"expected a tensor, got {type(tensor).__name__}", rank=self.rank, phase=phase
            )
        if tensor.device != self.device:
            raise ConfigError(
                f"a tensor is on {tensor.device}; move it to the clique's device {self.device}",
                rank=self.rank,
                phase=phase,
            )
        if tensor.layout != torch.strided or not tensor.is_contiguous():
            raise ConfigError(
                "tensors must be dense and contiguous; pass tensor.contiguous()",
                rank=self.rank,
                phase=phase,
            )
        return tensor

    def _tensors(self, phase: str, tensors: object) -> tuple[torch.Tensor, ...]:
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise ConfigError(
                "pass a sequence of tensors, e.g. [tensor]", rank=self.rank, phase=phase
            )
        checked = tuple(self._check_tensor(phase, tensor) for tensor in tensors)
        return tuple(tensor for tensor in checked if tensor.numel() > 0)

    def _pair(self, phase: str, output: torch.Tensor, input: torch.Tensor, *, gather: bool) -> None:
        self._check_tensor(phase, output)
        self._check_tensor(phase, input)
        if output.dtype != input.dtype:
            raise ConfigError(
                f"output is {output.dtype} but input is {input.dtype}", rank=self.rank, phase=phase
            )
        big, small = (output, input) if gather else (input, output)
        if big.numel() != small.numel() * self.nranks:
            which = "output" if gather else "input"
            raise ConfigError(
                f"{which} needs nranks={self.nranks} times the elements of the other "
                f"tensor; got output {output.numel()} and input {input.numel()}",
                rank=self.rank,
                phase=phase,
            )


def _resolve_device(device: torch.device | str | int, rank: int) -> torch.device:
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type == "cpu":
        return torch.device("cpu")
    if resolved.type != "cuda":
        raise ConfigError(
            f"a clique runs on a CUDA device (NCCL) or the CPU (Gloo), not {resolved}",
            rank=rank,
            phase=_SETUP,
        )
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        raise ConfigError(
            f"{resolved} needs CUDA and a torch build with NCCL; pass device='cpu' to use Gloo",
            rank=rank,
            phase=_SETUP,
        )
    if cast("int | None", resolved.index) is None:  # "cuda" without an index
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def open_clique(
    *,
    nranks: int,
    rank: int,
    device: torch.device | str | int,
    clique_id: CliqueId,
    setup_timeout: float | None = 300.0,
    collective_timeout: float | None = 60.0,
    limiter: anyio.CapacityLimiter | None = None,
) -> AbstractAsyncContextManager[Clique]:
    """Open this rank's side of the clique named by ``clique_id``; close it on exit.

    Every rank calls this with the id that the root got from
    :func:`~lampdist.clique.serve_rendezvous` (followers receive it over the control channel).
    The backend follows the device: NCCL for a CUDA device (an int means ``cuda:<int>``), Gloo
    for the CPU. The process group is explicit, never torch's default group, so several
    cliques and several ranks can live in one process; each in-process rank needs its own task.

    ``setup_timeout`` bounds the wait for all ranks; ``collective_timeout`` bounds every
    collective (both in seconds, ``None`` for no limit). Blocking work (building the group,
    tearing it down) runs in worker threads taken from ``limiter``, one per rank at a time:
    a limiter shared by the ranks of one process needs at least as many tokens as there are
    ranks, or setup deadlocks. Cancellation during setup takes effect within a fraction of a
    second (the waits for the peers are short slices), and tells the peers, whose setup then
    raises :class:`~lampdist.CollectiveFailed`; only torch's own group construction, which
    starts once every rank is ready, cannot be interrupted.

    On exit the clique waits (up to ``collective_timeout``) for collectives that are still
    running and drops the process group. Leaving with an exception or by cancellation posts
    an abort notice that makes every other rank's collectives raise
    :class:`~lampdist.CollectiveFailed` within a fraction of a second, and on NCCL aborts the
    communicator.

    Raises :class:`~lampdist.MismatchError` at once when ``clique_id.nranks != nranks``,
    :class:`~lampdist.ConfigError` for other bad arguments, :class:`~lampdist.CliqueTimeout`
    when the peers do not all arrive within ``setup_timeout``, :class:`~lampdist.CliqueError`
    when the group cannot be built, and :class:`~lampdist.CliqueTimeout` (phase
    ``"clique teardown"``) when a clean exit left started collectives that never finished.
    """
    if clique_id.nranks != nranks:
        raise MismatchError(
            f"this rank expects nranks={nranks} but the clique id is for "
            f"{clique_id.nranks} ranks; start every rank with the same nranks",
            rank=rank,
            phase=_SETUP,
        )
    if not 0 <= rank < nranks:
        raise ConfigError(f"rank must be in 0..{nranks - 1}, got {rank}", rank=rank, phase=_SETUP)
    for name, value in (
        ("setup_timeout", setup_timeout),
        ("collective_timeout", collective_timeout),
    ):
        if value is not None and not value > 0:
            raise ConfigError(
                f"{name} must be positive seconds or None, got {value}", rank=rank, phase=_SETUP
            )
    return _open(
        nranks=nranks,
        rank=rank,
        device=_resolve_device(device, rank),
        clique_id=clique_id,
        setup_timeout=setup_timeout,
        collective_timeout=collective_timeout,
        limiter=limiter,
        threaded=False,
    )


@asynccontextmanager
async def _open(
    *,
    nranks: int,
    rank: int,
    device: torch.device,
    clique_id: CliqueId,
    setup_timeout: float | None,
    collective_timeout: float | None,
    limiter: anyio.CapacityLimiter | None,
    threaded: bool,
) -> AsyncIterator[Clique]:
    """:func:`open_clique` after its checks; ``threaded`` also gives Gloo an enqueue thread
    (NCCL always has one), which lets the CPU tests cover that path."""
    if device.type == "cuda":
        prefer_nccl_cleanup()
    connect = functools.partial(
        Group.connect,
        clique_id=clique_id,
        rank=rank,
        device=device,
        setup_timeout=setup_timeout,
        collective_timeout=collective_timeout,
        threaded=threaded,
        check_cancelled=anyio.from_thread.check_cancelled,
    )
    group = await anyio.to_thread.run_sync(connect, limiter=limiter)
    clique = Clique(rank=rank, nranks=nranks, device=device, backend=group.backend, group=group)
    try:
        try:
            yield clique
        except BaseException as exc:
            await group.aclose(exc, limiter=limiter)
            raise
        await group.aclose(None, limiter=limiter)
    finally:
        if clique._gather_reduce is not None:
            clique._gather_reduce.clear()  # the root's gather buffers
