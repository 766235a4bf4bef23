"""One entry point for every rank: open the control channel, run this rank's role, stop on a
signal."""

from __future__ import annotations

import logging
import signal
import ssl
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar, cast

import anyio
import attrs

from .._effects import OptimizerFactory
from .._errors import Interrupted
from .._options import LoopOptions, ModelWithData, StepOptions, Timeouts
from .._preload import preload
from .._state import LoopState
from ..checkpoint import Resumed
from ..clique import ProcessGroups
from ..control import FollowerChannel, RootChannel
from ..launch import LaunchEnv, from_env
from ._failures import single_error
from ._follower import follow
from ._rank import RunOptions, check_rank
from ._root import drive
from ._stopping import abandoned_stop

__all__ = ["Interrupted", "run_until_signal", "train"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a run gracefully."""


@attrs.define(eq=False)
class _Signals:
    """What the signals did: the first sets ``stop`` (a graceful stop), a second cancels."""

    stop: anyio.Event = attrs.field(factory=anyio.Event)
    received: list[int] = attrs.field(factory=list)

    async def watch(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                self.received.append(signum)
                if len(self.received) == 1:
                    logger.warning(
                        "received %s: stopping after the epoch in progress, or at once before "
                        "training (again to stop at once)",
                        name,
                    )
                    self.stop.set()
                else:
                    logger.warning("received %s again: stopping at once", name)
                    scope.cancel()
                    return


async def run_until_signal(
    work: Callable[[anyio.Event], Awaitable[T]], *, rank: int | None = None
) -> T:
    """Await ``work(stop)``; the first SIGTERM or SIGINT sets ``stop``, a second one cancels
    ``work``; after either, raise :class:`Interrupted`.

    Give ``stop`` to the entry point as its ``stop``: the run then ends gracefully (the
    epoch in progress finishes and is checkpointed, the followers stop). The signal handlers
    are installed while ``work`` runs (call this from the main thread, as the signal APIs
    require). Raises :class:`Interrupted` after a signal once the work has ended, returning or
    abandoned by the stop itself (a :class:`~lampdist.LampdistTimeout` in phase ``'stop'``,
    chained); any other error the work raises is raised as it is, signal or not: a failure
    that came first (a dead follower, then torchrun's SIGTERM) is the run's outcome, not the
    stop.
    """
    return await _run_until_signal(work, rank=rank, done_is_interrupted=True)


async def _run_until_signal(
    work: Callable[[anyio.Event], Awaitable[T]], *, rank: int | None, done_is_interrupted: bool
) -> T:
    """:func:`run_until_signal`; with ``done_is_interrupted=False`` a ``work`` that still
    ends normally after a signal (a follower that the root's STOP ended) returns its result."""
    signals = _Signals()
    results: list[T] = []
    try:
        with single_error():  # the error of ``work``, not a group around it
            async with anyio.create_task_group() as group:
                group.start_soon(signals.watch, group.cancel_scope)
                results.append(await work(signals.stop))
                group.cancel_scope.cancel()
    except Exception as exc:
        if signals.received and abandoned_stop(exc):  # else a failure came first
            raise _interrupted(signals.received[0], rank) from exc
        raise  # a failure, whatever signal came after it: the failure is the news
    if signals.received and (done_is_interrupted or not results):  # none: a second signal
        raise _interrupted(signals.received[0], rank)
    if signals.received:
        name = signal.Signals(signals.received[0]).name
        logger.info("rank %s: the root's STOP ended the run after %s", rank, name)
    return results[0]


def _interrupted(signum: int, rank: int | None) -> Interrupted:
    name = signal.Signals(signum).name
    return Interrupted(
        f"stopped by {name}; resume from the last checkpoint",
        signum=signum,
        rank=rank,
        phase="stop",
    )


async def train(
    *,
    data: ModelWithData,
    optimizer_factory: OptimizerFactory,
    loop: LoopOptions,
    step: StepOptions = StepOptions(),
    timeouts: Timeouts = Timeouts(),
    resume: Resumed | None = None,
    launch: LaunchEnv | None = None,
    ssl_context: ssl.SSLContext | None = None,
    stop_on_signals: bool = True,
) -> LoopState | None:
    """Train as this process's rank: the root on rank 0, a follower elsewhere.

    One script serves every rank. ``launch`` says where this process stands; by default
    :func:`lampdist.launch.from_env` reads it from torchrun's or srun's variables. The call
    opens the control channel (:meth:`LaunchEnv.open_control`, with ``ssl_context`` for
    TLS), then runs :func:`drive_distributed_training` on rank 0, serving the clique's
    rendezvous at ``launch.host``, or :func:`follow_distributed_training` elsewhere, on
    ``launch.device``. ``loop`` and ``resume`` act on the root only (followers ignore them);
    give every rank the same model and ``step``.

    Returns the final :class:`~lampdist.LoopState` on the root and ``None`` on the
    followers; every rank's ``data.model.module`` then holds the same weights (the best model
    when ``loop.return_min_validation_loss_model`` saved one, else the final one).

    With ``stop_on_signals`` (the default; it needs the main thread) the first SIGTERM or
    SIGINT stops the run gracefully: the root finishes the epoch in progress, checkpoints it
    and stops the followers (within ``timeouts.stop``), and a follower follows until that
    STOP; a second signal, or a first one before training began, stops at once. Every
    resource is released; then the root raises :class:`Interrupted`, and so does a follower
    that a second signal (or no STOP within ``timeouts.stop``) stopped, while a follower
    that the root's STOP ended returns ``None`` as after a completed run (the root reports
    the interruption). A failure that the signal did not cause (under torchrun: a rank died,
    and torchrun signals the others) is raised as it is, not as :class:`Interrupted`. Raises
    :class:`~lampdist.ConfigError` for bad arguments or launch variables, and every error of
    the role it runs (see :func:`drive_distributed_training` and
    :func:`follow_distributed_training`), an ``ExceptionGroup`` only for several unrelated
    failures.
    """
    env = launch if launch is not None else from_env()

    check_rank(env.rank, env.nranks)
    await preload()
    # A root alone gets the in-process clique of one rank that drive() picks for cliques=None.
    run_options = RunOptions(
        optimizer_factory, step, timeouts, None, ProcessGroups(env.host) if env.nranks > 1 else None
    )

    async def run_root(control: RootChannel, stop: anyio.Event | None) -> LoopState:
        run = attrs.evolve(run_options, stop=stop)
        return await drive(env.nranks, env.device, control, data, run, loop, resume)

    async def run_follower(control: FollowerChannel, stop: anyio.Event | None) -> None:
        run = attrs.evolve(run_options, stop=stop)
        await follow(env.rank, env.nranks, env.device, control, data, run)

    async def run(work: Callable[[anyio.Event | None], Awaitable[T]]) -> T:
        # Only the training stops on a signal, not the channel: the root still tells the
        # followers why it stops.
        # A follower that the root's STOP ended after a signal ended in order: the root
        # reports the interruption (exit codes in docs/reliability.md).
        if stop_on_signals:
            return await _run_until_signal(work, rank=env.rank, done_is_interrupted=env.is_root)
        return await work(None)

    logger.info(
        "rank %d of %d on %s, root at %s:%s",
        env.rank,
        env.nranks,
        env.device,
        env.host,
        env.port or ("a free port given through the launcher's store" if env.port_exchange else 0),
        extra={"rank": env.rank},
    )
    with single_error():
        async with env.open_control(ssl_context=ssl_context) as control:
            # open_control gives rank 0 the root's side and every other rank a follower's
            if env.is_root:
                return await run(partial(run_root, cast(RootChannel, control)))
            await run(partial(run_follower, cast(FollowerChannel, control)))
            return None
