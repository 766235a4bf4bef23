"""What a run imports before it starts, so that its first steps import nothing heavy.

A process's first ``torch.optim`` optimizer imports ``torch._dynamo``: torch wraps the
optimizer's methods in ``torch._disable_dynamo``, which imports it on the first call. That
import takes about a second, and the objects it creates, on top of torch's, trigger full
garbage collections that hold the GIL for 100-250 ms each, whatever thread imports: the
host's event loop serves nothing meanwhile. ``import lampdist`` leaves it out (it doubled the
time of a first use of lampdist, and ``lampdist --help`` needs no torch); instead every entry
point awaits :func:`preload` before it waits on a peer. The import runs in a worker thread
with automatic collections off, and its objects then go to the oldest generation
unexamined, so that the event loop goes on meanwhile (docs/performance.md has the
measurements).

The first preload also registers what the process does at exit (:func:`register_exit_hook`):
it waits for lampdist's own threads that are still running, then freezes its objects.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio.to_thread

__all__ = [
    "EXIT_WAIT",
    "MODULES",
    "THREAD_PREFIX",
    "await_own_threads",
    "preload",
    "register_exit_hook",
]

logger = logging.getLogger(__name__)

MODULES = ("torch._dynamo",)
"""The modules that a first run imports and ``import torch`` does not, heavy enough to stall
the event loop (``tests/test_first_run.py`` checks that nothing else is left)."""

THREAD_PREFIX = "lampdist-"
"""How the names of lampdist's own threads start (``lampdist-load-1``, ...)."""

EXIT_WAIT = 5.0
"""How long a process waits at exit for lampdist's threads that are still running: each
ends by itself within a bound of its own (a loading thread at its source's next batch, a
clique's watcher after its store call, an abandoned process group's destructor once its
collectives have failed), well within this one."""

_done = threading.Event()
_exit_lock = threading.Lock()
_exit_registered = threading.Event()


def _import_modules() -> None:
    with _collections_deferred():
        for name in MODULES:
            importlib.import_module(name)
    _done.set()
    register_exit_hook()


def register_exit_hook() -> None:
    """Register, once per process, what it does at exit, before the interpreter shuts down
    (:func:`_exit`). The first preload calls it, and so does a clique that leaves a process
    group to be destroyed in the background."""
    with _exit_lock:
        if not _exit_registered.is_set():
            atexit.register(_exit)
            _exit_registered.set()


def _exit() -> None:
    """Wait for lampdist's threads (:func:`await_own_threads`), then, in a process that
    preloaded, freeze its objects (:func:`_freeze`)."""
    await_own_threads(EXIT_WAIT)
    if _done.is_set():
        _freeze()


def await_own_threads(limit: float) -> list[str]:
    """Wait up to ``limit`` seconds for lampdist's threads to end; the names of those still
    running then, with a warning.

    At interpreter exit Python (3.11 to 3.13) ends a daemon thread that wants the GIL back
    once the shutdown has begun with ``pthread_exit``, whose unwinding aborts the process
    ("terminate called without an active exception", exit -6) when it crosses torch's C++
    frames: a thread inside a torch call (a store request, a process group's destructor, a
    tensor operation of a batch source) and Gloo's worker threads, which finish a
    collective's work, and run its completion callbacks, with the GIL. So the process must
    not begin its shutdown while one of lampdist's threads is inside torch: atexit handlers
    run before it (and after Python has joined the threads that are not daemons).
    """
    deadline = time.monotonic() + limit
    current = threading.current_thread()
    for thread in _own_threads(current):
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [thread.name for thread in _own_threads(current)]
    if left:
        logger.warning(
            "at exit, lampdist threads %s still run after %g s; the interpreter's shutdown "
            "may abort the process (exit -6) if one of them is inside torch",
            left,
            limit,
        )
    return left


PEER_BOUND = ("lampdist-store-", "lampdist-clique-watch-")
"""Threads left waiting on a stalled peer's store (see ``clique/_store_link``): not waited for
at exit, since the peer may never answer. Blocked in a socket read, such a thread does not
come back for the GIL unless the peer answers during the shutdown itself."""


def _own_threads(current: threading.Thread) -> list[threading.Thread]:
    return [
        thread
        for thread in threading.enumerate()
        if thread is not current
        and thread.name.startswith(THREAD_PREFIX)
        and not thread.name.startswith(PEER_BOUND)
    ]


def _freeze() -> None:
    """Move every object to the permanent generation, so that the interpreter's last
    collections skip torch's object graph: a process that imported ``torch._dynamo`` then
    exits in about 0.3 s instead of 1.1-1.4 s (2 cores), and a launcher that polls its
    processes (torchrun) sees a failed rank go, and signals the others, a second earlier.
    Objects are still freed by reference counting; only cycles that are garbage at exit are
    left to the operating system, as Python allows for objects alive at exit (their
    ``__del__`` is not guaranteed to run)."""
    gc.freeze()


@contextmanager
def _collections_deferred() -> Iterator[None]:
    """No automatic garbage collection in the block, and the objects made meanwhile moved to
    the oldest generation unexamined (``freeze`` then ``unfreeze``): the next full collection
    the process makes examines them, and none holds the GIL for the block's sake. Nothing
    changes where collections are off or objects frozen already (a pre-fork server's)."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        gc.enable()


async def preload() -> None:
    """Import :data:`MODULES` in a worker thread, once per process, while the event loop
    goes on; later calls return at once.

    Cancelling the caller does not wait for the import: it finishes in its thread, and the
    next call waits for it through the import lock.
    """
    if not _done.is_set():
        await anyio.to_thread.run_sync(_import_modules, abandon_on_cancel=True)
