"""Starting a group's collectives from any thread: inline on the calling thread, or on the
issuing thread (NCCL, from an event loop thread), in the order their starts took the group's
lock."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._errors import CliqueError, Collective, CollectiveFailed
from ._backends import translate
from ._bridge import Failure, PendingCollective, on_event_loop_thread
from ._group_explain import ExplainingGroup

__all__ = ["Issue", "IssuingGroup"]


# Enqueues the collective's works on the process group, appending each to the list.
Issue = Callable[[Any, list[Any]], None]


class IssuingGroup(ExplainingGroup):
    """The group's collectives, started from any thread (see the module docstring)."""

    __slots__ = ()

    # -- collectives -----------------------------------------------------------------------

    def start(
        self, name: Collective, issue: Issue, *, nbytes: int = 0, wait_for_device: bool = False
    ) -> PendingCollective:
        """Start a collective from any thread; raise at once if the clique is closed or broken.

        ``nbytes``, the size of the tensors it moves, goes into the rank's trail with the
        collective's number, for the account of a timeout.

        The calling thread issues it (a rank's compute thread, autograd's thread for a
        gradient bucket), except on an event loop thread with NCCL: an NCCL call can wait on
        the CUDA driver (for a GPU that another rank of the process keeps busy), which must
        not stall the loop, so the issuing thread does it there. Collectives are issued in
        the order their starts took ``_lock``: once one went to the issuing thread, every
        later one goes there too, and the issuing thread waits for the inline issues decided
        before it (``_inline_issues``).
        """
        pending = PendingCollective(
            name=name, rank=self.rank, owner=self, timeout=self.collective_timeout
        )
        hand_off = self._hand_off and (self._handing_off or on_event_loop_thread())
        # The caller's stream: the collective must see the work queued on it before this
        # call (the issuing thread's own current stream is another one).
        stream = None
        if self.device.type == "cuda" and (hand_off or wait_for_device):
            stream = torch.cuda.current_stream(self.device)
        with self._lock:
            if self._closing:
                raise CliqueError(
                    "the clique is closed; open a new one", rank=self.rank, phase=name
                )
            failure = self._failure
            if failure is None:
                self._pending.add(pending)
                pending._entry = self.trail.start(name, nbytes, pending._started)
                hand_off = hand_off or self._handing_off
                if hand_off:  # under the lock: never behind the stop sentinel
                    if stream is None and self.device.type == "cuda":
                        # Another thread handed off since the read above: the issuing
                        # thread still needs the caller's stream.
                        stream = torch.cuda.current_stream(self.device)
                    self._handing_off = True
                    self._issuing_queue().put((pending, issue, stream, wait_for_device))
                else:
                    self._inline_issues += 1
        if failure is not None:
            kind, message = failure
            raise kind(message, rank=self.rank, phase=name)
        if not hand_off:
            try:
                self._enqueue(pending, issue, stream, wait_for_device)
            finally:
                with self._lock:
                    self._inline_issues -= 1
                    if not self._inline_issues:
                        self._inline_done.notify_all()
        return pending

    # -- the issuing thread ----------------------------------------------------------------

    def _issuing_queue(self) -> queue.SimpleQueue[Any]:
        """The issuing thread's queue, starting the thread on first use (under the lock)."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            issuer = threading.Thread(
                target=self._run_issuer, daemon=True, name=f"lampdist-clique-issue-{self.rank}"
            )
            self._threads.append(issuer)
            issuer.start()
        return self._queue

    def _run_issuer(self) -> None:
        # One thread per rank, so several ranks of one process never share it.
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        items = self._queue
        if items is None:  # set before this thread starts
            return
        while (item := items.get()) is not None:
            with self._lock:  # inline issues decided before this item came first
                while self._inline_issues:
                    self._inline_done.wait()
            self._enqueue(*item)
            del item

    # -- issuing on the process group ------------------------------------------------------

    def _enqueue(
        self, pending: PendingCollective, issue: Issue, stream: Any, wait_for_device: bool
    ) -> None:
        works: list[Any] = []
        failure: Failure | None = None
        device_event = None
        with self._pg_lock:
            pg = self._pg
            try:
                if pg is None:
                    failure = self._failure or (CollectiveFailed, "the clique was torn down")
                elif stream is not None:
                    with torch.cuda.stream(stream):
                        issue(pg, works)
                        if wait_for_device:
                            for work in works:
                                work.wait()  # the caller's stream waits for the collective
                            device_event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
                            device_event.record(stream)
                else:
                    issue(pg, works)
            except Exception as exc:
                failure = translate(exc, pending.name)
            finally:
                del pg  # the group's last reference must never be a thread's local
        pending._attach(
            works,
            track_device=self.backend == "nccl",
            device_event=device_event,
            failure=failure,
        )
