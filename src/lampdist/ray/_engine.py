"""The driver's side of :func:`lampdist.ray.run`: the settings, the attempts, and the watch
over one attempt's actors (restarting lost followers, ending the attempt when the root is
lost), with every actor and the placement group released however an attempt ends."""

from __future__ import annotations

import functools
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, TypeVar

import anyio
import anyio.to_thread
import attrs

from .._errors import ConfigError, JoinTimeout, LampdistError, RankFailed
from ..control import DEFAULT_JOIN_TIMEOUT
from ..launch import LaunchEnv
from ._actor import Board, RankActor, RankSpec, import_ray

__all__ = ["STRATEGIES", "RaySettings", "run", "run_sync"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
STRATEGIES: tuple[Strategy, ...] = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Ray's placement strategies: how the ranks' bundles spread over the nodes."""

POLL = 0.5
"""How long one wait for an actor's result lasts before the driver looks again (seconds):
the most a cancellation of the driver waits before the actors are released."""
RELEASE_TIMEOUT = 30.0
"""How long the driver tries to release an attempt's actors and placement group (seconds)."""


def _int_at_least(least: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(
                f"lampdist.ray.run's {attribute.name} must be an int >= {least}, got {value!r}",
                phase="configure",
            )

    return check


def _seconds(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(
            f"lampdist.ray.run's {attribute.name} must be > 0 seconds, got {value!r}",
            phase="configure",
        )


def _amount(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"lampdist.ray.run's {attribute.name} must be a number >= 0, got {value!r}",
            phase="configure",
        )


def _strategy(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in STRATEGIES:
        raise ConfigError(
            f"lampdist.ray.run's strategy must be one of {', '.join(STRATEGIES)} (Ray's "
            f"placement strategies), got {value!r}",
            phase="configure",
        )


@attrs.frozen(kw_only=True)
class RaySettings:
    """:func:`run`'s settings, checked (see :func:`run` for each)."""

    nranks: int = attrs.field(validator=_int_at_least(1))
    cpus_per_rank: float = attrs.field(default=1.0, validator=_amount)
    gpus_per_rank: float = attrs.field(default=0.0, validator=_amount)
    strategy: Strategy = attrs.field(default="PACK", validator=_strategy)
    max_restarts: int = attrs.field(default=3, validator=_int_at_least(0))
    max_failures: int = attrs.field(default=0, validator=_int_at_least(0))
    start_timeout: float = attrs.field(default=300.0, validator=_seconds)
    join_timeout: float = attrs.field(default=DEFAULT_JOIN_TIMEOUT, validator=_seconds)
    finish_timeout: float = attrs.field(default=60.0, validator=_seconds)
    runtime_env: Mapping[str, Any] | None = None

    def __attrs_post_init__(self) -> None:
        if self.cpus_per_rank == 0 and self.gpus_per_rank == 0:
            raise ConfigError(
                "lampdist.ray.run needs resources for each rank: pass cpus_per_rank > 0 or "
                "gpus_per_rank > 0",
                phase="configure",
            )

    def bundle(self) -> dict[str, float]:
        """One rank's bundle of the placement group."""
        bundle = {"CPU": float(self.cpus_per_rank), "GPU": float(self.gpus_per_rank)}
        return {name: amount for name, amount in bundle.items() if amount > 0}


class _AttemptFailed(Exception):
    """An attempt ended by a failure that a new attempt may get past: ``error``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


async def run(
    main: Callable[[LaunchEnv], Awaitable[T]],
    *,
    nranks: int,
    cpus_per_rank: float = 1.0,
    gpus_per_rank: float = 0.0,
    strategy: Strategy = "PACK",
    max_restarts: int = 3,
    max_failures: int = 0,
    start_timeout: float = 300.0,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    finish_timeout: float = 60.0,
    runtime_env: Mapping[str, Any] | None = None,
) -> list[T]:
    """Run ``await main(env)`` on ``nranks`` Ray actors, rank 0 the root; every rank's
    result, in rank order.

    Each rank gets one bundle of a placement group (``cpus_per_rank`` CPUs and
    ``gpus_per_rank`` GPUs, placed by ``strategy``: ``"PACK"``, ``"SPREAD"``,
    ``"STRICT_PACK"`` or ``"STRICT_SPREAD"``) and an actor in it, which runs ``main`` in an
    event loop of its own in its main thread. ``env`` (a :class:`~lampdist.launch.LaunchEnv`)
    names the rank, the root's node address as ``host``, a secret the driver drew for this
    attempt (handed through Ray, never the environment), ``cuda:0`` as the device when
    ``gpus_per_rank > 0`` (Ray gives each actor its GPUs) and the CPU otherwise; the root
    listens on a free port that the followers read through Ray. Pass it on as
    ``lampdist.train(..., launch=env)``. Ray is started (``ray.init()``, which joins the
    cluster of ``ray job submit`` or ``RAY_ADDRESS``) unless it runs already.

    A follower's actor that dies (its process killed, its node lost), or whose ``main``
    raises while the root runs (a stalled process that woke to find itself replaced), is
    started again by Ray in its bundle, up to ``max_restarts`` times, and runs ``main``
    again: with :class:`lampdist.Recovery` on the root it rejoins the run in flight. The
    root's own loss (its actor dies, or its ``main`` raises), or a follower lost more often
    than ``max_restarts``, ends the *attempt*: every actor is killed, and up to
    ``max_failures`` times the job starts again with new actors, a new secret and a new
    port (read :func:`run_context`'s ``attempt`` and resume from the newest checkpoint).
    A :class:`~lampdist.ConfigError` from the root ends the job at once.

    ``start_timeout`` bounds the wait for the placement group's resources and the root's
    actor, ``join_timeout`` a follower's wait for the root's port, ``finish_timeout`` the
    followers' end after the root has returned. ``runtime_env`` is Ray's, for the actors.

    Every actor and the placement group are released when the call returns, raises or is
    cancelled. Raises :class:`~lampdist.ConfigError` for bad arguments, ``ImportError`` when
    Ray is not installed, the root's own error when the last attempt failed with one,
    :class:`~lampdist.RankFailed` naming the rank whose actor was lost beyond its restarts
    (or the root, ``rank 0``, whose actor died), and
    :class:`~lampdist.JoinTimeout` when the resources did not come within ``start_timeout``.
    """
    settings = RaySettings(
        nranks=nranks,
        cpus_per_rank=cpus_per_rank,
        gpus_per_rank=gpus_per_rank,
        strategy=strategy,
        max_restarts=max_restarts,
        max_failures=max_failures,
        start_timeout=start_timeout,
        join_timeout=join_timeout,
        finish_timeout=finish_timeout,
        runtime_env=runtime_env,
    )
    if not callable(main):
        raise ConfigError(
            f"lampdist.ray.run's main must be an async function of a LaunchEnv, got {main!r}",
            phase="configure",
        )
    ray = import_ray()
    if not ray.is_initialized():
        await anyio.to_thread.run_sync(ray.init)
    attempt = 0
    while True:
        try:
            return await _Attempt(settings, attempt).run(main)
        except _AttemptFailed as failed:
            if attempt >= settings.max_failures:
                raise failed.error from None
            logger.warning(
                "attempt %d of the job failed: %s; starting it again (failure %d of %d that "
                "max_failures allows)",
                attempt,
                failed.error,
                attempt + 1,
                settings.max_failures,
            )
            attempt += 1


def run_sync(main: Callable[[LaunchEnv], Awaitable[T]], **options: Any) -> list[T]:
    """:func:`run` from synchronous code (a script, ``ray job submit -- python train.py``):
    the same arguments, in an event loop of its own."""
    return anyio.run(functools.partial(run, main, **options))


@attrs.define(eq=False)
class _Attempt:
    """One start of the job: its placement group, actors and board, watched to the end."""

    settings: RaySettings
    attempt: int
    ray: Any = attrs.field(factory=import_ray)
    group: Any = None
    board: Any = None
    actors: list[Any] = attrs.field(factory=list)
    kills: list[int] = attrs.field(factory=list)
    """How often the driver restarted each rank's actor (its main raised)."""
    host: str = ""
    secret: str = attrs.field(factory=lambda: secrets.token_hex(16), repr=False)

    async def run(self, main: Callable[[LaunchEnv], Awaitable[T]]) -> list[T]:
        try:
            await self.start()
            return await self.watch(self.ray.put(main))
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
                await anyio.to_thread.run_sync(self.release)

    async def start(self) -> None:
        """The placement group (within ``start_timeout``), the board and the actors; the
        root's node address."""
        ray, settings = self.ray, self.settings
        from ray.util.placement_group import placement_group

        self.group = placement_group([settings.bundle()] * settings.nranks, settings.strategy)
        await self.get(self.group.ready(), "the placement group's resources", rank=None)
        self.board = ray.remote(Board).options(num_cpus=0).remote()
        self.actors = [self.new_actor(rank) for rank in range(settings.nranks)]
        self.kills = [0] * settings.nranks
        self.host = await self.get(self.actors[0].node_ip.remote(), "the root's actor", rank=0)
        logger.info(
            "attempt %d: %d ranks placed (%s), the root on %s",
            self.attempt,
            settings.nranks,
            settings.strategy,
            self.host,
        )

    def new_actor(self, rank: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        settings = self.settings
        options: dict[str, Any] = {
            "num_cpus": settings.cpus_per_rank,
            "num_gpus": settings.gpus_per_rank,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=rank
            ),
            "max_restarts": 0 if rank == 0 else settings.max_restarts,
            # a follower's run goes on in its restarted actor: Ray calls it again
            "max_task_retries": 0 if rank == 0 else -1,
        }
        if settings.runtime_env is not None:
            options["runtime_env"] = dict(settings.runtime_env)
        return self.ray.remote(RankActor).options(**options).remote()

    async def get(self, ref: Any, what: str, *, rank: int | None) -> Any:
        """``ref``'s value within ``start_timeout``; a JoinTimeout naming ``what``."""
        with anyio.move_on_after(self.settings.start_timeout):
            while True:
                ready, _ = await anyio.to_thread.run_sync(
                    lambda: self.ray.wait([ref], timeout=POLL)
                )
                if ready:
                    return await anyio.to_thread.run_sync(self.ray.get, ref)
        raise JoinTimeout(
            f"lampdist.ray: {what} did not come within start_timeout="
            f"{self.settings.start_timeout} s (attempt {self.attempt}): does the cluster have "
            f"{self.settings.nranks} bundles of {self.settings.bundle()} for strategy "
            f"{self.settings.strategy!r}?",
            rank=rank,
            phase="launch",
        )

    def submit(self, main_ref: Any, rank: int) -> Any:
        spec = RankSpec(
            rank=rank,
            nranks=self.settings.nranks,
            host=self.host,
            secret=self.secret,
            board=self.board,
            attempt=self.attempt,
            cuda=self.settings.gpus_per_rank > 0,
            join_timeout=self.settings.join_timeout,
        )
        return self.actors[rank].run.remote(main_ref, spec)

    async def watch(self, main_ref: Any) -> list[T]:
        """Every rank's result, restarting lost followers (see :func:`run`)."""
        pending = {self.submit(main_ref, rank): rank for rank in range(self.settings.nranks)}
        results: dict[int, T] = {}
        root_done: float | None = None
        while pending:
            wait = functools.partial(self.ray.wait, list(pending), num_returns=1, timeout=POLL)
            ready, _ = await anyio.to_thread.run_sync(wait)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = await anyio.to_thread.run_sync(self.ray.get, ref)
                except self.ray.exceptions.RayActorError as died:
                    self.lost(rank, died, None, root_done)
                except self.ray.exceptions.RayTaskError as failed:
                    self.lost(rank, failed, _cause(failed), root_done)
                    self.ray.kill(self.actors[rank], no_restart=False)
                    pending[self.submit(main_ref, rank)] = rank
                else:
                    if rank == 0:
                        root_done = time.monotonic()
            if root_done is not None and pending and self.late(root_done):
                ranks = sorted(pending.values())
                raise RankFailed(
                    f"rank(s) {ranks} did not end within finish_timeout="
                    f"{self.settings.finish_timeout} s after the root had finished",
                    rank=ranks[0],
                    phase="stop",
                )
        return [results[rank] for rank in range(self.settings.nranks)]

    def late(self, root_done: float) -> bool:
        return time.monotonic() - root_done > self.settings.finish_timeout

    def lost(
        self,
        rank: int,
        failure: BaseException,
        error: BaseException | None,
        root_done: float | None,
    ) -> None:
        """Rank ``rank``'s actor died for good (``error`` None: Ray restarts a follower's
        actor and calls its ``run`` again by itself, up to ``max_restarts`` times) or its
        ``main`` raised ``error``: raise what ends the attempt or the job, else count the
        follower's restart, which the caller makes."""
        if rank == 0 and error is None:
            raise _AttemptFailed(
                _chained(
                    RankFailed(f"the root's actor died: {_first_line(failure)}", rank=0), failure
                )
            )
        if rank == 0:
            assert error is not None
            if isinstance(error, ConfigError):
                raise error
            raise _AttemptFailed(error)
        if root_done is not None:
            raise _chained(
                RankFailed(f"failed after the root had finished: {error or failure}", rank=rank),
                failure,
            )
        if error is None:
            raise _AttemptFailed(
                _chained(
                    RankFailed(
                        f"its actor was lost after max_restarts={self.settings.max_restarts} "
                        f"restarts: {_first_line(failure)}",
                        rank=rank,
                        phase="recover",
                    ),
                    failure,
                )
            )
        self.kills[rank] += 1
        if self.kills[rank] > self.settings.max_restarts:
            raise _AttemptFailed(
                _chained(
                    RankFailed(
                        f"its main failed {self.kills[rank]} times, more than max_restarts="
                        f"{self.settings.max_restarts} allows: {error}",
                        rank=rank,
                        phase="recover",
                    ),
                    failure,
                )
            )
        logger.warning(
            "rank %d's main failed while the root runs: %s; starting its actor again",
            rank,
            error,
            extra={"rank": rank},
        )

    def release(self) -> None:
        """Kill every actor of the attempt and remove its placement group (best effort)."""
        for actor in [*self.actors, self.board]:
            if actor is not None:
                try:
                    self.ray.kill(actor, no_restart=True)
                except Exception as exc:  # already gone
                    logger.debug("lampdist.ray: could not kill an actor: %s", exc)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception as exc:
                logger.debug("lampdist.ray: could not remove the placement group: %s", exc)


def _cause(failure: BaseException) -> BaseException:
    """The exception a rank's ``main`` raised, out of Ray's wrapper."""
    cause = getattr(failure, "cause", None)
    return cause if isinstance(cause, BaseException) else failure


def _first_line(failure: BaseException) -> str:
    """The first line of Ray's message (the rest is its advice on dead workers)."""
    return str(failure).strip().split("\n", 1)[0]


def _chained(error: LampdistError, cause: BaseException) -> LampdistError:
    error.__cause__ = cause
    return error
