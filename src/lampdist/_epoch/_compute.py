"""A rank's compute thread: every torch operation of the rank runs on it, for the whole run.

The event loop hands the thread a job (a whole pass, the model's layout, a snapshot) and
awaits its end; it is never on the per-step path. One OS thread serves every job of a run
because every thread that runs an intra-op-parallel torch op on the CPU keeps an OpenMP team,
and while such a thread stays alive (as a pooled worker thread does) the other threads' ops
slow down (docs/performance.md, and ``lampdist._openmp``). The thread ends with the run, and
its team with it; the event loop's own idle team is given back when the thread starts.

The thread is a plain thread, not an anyio worker thread: model code that must reach the
event loop passes a token, ``anyio.from_thread.run_sync(f, token=token)`` with ``token =
anyio.lowlevel.current_token()`` taken on the loop.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import attrs
import torch

from .._openmp import release_team
from .._wakeup import loop_scheduler

__all__ = ["ComputeThread", "open_compute_thread"]

T = TypeVar("T")


@attrs.define(eq=False)
class _Job:
    function: Callable[..., Any]
    args: tuple[Any, ...]
    done: anyio.Event = attrs.field(factory=anyio.Event)
    outcome: tuple[bool, Any] = (False, None)


_Jobs = queue.SimpleQueue[_Job | None]  # None ends the thread


def _serve(
    jobs: _Jobs,
    schedule: Callable[[Callable[[], object]], None],
    threads: int,
    device: torch.device | None,
) -> None:
    """The compute thread: run each job, then wake its waiter on the loop."""
    # The intra-op thread count of the thread that opened this one (the user's setting); a
    # loading thread lowers torch's process-wide default for a moment (see ``_feed``).
    failed: BaseException | None = None
    try:
        torch.set_num_threads(threads)
        if device is not None:
            # The current CUDA device is per thread: make the rank's current here, so that
            # model code's "cuda" tensors, events and streams land on it (a new thread starts
            # on GPU 0).
            torch.cuda.set_device(device)
    except BaseException as exc:  # every job raises it: the thread cannot run the rank
        failed = exc
    while (job := jobs.get()) is not None:
        if failed is not None:
            job.outcome = (False, failed)
        else:
            try:
                job.outcome = (True, job.function(*job.args))
            except BaseException as exc:  # handed to the awaiting task, as to_thread does
                job.outcome = (False, exc)
        schedule(job.done.set)
        del job


@attrs.define(eq=False)
class ComputeThread:
    """The compute thread of one rank (see the module docstring). Open it with
    :func:`open_compute_thread`."""

    rank: int
    intra_op_threads: int
    """torch's intra-op thread count on this thread: that of the thread that opened it."""
    _jobs: _Jobs = attrs.field(alias="jobs", repr=False)
    _thread: threading.Thread = attrs.field(alias="thread", repr=False)

    async def run(
        self,
        function: Callable[..., T],
        *args: Any,
        on_cancel: Callable[[], object] | None = None,
    ) -> T:
        """``function(*args)`` on the compute thread; its exception is raised here.

        A started job runs to its end. When the caller is cancelled meanwhile, ``on_cancel``
        (if given) runs in a worker thread to make the job end early (a pass checks between
        steps; a collective in flight needs the clique aborted), the job is waited for, and
        then the cancellation is raised. Raises :class:`RuntimeError` once the thread is
        closed.
        """
        if not self._thread.is_alive():
            raise RuntimeError(f"rank {self.rank}: the compute thread is closed")
        await anyio.lowlevel.checkpoint_if_cancelled()
        job = _Job(function, args)
        self._jobs.put(job)
        try:
            await job.done.wait()
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                if on_cancel is not None:
                    await anyio.to_thread.run_sync(on_cancel)
                await job.done.wait()
            raise
        succeeded, value = job.outcome
        if not succeeded:
            raise value
        result: T = value
        return result


@asynccontextmanager
async def open_compute_thread(
    rank: int, device: torch.device | None = None
) -> AsyncIterator[ComputeThread]:
    """Start rank ``rank``'s compute thread, with ``device`` its current CUDA device when it
    is one; end it when the block ends (on every path: a job never outlives the
    :meth:`ComputeThread.run` call that started it)."""
    release_team()  # the caller's (the event loop's) idle OpenMP team: see ``_openmp``
    cuda = None
    if device is not None and device.type == "cuda":
        # "cuda" means the opener's current device (without waking CUDA up on this thread)
        index: int | None = device.index
        if index is None:
            ready = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
            index = torch.cuda.current_device() if ready else 0
        cuda = torch.device("cuda", index)
    jobs: _Jobs = queue.SimpleQueue()
    schedule = loop_scheduler()
    threads = torch.get_num_threads()
    thread = threading.Thread(
        target=_serve,
        args=(jobs, schedule, threads, cuda),
        name=f"lampdist-compute-{rank}",
        daemon=True,
    )
    thread.start()
    try:
        yield ComputeThread(rank=rank, intra_op_threads=threads, jobs=jobs, thread=thread)
    finally:
        jobs.put(None)
        with anyio.CancelScope(shield=True):
            # No job runs now, so this is the time the thread takes to see the sentinel.
            await anyio.to_thread.run_sync(thread.join)
