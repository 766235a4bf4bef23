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
"""

from __future__ import annotations

import atexit
import gc
import importlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import anyio.to_thread

__all__ = ["MODULES", "preload"]

MODULES = ("torch._dynamo",)
"""The modules that a first run imports and ``import torch`` does not, heavy enough to stall
the event loop (``tests/test_first_run.py`` checks that nothing else is left)."""

_done = threading.Event()


def _import_modules() -> None:
    with _collections_deferred():
        for name in MODULES:
            importlib.import_module(name)
    if not _done.is_set():
        atexit.register(_freeze_at_exit)
    _done.set()


def _freeze_at_exit() -> None:
    """At interpreter exit, move every object to the permanent generation, so that the
    interpreter's last collections skip torch's object graph: a process that imported
    ``torch._dynamo`` then exits in about 0.3 s instead of 1.1-1.4 s (2 cores), and a
    launcher that polls its processes (torchrun) sees a failed rank go, and signals the
    others, a second earlier. Objects are still freed by reference counting; only cycles
    that are garbage at exit are left to the operating system, as Python allows for objects
    alive at exit (their ``__del__`` is not guaranteed to run)."""
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
