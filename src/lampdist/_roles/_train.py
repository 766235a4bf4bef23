"""One entry point for every rank: open the control channel, run this rank's role, stop on a
signal."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar, cast

import anyio
import attrs
from anyio.abc import TaskStatus

from .._early_signals import STOP_SIGNALS, take_early_signals
from .._effects import OptimizerFactory
from .._errors import ConfigError, Interrupted
from .._options import LoopOptions, ModelWithData, StepOptions, Timeouts
from .._preload import preload
from .._state import LoopState
from ..checkpoint import Resumed, load
from ..clique import ProcessGroups
from ..control import FollowerChannel, RootChannel
from ..launch import LaunchEnv, from_env
from ._failures import single_error
from ._follower import follow
from ._rank import RunOptions, check_rank
from ._root import drive
from ._stopping import abandoned_stop

__all__ = [
    "Interrupted",
    "handling_signals",
    "run_this_rank",
    "run_until_signal",
    "train",
    "train_rank",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@attrs.define(eq=False)
class Guard:
    """One stretch of work under the signals (:meth:`_Signals.guarded`): while
    :attr:`starting`, a first signal cancels it at once; once :meth:`ready`, a first signal
    only sets ``stop`` (the work stops in order) and a second cancels it."""

    scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    starting: bool = True

    def ready(self) -> None:
        """The start is over: from now on a first signal stops the work in order."""
        self.starting = False

    @property
    def interrupted(self) -> bool:
        """Whether a signal cancelled the work."""
        return self.scope.cancel_called


@attrs.define(eq=False)
class _Signals:
    """What the signals did: the first sets ``stop`` (a graceful stop) and cancels the
    innermost guarded work that is still starting; a second cancels the innermost guarded
    work whatever it does."""

    rank: int | None = None
    stop: anyio.Event = attrs.field(factory=anyio.Event)
    received: list[int] = attrs.field(factory=list)
    _guards: list[Guard] = attrs.field(factory=list)

    async def watch(self, *, task_status: TaskStatus[None] | None = None) -> None:
        """Handle the signals from the moment this task has started (``await tg.start``)."""
        with anyio.open_signal_receiver(*STOP_SIGNALS) as signals:
            if task_status is not None:
                task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                self.received.append(signum)
                innermost = self._guards[-1] if self._guards else None
                if len(self.received) == 1:
                    logger.warning(
                        "received %s: stopping after the epoch in progress, or at once before "
                        "training (again to stop at once)",
                        name,
                    )
                    self.stop.set()
                    if innermost is not None and innermost.starting:
                        innermost.scope.cancel()
                else:
                    logger.warning("received %s again: stopping at once", name)
                    if innermost is not None:
                        innermost.scope.cancel()

    @contextlib.contextmanager
    def guarded(self) -> Iterator[Guard]:
        """Work that the signals may cancel (see :class:`Guard`); it starts cancelled when
        a signal came before it."""
        guard = Guard()
        self._guards.append(guard)
        try:
            with guard.scope:
                if self.received:
                    guard.scope.cancel()
                yield guard
        finally:
            self._guards.remove(guard)

    def interrupted(self) -> Interrupted:
        """The :class:`Interrupted` of the first signal."""
        return _interrupted(self.received[0], self.rank)


_HANDLING: contextvars.ContextVar[_Signals | None] = contextvars.ContextVar(
    "lampdist_signals", default=None
)
"""The signals handled around the current task, if any: an entry point inside a command that
handles them (the CLI) shares its handling rather than install a second one."""


@contextlib.asynccontextmanager
async def handling_signals(rank: int | None) -> AsyncIterator[_Signals]:
    """SIGTERM and SIGINT handled from now on, until the block ends (the handling around the
    caller, when there is one)."""
    current = _HANDLING.get()
    if current is not None:
        yield current
        return
    signals = _Signals(rank=rank, received=take_early_signals())
    if signals.received:  # before the handling began: acted on at once
        signals.stop.set()
    with single_error():  # the block's error, not a group around it
        async with anyio.create_task_group() as group:
            await group.start(signals.watch)
            logger.debug("rank %s: SIGTERM and SIGINT stop the run from now on", rank)
            token = _HANDLING.set(signals)
            try:
                yield signals
            finally:
                _HANDLING.reset(token)
                group.cancel_scope.cancel()


async def run_until_signal(
    work: Callable[[anyio.Event], Awaitable[T]], *, rank: int | None = None
) -> T:
    """Await ``work(stop)``; the first SIGTERM or SIGINT sets ``stop``, a second one cancels
    ``work``; after either, raise :class:`Interrupted`.

    Give ``stop`` to the entry point as its ``stop``: the run then ends gracefully (the
    epoch in progress finishes and is checkpointed, the followers stop). The signal handlers
    are installed before ``work`` starts and until it ends (call this from the main thread,
    as the signal APIs require). Raises :class:`Interrupted` after a signal once the work has
    ended, returning or abandoned by the stop itself (a :class:`~lampdist.LampdistTimeout` in
    phase ``'stop'``, chained); any other error the work raises is raised as it is, signal or
    not: a failure that came first (a dead follower, then torchrun's SIGTERM) is the run's
    outcome, not the stop.
    """
    return await _run_until_signal(work, rank=rank, done_is_interrupted=True)


async def _run_until_signal(
    work: Callable[[anyio.Event], Awaitable[T]], *, rank: int | None, done_is_interrupted: bool
) -> T:
    """:func:`run_until_signal`; with ``done_is_interrupted=False`` a ``work`` that still
    ends normally after a signal (a follower that the root's STOP ended) returns its result."""

    async def ready_at_once(stop: anyio.Event, guard: Guard) -> T:
        guard.ready()
        return await work(stop)

    async with handling_signals(rank) as signals:
        return await _until_signal(signals, ready_at_once, done_is_interrupted=done_is_interrupted)


async def _until_signal(
    signals: _Signals,
    work: Callable[[anyio.Event, Guard], Awaitable[T]],
    *,
    done_is_interrupted: bool,
) -> T:
    """``work(signals.stop, guard)`` under ``signals`` (see :func:`_run_until_signal`); the
    work calls ``guard.ready()`` once its start is over."""
    results: list[T] = []
    try:
        with signals.guarded() as guard, single_error():
            results.append(await work(signals.stop, guard))
    except Exception as exc:
        if signals.received and abandoned_stop(exc):  # else a failure came first
            raise signals.interrupted() from exc
        raise  # a failure, whatever signal came after it: the failure is the news
    if signals.received and (done_is_interrupted or not results):  # none: cancelled
        raise signals.interrupted()
    if signals.received:
        name = signal.Signals(signals.received[0]).name
        logger.info("rank %s: the root's STOP ended the run after %s", signals.rank, name)
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
    loop: LoopOptions | None = None,
    step: StepOptions = StepOptions(),
    timeouts: Timeouts = Timeouts(),
    resume: Resumed | str | os.PathLike[str] | None = None,
    launch: LaunchEnv | None = None,
    ssl_context: ssl.SSLContext | None = None,
    stop_on_signals: bool = True,
) -> LoopState:
    """Train as this process's rank: the root on rank 0, a follower elsewhere.

    One script, called the same way, serves every rank: no rank branch in user code.
    ``launch`` says where this process stands; by default :func:`lampdist.launch.from_env`
    reads it from torchrun's or srun's variables. The call opens the control channel
    (:meth:`LaunchEnv.open_control`, with ``ssl_context`` for TLS), then runs
    :func:`drive_distributed_training` on rank 0, serving the clique's rendezvous at
    ``launch.host``, or :func:`follow_distributed_training` elsewhere, on ``launch.device``.
    ``loop`` and ``resume`` act on the root only: followers ignore them, so ``loop``'s
    ``on_event`` (a tracker, a progress bar) reports on the root only, and ``loop`` may be
    left out on the followers (the root needs it); give every rank the same model and
    ``step``. ``resume`` is a :class:`~lampdist.checkpoint.Resumed`, or the path or URL of
    one checkpoint (a ``str`` or ``os.PathLike``: ``"runs/a/epoch-000003"``), which the root
    reads with :func:`lampdist.checkpoint.load` on a worker thread before training.

    Returns the final :class:`~lampdist.LoopState` on every rank: the root's own, which it
    sends the followers with its STOP (see :func:`follow_distributed_training`); every
    rank's ``data.model.module`` then holds the same weights (the best model when
    ``loop.return_min_validation_loss_model`` saved one, else the final one).

    With ``stop_on_signals`` (the default; it needs the main thread) the first SIGTERM or
    SIGINT stops the run gracefully: the root finishes the epoch in progress, checkpoints it
    and stops the followers (within ``timeouts.stop``), and a follower follows until that
    STOP; a second signal, or a first one before training began, stops at once. Every
    resource is released; then the root raises :class:`Interrupted`, and so does a follower
    that a second signal (or no STOP within ``timeouts.stop``) stopped, while a follower
    that the root's STOP ended returns the root's final state as after a completed run (the
    root reports the interruption). A failure that the signal did not cause (under torchrun:
    a rank died, and torchrun signals the others) is raised as it is, not as
    :class:`Interrupted`. Raises
    :class:`~lampdist.ConfigError` for bad arguments or launch variables, and every error of
    the role it runs (see :func:`drive_distributed_training` and
    :func:`follow_distributed_training`), an ``ExceptionGroup`` only for several unrelated
    failures; a :class:`~lampdist.ConfigError` naming ``loop`` on the root when it has none.
    """

    def work(env: LaunchEnv, signals: _Signals | None) -> Awaitable[LoopState]:
        args = (data, optimizer_factory, loop, step, timeouts, resume, ssl_context)
        return train_rank(env, *args, signals)

    return await run_this_rank(launch, stop_on_signals, work)


async def resumed(resume: Resumed | str | os.PathLike[str] | None) -> Resumed | None:
    """``resume`` as :func:`train` takes it: a path or URL is read with
    :func:`lampdist.checkpoint.load` on a worker thread (the event loop goes on). Raises
    ConfigError for any other type, and the errors of ``load``."""
    if resume is None or isinstance(resume, Resumed):
        return resume
    if not isinstance(resume, str | os.PathLike):
        raise ConfigError(
            f"resume={type(resume).__name__}: pass a checkpoint.Resumed (load_latest's), "
            "the path or URL of one checkpoint, or None for a new run",
            rank=0,
            phase="configure",
        )
    return await anyio.to_thread.run_sync(load, resume)


async def run_this_rank(
    launch: LaunchEnv | None,
    stop_on_signals: bool,
    work: Callable[[LaunchEnv, _Signals | None], Awaitable[T]],
) -> T:
    """``work(env, signals)`` for this process's rank as :func:`train` runs it: ``launch``
    (or the launcher's variables) checked, and the signals handled from the first instant
    with ``stop_on_signals`` (``None`` without)."""
    env = launch if launch is not None else from_env()

    check_rank(env.rank, env.nranks)
    if not stop_on_signals:
        return await work(env, None)
    # The signals are handled from the first instant: one during the start ends it at once.
    async with handling_signals(env.rank) as signals:
        return await work(env, signals)


async def train_rank(
    env: LaunchEnv,
    data: ModelWithData,
    optimizer_factory: OptimizerFactory,
    loop: LoopOptions | None,
    step: StepOptions,
    timeouts: Timeouts,
    resume: Resumed | str | os.PathLike[str] | None,
    ssl_context: ssl.SSLContext | None,
    signals: _Signals | None,
    *,
    evaluating: bool = False,
) -> LoopState:
    """:func:`train`'s work, with ``signals`` handled when given (``evaluating``: an
    evaluation-only run, see ``drive``)."""
    # A root alone gets the in-process clique of one rank that drive() picks for cliques=None.
    run_options = RunOptions(
        optimizer_factory, step, timeouts, ProcessGroups(env.host) if env.nranks > 1 else None
    )

    async def run_root(control: RootChannel, stop: anyio.Event | None) -> LoopState:
        if loop is None:
            raise ConfigError(
                "lampdist.train needs loop=LoopOptions(max_epochs=...) on rank 0, the root, "
                "which runs the epoch loop: pass the same loop on every rank",
                rank=0,
                phase="configure",
            )
        return await drive(
            env.nranks,
            env.device,
            control,
            data,
            run_options,
            loop,
            chosen,
            stop,
            evaluating=evaluating,
        )

    async def run_follower(control: FollowerChannel, stop: anyio.Event | None) -> LoopState:
        return await follow(env.rank, env.nranks, env.device, control, data, run_options, stop)

    chosen: Resumed | None = None

    async def run(stop: anyio.Event | None, guard: Guard | None) -> LoopState:
        nonlocal chosen
        await preload()
        if env.is_root:  # before the followers join: they wait for nothing while it reads
            chosen = await resumed(resume)
        logger.info(
            "rank %d of %d on %s, root at %s:%s",
            env.rank,
            env.nranks,
            env.device,
            env.host,
            env.port
            or ("a free port given through the launcher's store" if env.port_exchange else 0),
            extra={"rank": env.rank},
        )
        async with env.open_control(ssl_context=ssl_context) as control:
            if guard is not None:  # a first signal now stops the run in order
                guard.ready()
            # open_control gives rank 0 the root's side and every other rank a follower's
            if env.is_root:
                return await run_root(cast(RootChannel, control), stop)
            return await run_follower(cast(FollowerChannel, control), stop)

    if signals is None:
        return await run(None, None)
    # A follower that the root's STOP ended after a signal ended in order: the root reports
    # the interruption (exit codes in docs/reliability.md).
    return await _until_signal(signals, run, done_is_interrupted=env.is_root)
