"""The clique: a rank's collectives as an async context manager (a process group here)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import cast

import anyio
import anyio.from_thread
import anyio.to_thread
import attrs
import torch
import torch.distributed as dist

from .._clique_id import CliqueId
from .._defaults import COLLECTIVE_TIMEOUT, SETUP_TIMEOUT
from .._device import resolve_device
from .._errors import Collective, ConfigError, LampdistError, MismatchError, Phase
from ._backends import prefer_nccl_cleanup
from ._bridge import PendingCollective
from ._group import Group
from ._trail import Trail
from ._transport import GroupTransport, Transport

__all__ = ["Clique", "open_clique"]

logger = logging.getLogger(__name__)

_SETUP: Phase = "clique setup"


@attrs.define(eq=False)
class Clique:
    """One rank's handle on an open clique: awaitable collectives over its transport.

    Get one from :func:`open_clique` (a process group: ranks in several processes) or from
    the in-process cliques of ``lampdist.local_data_parallel_training_loop``. Every collective
    sums (``reduce``, ``all_reduce``, ``reduce_scatter``) or copies in place, treats each
    tensor of a sequence as a collective of its own (pass flat buffers for speed), and must be
    issued in the same order on every rank. The ``async`` methods wait without blocking the
    event loop; the ``start_*`` methods start the same collectives from any thread (a rank's
    compute thread, autograd hooks) and return a :class:`PendingCollective` to wait for later.

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
    """``"nccl"`` or ``"gloo"`` for a process group; ``"local"`` for the ranks of one
    process (``"local-nccl"`` when they are on several GPUs)."""
    _transport: Transport = attrs.field(alias="transport", repr=False)
    _trail: Trail = attrs.field(alias="trail", factory=Trail, repr=False)

    def at_step(self, epoch: int, phase: Phase, step: int) -> None:
        """Note that this rank is at step ``step`` (from 0) of its ``phase`` pass
        (``"train"`` or ``"valid"``) in epoch ``epoch``; callable from any thread, once per
        step: it is one attribute store, and nothing leaves the rank.

        When a collective runs past ``collective_timeout``, the
        :class:`~lampdist.CliqueTimeout` names, for every rank of a process group, the step
        it last noted here, its last collectives and how long it has waited in its current
        one (docs/reliability.md, "Which rank stopped where").
        """
        self._trail.step = (epoch, phase, step, time.monotonic())

    def explain(self, exc: BaseException, phase: Phase) -> LampdistError | None:
        """The clique's account of ``exc``, a failure seen outside its collectives (one of
        torch's default group, which ``step_on="fsdp"`` runs inside the model): the clique's
        own failure, or a :class:`~lampdist.CollectiveFailed` naming the peer that left it;
        ``None`` when the clique knows of none (``exc`` is then the caller's own)."""
        found = self._transport.explain(exc, phase)
        if found is None:
            return None
        kind, message = found
        return kind(message, rank=self.rank, phase=phase)

    def end_process(self, rank: int) -> int | None:
        """End rank ``rank``'s process with SIGKILL when it runs on this machine (same boot,
        same PID namespace) and is still the process that opened the clique; returns its PID,
        or ``None`` when nothing was ended (another machine, an in-process clique, a process
        already gone). The root calls it for a follower the control channel found
        unresponsive (:class:`~lampdist.PeerUnresponsive`), unless
        ``Timeouts(end_unresponsive=False)``. Blocking (a store read): call it from a worker
        thread in async code."""
        return self._transport.end_process(rank)

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

        ``input`` has ``nranks * output.numel()`` elements. ``output`` may be chunk ``r`` of
        ``input`` itself (in place); the rest of ``input`` is then scratch.
        """
        await self.start_reduce_scatter(output, input)

    async def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Concatenate every rank's ``input`` into every rank's ``output``, in rank order.

        ``output`` has ``nranks * input.numel()`` elements; ``input`` may be this rank's chunk
        of ``output`` itself (in place).
        """
        await self.start_all_gather(output, input)

    async def barrier(self) -> None:
        """Wait until every rank has reached the barrier (on CUDA: and its GPU work before it)."""
        await self._transport.barrier()

    def abort(self, reason: str) -> None:
        """Break the clique on purpose; callable from any thread.

        Every pending and later collective of this rank raises
        :class:`~lampdist.CollectiveFailed` (a thread in ``wait_blocking`` wakes at once), the
        other ranks' collectives fail with an error that names this rank and ``reason``, and
        on NCCL the communicator is aborted. It may block briefly (a process group posts a
        notice on the clique's store), so call it from a worker thread in async code. Leave
        the ``async with`` block afterwards.
        """
        self._transport.abort(reason)

    def abandon(self, reason: str) -> None:
        """:meth:`abort`, for a clique given up because a peer is lost: its teardown then
        does not wait for the collectives in flight, which a stalled peer (a stopped
        process, a machine gone without closing its connections) holds until they time
        out. Over process groups the group is left to end in the background. The root's
        recovery of a lost rank (:class:`lampdist.Recovery`) abandons the clique of the
        generation it ends."""
        self._transport.abandon(reason)

    def start_broadcast(self, tensors: Sequence[torch.Tensor], root: int = 0) -> PendingCollective:
        """Start :meth:`broadcast` and return at once; callable from any thread."""
        checked = self._tensors("broadcast", tensors)
        self._check_root("broadcast", root)
        return self._transport.broadcast(checked, root)

    def start_reduce(self, tensors: Sequence[torch.Tensor], root: int = 0) -> PendingCollective:
        """Start :meth:`reduce` and return at once; callable from any thread."""
        checked = self._tensors("reduce", tensors)
        self._check_root("reduce", root)
        return self._transport.reduce(checked, root)

    def start_all_reduce(self, tensors: Sequence[torch.Tensor]) -> PendingCollective:
        """Start :meth:`all_reduce` and return at once; callable from any thread."""
        return self._transport.all_reduce(self._tensors("all_reduce", tensors))

    def start_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective:
        """Start :meth:`reduce_scatter` and return at once; callable from any thread."""
        self._pair("reduce_scatter", output, input, gather=False)
        return self._transport.reduce_scatter(output, input)

    def start_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective:
        """Start :meth:`all_gather` and return at once; callable from any thread."""
        self._pair("all_gather", output, input, gather=True)
        return self._transport.all_gather(output, input)

    # -- argument checks -----------------------------------------------------------------

    def _check_root(self, phase: Collective, root: int) -> None:
        if not 0 <= root < self.nranks:
            raise ConfigError(
                f"root must be a rank in 0..{self.nranks - 1}, got {root}",
                rank=self.rank,
                phase=phase,
            )

    def _check_tensor(self, phase: Collective, tensor: object) -> torch.Tensor:
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

    def _tensors(self, phase: Collective, tensors: object) -> tuple[torch.Tensor, ...]:
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise ConfigError(
                "pass a sequence of tensors, e.g. [tensor]", rank=self.rank, phase=phase
            )
        checked = tuple(self._check_tensor(phase, tensor) for tensor in tensors)
        return tuple(tensor for tensor in checked if tensor.numel() > 0)

    def _pair(
        self, phase: Collective, output: torch.Tensor, input: torch.Tensor, *, gather: bool
    ) -> None:
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


def _clique_device(device: torch.device | str | int, rank: int) -> torch.device:
    """``device`` read by :func:`~lampdist._device.resolve_device`, checked for a clique (a CUDA
    device with NCCL, or the CPU), with the current CUDA device for ``"cuda"`` alone."""
    resolved = resolve_device(device, rank=rank, phase=_SETUP)
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
    setup_timeout: float | None = SETUP_TIMEOUT,
    collective_timeout: float | None = COLLECTIVE_TIMEOUT,
    limiter: anyio.CapacityLimiter | None = None,
    default_group: bool = False,
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

    With ``default_group`` the clique also opens torch's default process group from the same
    rendezvous, within the same deadlines (what ``torch.distributed``'s own tools, such as
    FSDP2's ``DeviceMesh``, need; one rank per process), aborts it with the clique and destroys
    it when the clique closes.

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
        device=_clique_device(device, rank),
        clique_id=clique_id,
        setup_timeout=setup_timeout,
        collective_timeout=collective_timeout,
        limiter=limiter,
        threaded=False,
        default_group=default_group,
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
    default_group: bool = False,
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
        default_group=default_group,
        check_cancelled=anyio.from_thread.check_cancelled,
    )
    group = await anyio.to_thread.run_sync(connect, limiter=limiter)
    transport = GroupTransport.create(group)
    clique = Clique(
        rank=rank,
        nranks=nranks,
        device=device,
        backend=group.backend,
        transport=transport,
        trail=group.trail,
    )
    try:
        try:
            yield clique
        except BaseException as exc:
            await group.aclose(exc, limiter=limiter)
            raise
        await group.aclose(None, limiter=limiter)
    finally:
        transport.close()
