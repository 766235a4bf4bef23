"""Deterministic fault injection for the rank script: "at phase P of epoch E, do K".

A :class:`Fault` names what to do (``kind``), where (``phase``) and when (``epoch``). The
:class:`Injector` tracks the phase and epoch a rank is in (its wrapped batch sources say when
a pass starts) and acts at the injection points the rank script wires in: the loss function
(mid-pass, in a worker thread), the batch sources, the root's ``on_event`` callback and
checkpoint effect, the control channel (join) and the clique's liveness tether (setup).
Before it acts it writes ``fault.json`` (wall-clock time, rank, kind, phase, epoch) so that
the tests can measure how long the other ranks take to notice.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import anyio
import anyio.lowlevel
import attrs
import torch

KINDS = (
    "kill",  # SIGKILL this process
    "stop",  # SIGSTOP this process: it stalls with every connection open, until SIGCONT
    "raise",  # raise RuntimeError (in the loss, a batch source or the checkpoint effect)
    "stall-loop",  # block the event loop (a batch source sleeps on it): stops reading
    "sleep-step",  # sleep in the loss (a worker thread): the step stalls, heartbeats go on
    "drop",  # shut the control connection down under the channel's feet
    "cancel",  # cancel the root's task from outside (root only)
    "sigterm",  # send SIGTERM to this process (root: a graceful stop)
    "sigint",  # send SIGINT to this process (root: a graceful stop)
    "nan",  # the loss becomes NaN
    "inf",  # the loss becomes +inf
    "bad-batch",  # a batch source yields something that is no (inputs, target) batch
)
PHASES = ("join", "setup", "train", "valid", "checkpoint", "source")


@attrs.frozen(kw_only=True)
class Fault:
    """``KIND@PHASE[:EPOCH]``; ``phase='source'`` is the training batch source."""

    kind: str
    phase: str
    epoch: int = 0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        kind, _, where = spec.partition("@")
        phase, _, epoch = where.partition(":")
        if kind not in KINDS or phase not in PHASES:
            raise ValueError(f"bad fault {spec!r}: KIND@PHASE[:EPOCH], kinds {KINDS}")
        return cls(kind=kind, phase=phase, epoch=int(epoch or 0))


@attrs.define(eq=False)
class Injector:
    """The rank's phase and epoch, and the fault to inject there (if any)."""

    rank: int
    out: Path
    fault: Fault | None
    sleep_seconds: float = 30.0
    control_port: int = 0
    phase: str = "join"
    epoch: int = 0
    next_train_epoch: int = 0
    calls: int = 0
    cancel_scope: anyio.CancelScope | None = None
    _fired: bool = False

    # -- bookkeeping ---------------------------------------------------------------------

    def enter(self, phase: str) -> None:
        """A pass starts (called by the wrapped batch sources, once per pass)."""
        if phase == "train":
            self.epoch = self.next_train_epoch
            self.next_train_epoch += 1
        self.phase = phase
        self.calls = 0

    def due(self, phase: str, kinds: Sequence[str]) -> bool:
        """Whether the fault is for ``phase`` (of the current epoch) and of one of ``kinds``."""
        fault = self.fault
        return (
            fault is not None
            and not self._fired
            and fault.kind in kinds
            and fault.phase == phase
            and (phase in ("join", "setup") or fault.epoch == self.epoch)
        )

    def note(self) -> None:
        """Record the fault's wall-clock time for the tests, then mark it fired."""
        assert self.fault is not None
        self._fired = True
        record = {
            "time": time.time(),
            "rank": self.rank,
            "kind": self.fault.kind,
            "phase": self.fault.phase,
            "epoch": self.fault.epoch,
        }
        (self.out / f"fault-rank{self.rank}.json").write_text(json.dumps(record))

    # -- acts ------------------------------------------------------------------------------

    def act_anywhere(self) -> None:
        """The acts that work from any thread."""
        assert self.fault is not None
        kind = self.fault.kind
        self.note()
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached: SIGKILL is not deferred
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        elif kind in ("sigterm", "sigint"):
            os.kill(os.getpid(), signal.SIGTERM if kind == "sigterm" else signal.SIGINT)
        elif kind == "raise":
            raise RuntimeError(f"injected fault in rank {self.rank}'s {self.fault.phase}")
        elif kind in {"sleep-step", "stall-loop"}:
            time.sleep(self.sleep_seconds)
        elif kind == "drop":
            drop_connection(self.control_port)
        else:
            raise AssertionError(f"{kind} cannot be injected here")

    # -- injection points ------------------------------------------------------------------

    def loss(self, value: torch.Tensor) -> torch.Tensor:
        """In the loss function (a worker thread), at the second batch of a pass."""
        self.calls += 1
        if self.calls != 2:
            return value
        if self.due(self.phase, ("nan", "inf")):
            assert self.fault is not None
            self.note()
            return value * (math.nan if self.fault.kind == "nan" else math.inf)
        if self.due(
            self.phase, ("kill", "stop", "raise", "sleep-step", "drop", "sigterm", "sigint")
        ):
            self.act_anywhere()
        return value

    def source(self, phase: str, batches: Sequence[Any]) -> Iterator[Any]:
        """A batch source's iterator; ``phase='train'`` also serves the 'source' faults."""
        for index, batch in enumerate(batches):
            if index == 1 and phase == "train" and self.due("source", ("raise",)):
                self.act_anywhere()
            if index == 1 and phase == "train" and self.due("source", ("bad-batch",)):
                self.note()
                yield ["not", "a", "batch"]
                continue
            yield batch

    async def stalling_source(self, batches: Sequence[Any]) -> AsyncIterator[Any]:
        """An async batch source that blocks the event loop at its second batch."""
        for index, batch in enumerate(batches):
            if index == 1 and self.due("train", ("stall-loop",)):
                self.act_anywhere()  # time.sleep on the event loop thread
            yield batch

    async def at(self, phase: str) -> None:
        """On the event loop: join (after it), the root's on_event, the checkpoint effect."""
        if self.due(phase, ("cancel",)):
            self.note()
            assert self.cancel_scope is not None, "cancel is a root fault"
            self.cancel_scope.cancel()
        elif self.due(phase, ("kill", "stop", "raise", "drop", "sigterm", "sigint")):
            self.act_anywhere()
        await anyio.lowlevel.checkpoint()


def drop_connection(port: int) -> None:
    """Shut down every TCP connection of this process to or from ``port`` (both directions),
    as a network failure would: the peer sees the connection end, the channel its socket die."""
    dropped = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # not a socket
            continue
        with sock:  # closes the duplicate only; shutdown acts on the socket itself
            try:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                local, peer = sock.getsockname(), sock.getpeername()
            except OSError:  # not connected (a listener)
                continue
            if port in (local[1], peer[1]):
                sock.shutdown(socket.SHUT_RDWR)
                dropped += 1
    if not dropped:
        raise AssertionError(f"no connection on port {port} to drop")


def kill_in_thread_when(path: Path, injector: Injector) -> threading.Thread:
    """Start a daemon thread that injects the fault as soon as ``path`` exists."""

    def poll() -> NoReturn:
        while not path.exists():
            time.sleep(0.01)
        injector.act_anywhere()
        raise SystemExit  # only reached for faults that return

    thread = threading.Thread(target=poll, daemon=True, name="fault-trigger")
    thread.start()
    return thread
