"""OpenMP thread teams on the CPU: only a rank's compute thread should hold one.

Every thread that runs an intra-op-parallel torch op gets a team of OpenMP threads, which
stays for as long as the thread lives, idle or not. GNU OpenMP (libgomp, which torch's Linux
builds use) counts the threads of every team, and once they outnumber the cores, idle
threads stop spinning and sleep at once, so that every parallel region waits for its threads
to wake: another thread's idle team slows a rank's steps (docs/performance.md has the
measurements).

The thread that builds the model (usually the one that runs the event loop) has such a team
by the time a run starts, and the compute thread would pay for it all run long. So the event
loop gives its own idle team back (:func:`release_team`) when a run and each pass start; the
loading threads never build one (they run with one intra-op thread, see ``epoch._feed``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

__all__ = ["release_team"]

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft (OpenMP 5.0)


@functools.cache
def _gomp_pause() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all``, if this process runs libgomp (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line}
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        return pause
    return None


def release_team() -> bool:
    """Give back the calling thread's idle OpenMP team, if it has one.

    libgomp's teams belong to the thread that started them, so this frees the caller's team
    only (the next parallel op on this thread builds a new one); another thread's running
    parallel region is not touched. Returns whether the runtime supports it (libgomp); with
    other OpenMP runtimes it does nothing.
    """
    pause = _gomp_pause()
    if pause is None:
        return False
    if pause(_OMP_PAUSE_SOFT) != 0:  # only inside a parallel region, which a caller is not
        logger.debug("omp_pause_resource_all refused to release this thread's team")
    return True
