"""The root's side of one registered follower on the TCP control channel."""

from __future__ import annotations

import logging
import math

import anyio
import attrs
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._errors import LampdistError, PeerDisconnected, PeerUnresponsive, ProtocolError, RankFailed
from ._bookkeeping import RootRegistry
from ._settings import Liveness, TcpSettings
from ._wire import Ack, FailureReport, FramedStream, Message, Ping, encode_frame

__all__ = ["AckRound", "FollowerSession"]

logger = logging.getLogger(__name__)


@attrs.define(eq=False)
class AckRound:
    """The followers that one broadcast still waits for."""

    seq: int
    waiting: set[int]
    done: anyio.Event = attrs.field(factory=anyio.Event)

    def settle(self, rank: int) -> None:
        self.waiting.discard(rank)
        if not self.waiting:
            self.done.set()


@attrs.define(eq=False)
class FollowerSession:
    """One registered follower: its frames go out in order (straight from the caller when
    nothing is queued, else through a writer task), a reader takes acknowledgements and
    failure reports, and a watchdog sends heartbeats and checks the peer's."""

    rank: int
    framed: FramedStream
    registry: RootRegistry
    settings: TcpSettings
    _outbox: MemoryObjectSendStream[bytes] = attrs.field(init=False)
    _outbox_out: MemoryObjectReceiveStream[bytes] = attrs.field(init=False)
    _queued: int = 0
    _lock: anyio.Lock = attrs.field(init=False)
    _live: Liveness = attrs.field(init=False)
    acked_seq: int = 0
    stop_seq: int | None = None
    ack_round: AckRound | None = None
    ended: bool = False
    clique_sent: bool = False
    """Whether the follower has been sent the clique id (it takes one per connection)."""
    forgotten: bool = False
    """Whether the root forgot this follower (see :meth:`forget`): from then on the session
    tells the registry nothing, since a new process may hold its rank."""
    _scope: anyio.CancelScope | None = None

    def __attrs_post_init__(self) -> None:
        self._outbox, self._outbox_out = anyio.create_memory_object_stream[bytes](math.inf)
        self._lock = anyio.Lock(fast_acquire=True)
        self._live = Liveness(self.settings.heartbeat_timeout)

    def enqueue(self, frame: bytes) -> None:
        """Queue ``frame`` for the writer task."""
        if not self.ended:
            self._queued += 1
            self._outbox.send_nowait(frame)

    async def send(self, frame: bytes) -> None:
        """Send ``frame`` from the caller's task if nothing is queued before it (saves a task
        switch per follower and command), else queue it. A broken connection ends the
        session."""
        if self.ended:
            return
        if self._queued or self._lock.locked():
            self.enqueue(frame)
            return
        try:
            await self._send(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self.lost(f"the control connection broke ({exc!r})")

    async def _send(self, frame: bytes) -> None:
        async with self._lock:
            self._live.sending_since = anyio.current_time()
            await self.framed.send_frame(frame)
            self._live.sending_since = None

    def forget(self) -> None:
        """End the session for good (the root's recovery replaces its follower): its
        connection closes and its rank is no longer this session's to report on."""
        self.forgotten = True
        self.ended = True
        if self.ack_round is not None:
            self.ack_round.settle(self.rank)
        if self._scope is not None:
            self._scope.cancel()

    def _end(self, error: LampdistError) -> None:
        if not self.ended:
            self.ended = True
            self.registry.fail(self.rank, error)
            if self.ack_round is not None:
                self.ack_round.settle(self.rank)

    def lost(self, reason: str) -> None:
        self._end(PeerDisconnected(reason, rank=self.rank, phase=self.registry.phase))

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                self._scope = task_group.cancel_scope
                if self.forgotten:
                    task_group.cancel_scope.cancel()
                task_group.start_soon(self._read, task_group)
                task_group.start_soon(self._write, task_group)
                task_group.start_soon(self._watchdog, task_group)
        finally:
            if not self.ended:  # cancelled: the root is closing
                self.ended = True
                if self.ack_round is not None:
                    self.ack_round.settle(self.rank)
            self._outbox.close()

    async def _read(self, task_group: TaskGroup) -> None:
        try:
            while True:
                message = await self.framed.receive()
                self._live.heard()
                self._on_message(message)
        except anyio.EndOfStream:
            self.lost("the follower closed the control connection")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self.lost(f"the control connection broke ({exc!r})")
        except ProtocolError as exc:
            logger.warning(
                "rank %d sent a bad frame: %s", self.rank, exc, extra={"rank": self.rank}
            )
            self.lost(f"the follower sent a bad frame ({exc.message})")
        task_group.cancel_scope.cancel()

    def _on_message(self, message: Message) -> None:
        if isinstance(message, Ping):
            return
        if isinstance(message, Ack):
            if self.stop_seq is not None and message.seq >= self.stop_seq:
                self.registry.mark_stopped(self.rank)
            self.acked_seq = max(self.acked_seq, message.seq)
            if self.ack_round is not None and message.seq >= self.ack_round.seq:
                self.ack_round.settle(self.rank)
            return
        if isinstance(message, FailureReport):
            error = RankFailed(message.message, rank=self.rank, phase=message.phase)
            self.registry.fail(self.rank, error, reported=True)
            return
        raise ProtocolError(f"a follower may not send '{message.TAG}' frames")

    async def _write(self, task_group: TaskGroup) -> None:
        try:
            async for frame in self._outbox_out:
                try:
                    await self._send(frame)
                finally:
                    self._queued -= 1
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            self.lost(f"the control connection broke ({exc!r})")
        task_group.cancel_scope.cancel()

    async def _watchdog(self, task_group: TaskGroup) -> None:
        ping = encode_frame(Ping())
        while True:
            since = anyio.current_time()
            await anyio.sleep(self.settings.heartbeat_interval)
            own = self._live.stalled_here(since)
            if own is not None:  # the root's own stall: no follower's fault
                phase = self.registry.phase
                message = f"{own}: its followers have given up on it"
                self._end(PeerUnresponsive(message, rank=0, phase=phase))
                task_group.cancel_scope.cancel()
                return
            problem = self._live.problem()
            if problem is not None:
                self._end(PeerUnresponsive(problem, rank=self.rank, phase=self.registry.phase))
                task_group.cancel_scope.cancel()
                return
            self.enqueue(ping)
