"""What runs in a rank's actor: the rank's :class:`~lampdist.launch.LaunchEnv` built from
what the driver hands it, the user's ``main`` in an event loop of its own, and the board
through which the root hands its control port to the followers."""

from __future__ import annotations

import contextvars
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import attrs
import torch

from .._errors import ConfigError, JoinTimeout
from ..launch import LaunchEnv, PortExchange

__all__ = [
    "Board",
    "RankActor",
    "RankSpec",
    "RayPortExchange",
    "RunContext",
    "import_ray",
    "run_context",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

POLL_INTERVAL = 0.1
"""How often a follower asks the board for the root's control port (seconds)."""


def import_ray() -> Any:
    """The ``ray`` module; an ImportError saying how to install it when it is missing."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "lampdist.ray needs Ray, which is not installed: pip install 'lampdist[ray]'"
        ) from exc
    return ray


@attrs.frozen(kw_only=True)
class RunContext:
    """Where this rank's ``main`` runs within :func:`lampdist.ray.run` (read it with
    :func:`run_context`): ``attempt`` counts the job's starts (0 the first; a lost root
    starts the next, see ``max_failures``), ``start`` this rank's starts within the attempt
    (0 the first; a follower's actor started again after its loss runs ``main`` with 1, 2,
    ...), ``node_ip`` the address of the node this actor runs on."""

    attempt: int
    start: int
    node_ip: str


_CURRENT: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar(
    "lampdist_ray_run_context", default=None
)
"""This actor's :class:`RunContext` while its ``main`` runs (the event loop copies it)."""


def run_context() -> RunContext:
    """The :class:`RunContext` of the rank whose ``main`` calls it.

    Raises :class:`~lampdist.ConfigError` outside a ``main`` that :func:`lampdist.ray.run`
    started."""
    current = _CURRENT.get()
    if current is None:
        raise ConfigError(
            "lampdist.ray.run_context() is only known inside the main that lampdist.ray.run "
            "runs on each rank",
            phase="launch",
        )
    return current


class Board:
    """The root's control port for one attempt, and each rank's starts (an actor of no
    resources)."""

    def __init__(self) -> None:
        self._port: int | None = None
        self._starts: dict[int, list[int]] = {}

    def started(self, rank: int, pid: int) -> int:
        """Note that ``rank``'s ``main`` starts in process ``pid``; how many starts of it
        came before this one."""
        pids = self._starts.setdefault(rank, [])
        pids.append(pid)
        return len(pids) - 1

    def publish(self, port: int) -> None:
        self._port = port

    def lookup(self) -> int | None:
        return self._port


def _never() -> None:
    """A ``check_cancelled`` for callers that cannot be cancelled."""


@attrs.frozen(kw_only=True)
class RayPortExchange(PortExchange):
    """A :class:`~lampdist.launch.PortExchange` over a :class:`Board` actor (``board``, its
    handle) rather than torchrun's store: the root publishes the port it listens on, the
    followers (and a follower's replacement) read it there. ``host`` and ``key`` only name
    it in messages; ``port`` is unused."""

    board: Any

    def publish(
        self, control_port: int, *, rank: int = 0, check_cancelled: Callable[[], None] = _never
    ) -> None:
        ray = import_ray()
        check_cancelled()
        try:
            ray.get(self.board.publish.remote(control_port), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise self._expired(rank, "publish the control port") from None

    def lookup(self, *, rank: int, check_cancelled: Callable[[], None] = _never) -> int:
        ray = import_ray()
        deadline = time.monotonic() + self.timeout
        while True:
            check_cancelled()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._expired(rank, "read the root's control port")
            try:
                port = ray.get(self.board.lookup.remote(), timeout=remaining)
            except ray.exceptions.GetTimeoutError:
                continue
            if port is not None:
                return int(port)
            time.sleep(POLL_INTERVAL)

    def _expired(self, rank: int, what: str) -> JoinTimeout:
        return JoinTimeout(
            f"could not {what} through lampdist.ray's board ({self.key}) within "
            f"{self.timeout} s: is rank 0's actor running?",
            rank=rank,
            phase="launch",
        )


@attrs.frozen(kw_only=True)
class RankSpec:
    """What the driver hands one rank's actor: its place, the root's address,
    the attempt's secret (never in ``repr``), the board and the device kind."""

    rank: int
    nranks: int
    host: str
    secret: str = attrs.field(repr=False)
    board: Any
    attempt: int
    cuda: bool
    join_timeout: float

    def launch_env(self) -> LaunchEnv:
        """This rank's :class:`LaunchEnv`: the root listens on a free port and publishes
        it on the board, where the followers read it."""
        exchange = RayPortExchange(
            host=self.host,
            port=0,
            key=f"attempt {self.attempt}",
            timeout=self.join_timeout,
            board=self.board,
        )
        return LaunchEnv(
            rank=self.rank,
            nranks=self.nranks,
            device=torch.device("cuda", 0) if self.cuda else torch.device("cpu"),
            host=self.host,
            port=0,
            secret=self.secret,
            port_exchange=exchange,
        )


class RankActor:
    """One rank's actor: :meth:`run` runs ``main`` (an ``async def main(env)``) in an event
    loop of its own, in the actor's main thread, as a script's ``anyio.run(main)`` would."""

    def node_ip(self) -> str:
        return str(import_ray().util.get_node_ip_address())

    def pid(self) -> int:
        return os.getpid()

    def run(self, main: Callable[[LaunchEnv], Awaitable[T]], spec: RankSpec) -> T:
        """``main(env)`` for this rank, in an event loop of its own; what it returns."""
        env = spec.launch_env()
        noted = spec.board.started.remote(spec.rank, os.getpid())
        start = import_ray().get(noted, timeout=spec.join_timeout)
        context = RunContext(attempt=spec.attempt, start=start, node_ip=self.node_ip())
        token = _CURRENT.set(context)
        logger.info(
            "rank %d of %d: attempt %d, start %d, in process %d",
            spec.rank,
            spec.nranks,
            spec.attempt,
            start,
            os.getpid(),
            extra={"rank": spec.rank},
        )
        try:
            return anyio.run(main, env)
        finally:
            _CURRENT.reset(token)
