"""The live state of one open clique: enqueue, failure, peers that die or abort, teardown.

One :class:`Group` per open clique. It owns the torch process group (never the default
group), one TCPStore client, the liveness tether to rank 0 (see ``_tether``), a watcher
thread that selects on the tether and polls the store for abort notices and for a peer's
request for this rank's trail (see ``_trail``), and on NCCL an enqueue thread. Everything
blocking runs in worker threads; everything it holds is dropped on close, so no group or
work object outlives the clique.

The group comes in layers, each a module that imports only the ones below it:

- ``_group_state``: the fields, the thread that owns each, and the failure they share;
- ``_group_explain``: what a failure says (a backend's error, a timeout's account of where
  every rank is, a failure seen outside the clique);
- ``_group_issue``: starting collectives, inline or on the issuing thread;
- ``_group_abort``: breaking the clique (an abort, a peer that died or aborted);
- ``_group_watch``: the watcher thread;
- ``_group_teardown``: closing, on every path;
- this module: connecting (:meth:`Group.connect`).
"""

from __future__ import annotations

import gc
import logging
import socket
import threading
import traceback
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from types import TracebackType
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore

from .._clique_id import CliqueId
from .._errors import CliqueError, LampdistError
from .._store import connect_store
from ._backends import SETUP, Setup, make_gloo, make_nccl, span, translate
from ._group_issue import Issue
from ._group_teardown import ClosingGroup
from ._group_watch import WATCHER_NAME
from ._process import identity
from ._sockets import TransportSockets, noting_sockets
from ._store_link import StoreLink
from ._tether import Tether

__all__ = ["Group", "Issue"]

logger = logging.getLogger(__name__)

# Store operations after setup (abort notices, trails): small, so a short deadline, which
# bounds how long an abort waits on a store whose host stalled (the root's process).
_STORE_OP_TIMEOUT = timedelta(seconds=2)


class Group(ClosingGroup):
    """The live state of one open clique on one rank (see the module docstring); its fields
    and the threads that own them are in ``_group_state``."""

    __slots__ = ()

    # -- setup (the setup thread) ----------------------------------------------------------

    @classmethod
    def connect(
        cls,
        *,
        clique_id: CliqueId,
        rank: int,
        device: torch.device,
        setup_timeout: float | None,
        collective_timeout: float | None,
        threaded: bool,
        default_group: bool = False,
        check_cancelled: Callable[[], None] = lambda: None,
    ) -> Group:
        """Build the process group (blocking: run it in a worker thread).

        Every wait until all ranks are known to be ready is a loop of short slices that calls
        ``check_cancelled`` (``anyio.from_thread.check_cancelled``) and looks for a peer's
        abort notice. Raises :class:`CliqueTimeout` when the peers do not all arrive within
        ``setup_timeout``, :class:`CollectiveFailed` when a peer abandoned the setup, and
        :class:`CliqueError` on any other setup failure.

        With ``default_group``, torch's default process group is opened next, from the same
        store and within the same deadline (see :func:`open_default_group`).

        Each part is registered on an exit stack as it is acquired (see :meth:`_assemble`):
        on any failure, an error or the caller's cancellation, the stack releases what was
        acquired, then drops every partial object before the error travels on.
        """
        backend = "nccl" if device.type == "cuda" else "gloo"
        setup = Setup.start(rank, setup_timeout, check_cancelled)
        try:
            with ExitStack() as stack:
                stack.push(_forget_partial_objects)  # last on a failure
                group, name = cls._assemble(
                    stack,
                    setup,
                    clique_id=clique_id,
                    rank=rank,
                    device=device,
                    backend=backend,
                    collective_timeout=collective_timeout,
                    default_group=default_group,
                )
                stack.pop_all()  # the group holds every part now
        except Exception as exc:
            if isinstance(exc, LampdistError):
                raise
            kind, message = translate(exc, SETUP)
            raise kind(message, rank=rank, phase=SETUP) from exc
        group._start_threads(threaded or backend == "nccl")
        logger.debug("rank %d: %s clique %s open", rank, backend, name)
        return group

    @classmethod
    def _assemble(
        cls,
        stack: ExitStack,
        setup: Setup,
        *,
        clique_id: CliqueId,
        rank: int,
        device: torch.device,
        backend: str,
        collective_timeout: float | None,
        default_group: bool,
    ) -> tuple[Group, str]:
        """The group and its name: the store, the keys of this opening, the tether, the
        process group (and the default group). Whatever must be released on a failure goes
        on ``stack`` as it is acquired, so that the caller's stack runs, on a failure:

        1. the default group's destruction, once its opening started;
        2. the abort notice that tells the peers this rank abandoned the setup, once the keys
           are known (before the tether closes: a peer whose tether ends reads why);
        3. the tether's close;
        4. the caller's :func:`_forget_partial_objects`: this frame and those below it hold
           the stores and the groups, which go with them.
        """
        op_timeout = span(collective_timeout)
        store = connect_store(clique_id.host, clique_id.port, setup.remaining)
        base = PrefixStore(clique_id.prefix, store)
        generation = base.add(f"generation/{rank}", 1)  # several openings of one id
        keys = PrefixStore(f"open/{generation}", base)
        setup.keys = keys
        # From here a failure tells the peers that this rank abandoned the setup: until the
        # tether is tied, through this block; then from the stack, before the tether closes.
        with _Abandoning(setup):
            pg_store = PrefixStore("pg", keys)
            name = f"lampdist-{clique_id.prefix[:8]}-{generation}"
            tether = Tether.connect(
                keys=keys,
                rank=rank,
                nranks=clique_id.nranks,
                host=clique_id.host,
                port=clique_id.port,
                remaining=setup.remaining,
            )
        stack.callback(tether.close, goodbye=False)
        stack.enter_context(_Abandoning(setup))  # after the close: runs before it
        keys.set(f"process/{rank}", identity())  # see end_process
        # Every rank alive and tied to rank 0 before the process group's own setup,
        # which cannot be interrupted, starts.
        keys.set(f"ready/{rank}", "1")
        setup.wait_for(keys, [f"ready/{peer}" for peer in range(clique_id.nranks)])
        pg, sockets = _open_process_groups(
            stack,
            setup,
            keys=keys,
            pg_store=pg_store,
            name=name,
            clique_id=clique_id,
            rank=rank,
            device=device,
            backend=backend,
            op_timeout=op_timeout,
            default_group=default_group,
        )
        store.set_timeout(_STORE_OP_TIMEOUT)
        group = cls(
            rank=rank,
            nranks=clique_id.nranks,
            device=device,
            backend=backend,
            collective_timeout=collective_timeout,
            pg=pg,
            store=store,
            keys=keys,
            tether=tether,
            owns_default=default_group,
            sockets=sockets,
            link=StoreLink(rank, keys, (clique_id.host, clique_id.port)),
        )
        return group, name

    def _start_threads(self, threaded: bool) -> None:
        self._wake_reader, self._wake_writer = socket.socketpair()
        watcher = threading.Thread(
            target=self._watch, daemon=True, name=f"{WATCHER_NAME}-{self.rank}"
        )
        self._threads.append(watcher)
        self._hand_off = threaded
        watcher.start()


# -- the process groups --------------------------------------------------------------------


def _open_process_groups(
    stack: ExitStack,
    setup: Setup,
    *,
    keys: Any,
    pg_store: Any,
    name: str,
    clique_id: CliqueId,
    rank: int,
    device: torch.device,
    backend: str,
    op_timeout: timedelta,
    default_group: bool,
) -> tuple[Any, TransportSockets]:
    """The clique's process group and, on Gloo, its connections (see ``_sockets``); with
    ``default_group``, torch's default group too, whose destruction goes on ``stack`` as its
    opening starts. Blocking, once every rank is ready: torch's setup cannot be interrupted."""
    noted: list[TransportSockets] = []
    # Gloo's connections, noted for an abort (NCCL has an abort of its own).
    with noting_sockets(noted.append) if backend == "gloo" else nullcontext():
        if backend == "gloo":
            pg = make_gloo(
                store=pg_store,
                host=clique_id.host,
                rank=rank,
                nranks=clique_id.nranks,
                name=name,
                budget=setup.budget,
                op_timeout=op_timeout,
            )
        else:
            pg = make_nccl(
                store=pg_store,
                rank=rank,
                nranks=clique_id.nranks,
                name=name,
                device=device,
                op_timeout=op_timeout,
            )
        if default_group:
            stack.push(_destroy_default_group)
            open_default_group(
                store=PrefixStore("default", keys),
                backend=backend,
                rank=rank,
                nranks=clique_id.nranks,
                device=device,
                timeout=op_timeout,
            )
    return pg, noted[0] if noted else TransportSockets()


class _Occupied(CliqueError):
    """The process has a default process group already (not ours to destroy)."""


def open_default_group(
    *, store: Any, backend: str, rank: int, nranks: int, device: torch.device, timeout: timedelta
) -> None:
    """Open torch's default process group over ``store``, whose collectives time out after
    ``timeout`` as the clique's do. Raises :class:`CliqueError` when the process has one: torch
    allows one per process, so one rank per process."""
    if dist.is_initialized():
        raise _Occupied(
            "this process already has torch's default process group; step_on='fsdp' needs "
            "one rank per process, and the process group to itself",
            rank=rank,
            phase=SETUP,
        )
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=nranks,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


# -- what a failed setup releases (exit callbacks of Group.connect's stack) ----------------


@attrs.frozen
class _Abandoning:
    """On a failure within: tell the peers that this rank abandoned the setup (unless one of
    them did first), then forget the keys."""

    setup: Setup

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.setup.abandon(exc)
            self.setup.keys = None


def _destroy_default_group(
    kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
) -> None:
    """On a failure once the default group's opening started: destroy it, unless the process
    had one already (:class:`_Occupied`: not this clique's)."""
    if exc is not None and dist.is_initialized() and not isinstance(exc, _Occupied):
        dist.destroy_process_group()


def _forget_partial_objects(
    kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
) -> None:
    """Last on a failure: drop every partial object here, before the error travels on. The
    frames of the setup below :meth:`Group.connect`, which the error's traceback keeps, still
    hold the stores and the groups; then collect the cycles."""
    if exc is None:
        return
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
