"""In-process cliques: the ranks of one process exchange tensors without a process group.

Every collective is a rendezvous of the ranks: each hands its part (its tensors and, on
CUDA, its current stream) to the :class:`LocalHub` in the same order, and the rank that
completes the set issues the collective for all of them at once, on its own thread (a rank's
compute thread; a helper thread when that is an event loop's thread):

- on the CPU, as sums and copies with torch ops, in rank order;
- on several GPUs, as one NCCL group over every rank's GPU (``torch.cuda.nccl``, as
  ``DataParallel`` does), on each rank's stream.

Why not a process group per in-process rank, as across processes: each rank would issue its
own NCCL kernels, so a GPU could run a collective kernel that waits for a peer kernel that
its rank has not launched yet; a CUDA driver call that waits for that GPU (a lazy kernel load,
a pinned allocation, a pageable copy) and holds a driver lock the peer's launch needs then
deadlocks (docs/reliability.md, Limits). Issued together, every kernel that runs has all of
its peers launched, so every GPU's queued work completes without the host.

A rank alone (``nranks == 1``) uses this clique too: it has nothing to exchange, and no
threads, sockets or store to keep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import torch

from .._errors import (
    CliqueError,
    CliqueTimeout,
    Collective,
    CollectiveFailed,
    ConfigError,
    Phase,
)
from ._backends import describe, translate
from ._bridge import Failure, PendingCollective, on_event_loop_thread
from ._clique import Clique

__all__ = ["LocalHub"]

_SETUP: Phase = "clique setup"
_BARRIER_POLL = 50e-6  # seconds between polls of the ranks' GPU work in a CUDA barrier


@attrs.frozen
class _Part:
    """One rank's share of a collective."""

    rank: int
    tensors: tuple[torch.Tensor, ...]
    root: int
    pending: PendingCollective
    stream: Any  # the rank's current CUDA stream at the start, or None on the CPU


@attrs.define(eq=False)
class _Slot:
    """The parts of one collective (the n-th of every rank) gathered so far."""

    name: Collective
    parts: dict[int, _Part] = attrs.field(factory=dict)


@attrs.frozen
class _Breakage:
    """Why the hub broke: a rank's abort (``culprit``) or a failure of the hub itself."""

    kind: type[CollectiveFailed] | type[CliqueTimeout]
    message: str
    culprit: int | None = None

    def failure_for(self, rank: int) -> Failure:
        if self.culprit is None:
            return self.kind, self.message
        if self.culprit == rank:
            return self.kind, f"the clique was torn down on rank {rank}: {self.message}"
        return self.kind, f"rank {self.culprit} left the clique: {self.message}"


@attrs.define(eq=False)
class _DeviceWork:
    """What a waiter of an in-process CUDA collective orders its stream after."""

    event: Any  # torch.cuda.Event recorded after the collective on the rank's stream
    device: torch.device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def get_future(self) -> Any:
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    def get_future_result(self) -> Any:
        raise RuntimeError("in-process collectives have no device-side result")


@attrs.define(eq=False)
class LocalHub:
    """The in-process clique of ``len(devices)`` ranks, rank ``r`` on ``devices[r]``.

    Invariant (under ``_lock``): ``_slots[k]`` holds the parts of the k-th collective from
    the ranks that have started it; the last part to arrive takes the slot out and issues it.
    Once ``_broken`` is set every pending and later collective fails with it.
    """

    devices: tuple[torch.device, ...]
    collective_timeout: float | None
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)
    _slots: dict[int, _Slot] = attrs.field(factory=dict, init=False, repr=False)
    _started: list[int] = attrs.field(init=False, repr=False)
    _pending: set[PendingCollective] = attrs.field(factory=set, init=False, repr=False)
    _broken: _Breakage | None = attrs.field(default=None, init=False, repr=False)
    _left: set[int] = attrs.field(factory=set, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._started = [0] * len(self.devices)

    @classmethod
    def create(
        cls, devices: Sequence[torch.device], *, collective_timeout: float | None
    ) -> LocalHub:
        """A hub for one rank per device; raises :class:`ConfigError` for devices that
        cannot share an in-process clique (CPU and GPU mixed, or one GPU twice)."""
        devices = tuple(devices)
        if not devices:
            raise ConfigError("an in-process clique needs at least one rank", phase=_SETUP)
        kinds = {device.type for device in devices}
        if len(kinds) > 1:
            raise ConfigError(
                f"the ranks of one process are on {sorted(map(str, devices))}: put every rank "
                "on the CPU or every rank on a GPU of its own",
                phase=_SETUP,
            )
        if kinds == {"cuda"}:
            if len(set(devices)) < len(devices):
                raise ConfigError(
                    f"two ranks of one process share a GPU ({[str(d) for d in devices]}): give "
                    "each rank a GPU of its own",
                    phase=_SETUP,
                )
            if len(devices) > 1 and not hasattr(torch._C, "_nccl_all_reduce"):
                raise ConfigError(
                    "several GPUs in one process need a torch build with NCCL", phase=_SETUP
                )
        if collective_timeout is not None and not collective_timeout > 0:
            raise ConfigError(
                f"collective_timeout must be positive seconds or None, got {collective_timeout}",
                phase=_SETUP,
            )
        return cls(devices=devices, collective_timeout=collective_timeout)

    @property
    def nranks(self) -> int:
        """The number of ranks."""
        return len(self.devices)

    @property
    def backend(self) -> str:
        """``"local-nccl"`` for several GPUs, else ``"local"``."""
        return "local-nccl" if self.devices[0].type == "cuda" and self.nranks > 1 else "local"

    @asynccontextmanager
    async def open(self, rank: int) -> AsyncIterator[Clique]:
        """Rank ``rank``'s clique for the block. Leaving with an exception (or by
        cancellation) breaks the clique for every rank, naming this one; leaving cleanly
        makes the other ranks' later collectives fail at once instead of waiting for it."""
        if not 0 <= rank < self.nranks:
            raise ConfigError(
                f"rank must be in 0..{self.nranks - 1}, got {rank}", rank=rank, phase=_SETUP
            )
        clique = Clique(
            rank=rank,
            nranks=self.nranks,
            device=self.devices[rank],
            backend=self.backend,
            transport=_Member(self, rank),
        )
        try:
            yield clique
        except BaseException as exc:
            self.abort(rank, describe(exc))
            with self._lock:
                self._left.add(rank)
            raise
        with self._lock:
            self._left.add(rank)
            waiting = [slot for slot in self._slots.values() if rank not in slot.parts]
            if waiting:  # collectives that this rank will never join
                name = waiting[0].name
                self._break_locked(
                    _Breakage(CollectiveFailed, f"{name} failed: rank {rank} has left the clique"),
                    None,
                )

    # -- collectives -----------------------------------------------------------------------

    def start(
        self, rank: int, name: Collective, tensors: tuple[torch.Tensor, ...], root: int = 0
    ) -> PendingCollective:
        """Hand rank ``rank``'s part of its next collective over; the last rank to do so
        issues it for all (see the module docstring)."""
        pending = PendingCollective(
            name=name, rank=rank, owner=self, timeout=self.collective_timeout
        )
        device = self.devices[rank]
        stream: Any = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if name == "barrier" and stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
            event.record(stream)
            stream = event  # what the barrier waits for: this rank's GPU work so far
        part = _Part(rank, tensors, root, pending, stream)
        complete: _Slot | None = None
        with self._lock:
            failure = self._refusal(rank, name)
            if failure is None:
                index = self._started[rank]
                self._started[rank] += 1
                slot = self._slots.setdefault(index, _Slot(name))
                if slot.name != name:
                    other = next(iter(slot.parts))
                    failure = self._break_locked(
                        _Breakage(
                            CollectiveFailed,
                            f"{name} failed: rank {rank} started {name} while rank {other} "
                            f"started {slot.name}; every rank must issue the same collectives "
                            "in the same order",
                        ),
                        rank,
                    )
                else:
                    slot.parts[rank] = part
                    self._pending.add(pending)
                    if len(slot.parts) == self.nranks:
                        complete = self._slots.pop(index)
        if failure is not None:
            kind, message = failure
            raise kind(message, rank=rank, phase=name)
        if complete is not None:
            if on_event_loop_thread():  # the async API: sums and launches stay off the loop
                threading.Thread(
                    target=self._issue, args=(complete,), name="lampdist-local-issue", daemon=True
                ).start()
            else:
                self._issue(complete)
        return pending

    def _refusal(self, rank: int, name: Collective) -> Failure | None:  # under the lock
        if rank in self._left:
            return CliqueError, "the clique is closed; open a new one"
        if self._broken is not None:
            return self._broken.failure_for(rank)
        if self._left:
            gone = min(self._left)
            return CollectiveFailed, f"{name} failed: rank {gone} has left the clique"
        return None

    def _issue(self, slot: _Slot) -> None:
        """Run the collective of every rank (the last rank's thread)."""
        parts = [slot.parts[rank] for rank in range(self.nranks)]
        try:
            _check_parts(slot.name, parts)
            if self.devices[0].type == "cuda":
                works = _issue_on_gpus(slot.name, parts, self._deadline(parts))
            else:
                _issue_on_cpu(slot.name, parts)
                works = [[] for _ in parts]
        except (CollectiveFailed, CliqueTimeout) as exc:
            self._break(_Breakage(type(exc), exc.message))
            return
        except Exception as exc:
            kind, message = translate(exc, slot.name)
            kind = CliqueTimeout if kind is CliqueTimeout else CollectiveFailed
            self._break(_Breakage(kind, message))
            return
        cuda = self.devices[0].type == "cuda"
        for part, work in zip(parts, works, strict=True):
            part.pending._attach(work, track_device=cuda)

    def _deadline(self, parts: list[_Part]) -> float | None:
        """The earliest of the ranks' deadlines for this collective (``None``: no limit)."""
        deadlines = [part.pending._deadline() for part in parts]
        return None if None in deadlines else min(d for d in deadlines if d is not None)

    # -- failure ------------------------------------------------------------------------------

    def abort(self, rank: int, reason: str) -> None:
        """Rank ``rank`` breaks the clique: every pending and later collective fails, naming
        it and ``reason``."""
        self._break(_Breakage(CollectiveFailed, reason, culprit=rank))

    def _break(self, breakage: _Breakage) -> None:
        with self._lock:
            self._break_locked(breakage, None)

    def _break_locked(self, breakage: _Breakage, rank: int | None) -> Failure | None:
        if self._broken is None:
            self._broken = breakage
        pending, self._pending = list(self._pending), set()
        self._slots.clear()
        for each in pending:
            each._fail(self._broken.failure_for(each.rank))
        return None if rank is None else self._broken.failure_for(rank)

    # -- what pending collectives call ----------------------------------------------------------

    def _retire(self, pending: PendingCollective) -> None:
        with self._lock:
            self._pending.discard(pending)

    def _fail(self, failure: Failure) -> None:
        """A waiter timed out (or a collective failed): break the hub; a timeout names the
        ranks that never arrived."""
        kind, message = failure
        with self._lock:
            if kind is CliqueTimeout and self._slots:
                slot = self._slots[min(self._slots)]
                missing = [r for r in range(self.nranks) if r not in slot.parts]
                message += f" (rank(s) {missing} did not start it)"
            hub_kind = CliqueTimeout if kind is CliqueTimeout else CollectiveFailed
            self._break_locked(_Breakage(hub_kind, message), None)

    def _translate(self, exc: BaseException, phase: Phase, what: str | None = None) -> Failure:
        return translate(exc, phase)

    def _account(self, failure: Failure) -> Failure:
        return failure  # _fail has named the ranks that never started the collective


@attrs.define(eq=False)
class _Member:
    """One rank's transport on the hub."""

    hub: LocalHub
    rank: int

    def broadcast(self, tensors: tuple[torch.Tensor, ...], root: int) -> PendingCollective:
        return self.hub.start(self.rank, "broadcast", tensors, root)

    def reduce(self, tensors: tuple[torch.Tensor, ...], root: int) -> PendingCollective:
        return self.hub.start(self.rank, "reduce", tensors, root)

    def all_reduce(self, tensors: tuple[torch.Tensor, ...]) -> PendingCollective:
        return self.hub.start(self.rank, "all_reduce", tensors)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective:
        return self.hub.start(self.rank, "reduce_scatter", (output, input))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> PendingCollective:
        return self.hub.start(self.rank, "all_gather", (output, input))

    def barrier(self) -> PendingCollective:
        return self.hub.start(self.rank, "barrier", ())

    def abort(self, reason: str) -> None:
        self.hub.abort(self.rank, reason)

    def abandon(self, reason: str) -> None:
        self.hub.abort(self.rank, reason)  # in process, nothing is left in flight

    def end_process(self, rank: int) -> int | None:
        return None  # every rank is in this process

    def explain(self, exc: BaseException, phase: Phase) -> Failure | None:
        return None  # every collective of the ranks of one process goes through the hub


def _check_parts(name: Collective, parts: list[_Part]) -> None:
    """Raise :class:`CollectiveFailed` unless every rank passed alike tensors and root."""
    first = parts[0]
    shape = [(t.dtype, t.numel()) for t in first.tensors]
    for part in parts[1:]:
        if part.root != first.root:
            raise CollectiveFailed(
                f"{name} failed: rank {part.rank} named root {part.root}, rank 0 root {first.root}"
            )
        mine = [(t.dtype, t.numel()) for t in part.tensors]
        if mine != shape:
            raise CollectiveFailed(
                f"{name} failed: rank {part.rank} passed tensors of (dtype, size) {mine}, rank "
                f"0 passed {shape}; every rank must pass alike tensors"
            )


def _issue_on_cpu(name: Collective, parts: list[_Part]) -> None:
    """The collective as torch ops: sums in rank order, so every run adds alike."""
    nranks = len(parts)
    root = parts[0].root
    if name == "broadcast":
        for index, source in enumerate(parts[root].tensors):
            for part in parts:
                if part.rank != root:
                    part.tensors[index].copy_(source)
    elif name in ("reduce", "all_reduce"):
        for index in range(len(parts[0].tensors)):
            total = parts[0].tensors[index]
            if name == "reduce" and root != 0:
                total = total.clone()
            for part in parts[1:]:
                total.add_(part.tensors[index])
            targets = [parts[root]] if name == "reduce" else parts
            for part in targets:
                if part.tensors[index] is not total:
                    part.tensors[index].copy_(total)
    elif name == "reduce_scatter":
        for part in parts:
            output = part.tensors[0]
            chunks = [other.tensors[1].view(nranks, -1)[part.rank] for other in parts]
            # Summed aside first: in place, ``output`` is one of the chunks.
            total = chunks[0].clone()
            for chunk in chunks[1:]:
                total.add_(chunk)
            output.view(-1).copy_(total)
    elif name == "all_gather":
        for part in parts:
            rows = part.tensors[0].view(nranks, -1)
            for other in parts:
                rows[other.rank].copy_(other.tensors[1].view(-1))
    elif name != "barrier":
        raise AssertionError(name)


def _issue_on_gpus(name: Collective, parts: list[_Part], deadline: float | None) -> list[list[Any]]:
    """The collective as one NCCL group per tensor over every rank's GPU, on each rank's
    stream; returns each rank's works to order its waiter's stream after."""
    from torch.cuda import nccl

    if name == "barrier":
        _wait_for_gpus([part.stream for part in parts], deadline)
        return [[] for _ in parts]
    streams = [part.stream for part in parts]
    root = parts[0].root
    if name in ("broadcast", "reduce", "all_reduce"):
        for index in range(len(parts[0].tensors)):
            tensors = [part.tensors[index] for part in parts]
            if name == "broadcast":
                nccl.broadcast(tensors, root=root, streams=streams)
            elif name == "reduce":
                nccl.reduce(tensors, root=root, streams=streams)
            else:
                nccl.all_reduce(tensors, streams=streams)  # type: ignore[no-untyped-call]  # untyped in torch
    else:
        outputs = [part.tensors[0] for part in parts]
        inputs = [part.tensors[1] for part in parts]
        if name == "reduce_scatter":
            nccl.reduce_scatter(inputs, outputs, streams=streams)
        else:
            nccl.all_gather(inputs, outputs, streams=streams)
    works: list[list[Any]] = []
    for part in parts:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
        event.record(part.stream)
        works.append([_DeviceWork(event, part.tensors[0].device)])
    return works


def _wait_for_gpus(events: list[Any], deadline: float | None) -> None:
    """Poll every rank's barrier event until all have passed, within ``deadline``."""
    while not all(event.query() for event in events):
        if deadline is not None and time.monotonic() >= deadline:
            raise CliqueTimeout("barrier did not complete within collective_timeout")
        time.sleep(_BARRIER_POLL)
