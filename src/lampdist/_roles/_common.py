"""What the root and the followers share: devices, the agreement check, failure reporting."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NoReturn

import anyio
import attrs
import torch

from .._checkpoint import RngStates, restore_rng_states
from .._effects import OptimizerFactory
from .._epoch import FlatParameters, PassRunner, Stepper, check_closure_free, check_elementwise
from .._errors import (
    CheckpointError,
    CliqueTimeout,
    CollectiveFailed,
    ConfigError,
    LampdistError,
    LampdistTimeout,
    PeerDisconnected,
    RankFailed,
)
from .._metric import metric_layout
from .._options import StepOptions, Timeouts
from ..checkpoint import Resumed
from ..clique import Cliques
from ..schedules import LearningRateSchedule, state_from_json, state_to_json
from ._agreement import agree

logger = logging.getLogger(__name__)

__all__ = [
    "CULPRIT_TIMEOUT",
    "DERIVED",
    "OptimizerFactory",
    "PhaseTracker",
    "RunOptions",
    "Stopping",
    "agree_and_sync",
    "check_rank",
    "check_schedule_state",
    "create_flat",
    "create_stepper",
    "describe",
    "find_culprit",
    "most_telling",
    "restore_rng",
    "resumed_schedule_state",
    "single_error",
    "watch_peers",
]

CULPRIT_TIMEOUT = 2.0
"""How long a rank whose collective failed waits for the control channel to name the culprit."""


def create_flat(
    module: torch.nn.Module, device: torch.device, nranks: int, options: StepOptions
) -> FlatParameters:
    """``module``'s flat buffers on ``device`` for a clique of ``nranks``: without gradient
    buffers for a rank alone (it exchanges nothing), laid out in ``nranks`` slices for
    ``step_on="sharded"``."""
    sharded = options.step_on == "sharded" and nranks > 1
    return FlatParameters.create(
        module,
        device,
        gradients=nranks > 1,
        shards=nranks if sharded else 1,
        bucket_cap_mb=options.bucket_cap_mb,
    )


def create_stepper(
    rank: int, optimizer_factory: OptimizerFactory, flat: FlatParameters, options: StepOptions
) -> Stepper:
    """The optimizer of ``optimizer_factory`` over the flat parameters, wrapped to step (over
    the rank's slice when ``flat`` is sharded). Raises :class:`ConfigError` for a factory that
    returns no optimizer, and with ``step_on="sharded"`` (alone too, so that a run's
    configuration fails the same way on any number of ranks) for an optimizer that cannot
    step a slice."""
    optimizer = optimizer_factory(flat.parameters)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "optimizer_factory must return a torch.optim.Optimizer, "
            f"got {type(optimizer).__name__}",
            rank=rank,
            phase="configure",
        )
    check_closure_free(rank, optimizer)
    if options.step_on == "sharded":
        check_elementwise(rank, optimizer)
    return Stepper.create(rank, optimizer, flat, options)


@attrs.frozen
class RunOptions:
    """What every rank of one entry-point call is given besides its place in the run (rank,
    device, channel, data): built once by each entry point and handed down whole, so that a
    setting added here reaches every role. The fields' types differ pairwise, so a
    positional construction that mixes them up is a type error."""

    optimizer_factory: OptimizerFactory | None
    step: StepOptions
    timeouts: Timeouts
    stop: anyio.Event | None
    cliques: Cliques | None


def check_rank(rank: int, nranks: int) -> None:
    """Raise :class:`ConfigError` unless ``0 <= rank < nranks``."""
    if nranks < 1:
        raise ConfigError(f"nranks must be >= 1 (every rank, the root included), got {nranks}")
    if not 0 <= rank < nranks:
        raise ConfigError(f"rank must be in 0..{nranks - 1} for nranks={nranks}, got {rank}")


@attrs.define
class PhaseTracker:
    """A rank's failure-report tracker: where the rank is, which its error messages and
    failure reports name, and what has been said about its failure.

    The rank's driver updates it as the run moves on; the tasks beside the run (the peer
    watch, the stop) read it.
    """

    current: str = "join"
    """The phase the rank is in ("join", "clique setup", "train", ...)."""
    epoch: int = 0
    pass_index: int = 0
    reported: bool = False
    """Whether the rank's failure has already gone to its peers (the root's STOP with the
    error, a follower's report), so that the driver's outer handler does not send it again."""
    cause: LampdistError | None = None
    """A peer's failure that cancelled this rank (the root's watch sets it)."""


def describe(error: BaseException) -> str:
    """``"Type: message"`` of the most telling error in ``error`` (see :func:`single_error`)."""
    leaf = most_telling(error)
    if isinstance(leaf, anyio.get_cancelled_exc_class()):
        return "cancelled"  # the backend's message names internals, not a reason
    return f"{type(leaf).__name__}: {leaf}"


def most_telling(error: BaseException) -> BaseException:
    """``error`` itself, or for an exception group the error :func:`single_error` would raise."""
    if not isinstance(error, BaseExceptionGroup):
        return error
    cancelled = anyio.get_cancelled_exc_class()
    real = [leaf for leaf in _leaves(error) if not isinstance(leaf, cancelled)]
    return _most_telling(real) or error


async def agree_and_sync(
    runner: PassRunner,
    flat: FlatParameters,
    options: StepOptions,
    *,
    validates: bool,
    tracker: PhaseTracker,
    resume: Resumed | None = None,
) -> None:
    """What every rank does, in the same order, once its clique is open: :func:`agree`
    (phase ``'agreement'``), then take the root's parameters and buffers, with
    ``step_on="every_rank"`` its optimizer state (sharded: each rank's slice of the state the
    root resumed from), and its part of the checkpoint the root resumes from (``resume``, the
    root's): its place in its training data and, when the root restores RNG states, its own.

    Raises :class:`MismatchError` as :func:`agree` does, and the clique's errors.
    """
    tracker.current = "agreement"
    metrics = metric_layout(runner.kernel.model.metrics)
    await runner.run(partial(agree, runner.clique, flat, options, validates, metrics))
    await runner.sync_parameters()
    if options.step_on != "root":
        await runner.sync_optimizer_state()
    rank_states = resume.training_state.rank_states if resume is not None else None
    restore_rng = resume is not None and resume.rng_states is not None
    await runner.resume_ranks(rank_states, restore_rng=restore_rng)


async def watch_peers(watch: Callable[[], Awaitable[NoReturn]], tracker: PhaseTracker) -> NoReturn:
    """``watch()`` of a control channel; a peer that vanished is reported in this rank's
    current phase, which says more than the channel's (the kind of the last command)."""
    try:
        await watch()
    except PeerDisconnected as exc:
        raise PeerDisconnected(exc.message, rank=exc.rank, phase=tracker.current) from None


async def find_culprit(
    watch: Callable[[], Awaitable[NoReturn]], tracker: PhaseTracker
) -> LampdistError | None:
    """After a collective failed: the control channel's account of which peer failed, if it
    gives one within :data:`CULPRIT_TIMEOUT` seconds."""
    with anyio.move_on_after(CULPRIT_TIMEOUT):
        try:
            await watch_peers(watch, tracker)
        except (RankFailed, PeerDisconnected) as exc:
            return exc
    return None


DERIVED: tuple[type[BaseException], ...] = (
    RankFailed,
    PeerDisconnected,
    CollectiveFailed,
    CliqueTimeout,
)
"""Errors that report another failure, most telling first."""


@contextmanager
def single_error() -> Iterator[None]:
    """Re-raise an exception group as its most telling error.

    A failure shows up several times: where it happened, as failed collectives elsewhere, and
    as the control channel's report naming the failed rank. This keeps the original error,
    else the report; it raises the group itself only when it holds unrelated errors.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        chosen = most_telling(group)
        if chosen is group:
            raise
        raise chosen from chosen.__cause__


def _most_telling(errors: list[BaseException]) -> BaseException | None:
    """The original error if there is one kind of it (the lowest rank's), else the most telling
    report of a failure elsewhere; ``None`` for several unrelated errors."""
    original = [e for e in errors if not isinstance(e, DERIVED)]
    if original:
        if len({type(e) for e in original}) > 1:
            return None
        return min(original, key=lambda e: getattr(e, "rank", None) or 0)
    for kind in DERIVED:
        for error in errors:
            if isinstance(error, kind):
                return error
    return None


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


BEFORE_TRAINING = frozenset({"join", "clique setup", "agreement"})
"""The phases before the first pass: a stop requested in one of them has nothing to drain."""


@attrs.define(eq=False)
class Stopping:
    """A graceful stop: once ``stop`` is set, the run has ``timeout`` seconds to reach its
    end (the root: the end of the epoch in progress; a follower: the root's STOP), after
    which :meth:`enforce` cancels ``scope`` and the run is abandoned. A stop requested before
    training began (:data:`BEFORE_TRAINING`) abandons the run at once: there is no epoch to
    finish, and a launcher's grace period (torchrun's is 30 s) must not run out on it."""

    stop: anyio.Event | None
    timeout: float | None
    rank: int
    scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    reached: anyio.Event = attrs.field(factory=anyio.Event)
    abandoned: str | None = None
    at_once: bool = False
    """Whether the stop came before training and abandoned the run without waiting."""

    def requested(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    async def enforce(self, tracker: PhaseTracker) -> None:
        """Once stop is set, give the run ``timeout`` seconds to reach its end."""
        assert self.stop is not None
        await self.stop.wait()
        if tracker.current in BEFORE_TRAINING:
            self.abandoned = f"{tracker.current!r}, before training began,"
            self.at_once = True
            logger.info(
                "stop requested in phase %r, before training began: stopping at once",
                tracker.current,
                extra={"rank": self.rank, "epoch": tracker.epoch},
            )
            self.scope.cancel()
            return
        waits_for = "the current epoch" if self.rank == 0 else "the root's STOP"
        logger.info(
            "stop requested in phase %r of epoch %d: %s has %s s to come",
            tracker.current,
            tracker.epoch,
            waits_for,
            self.timeout,
            extra={"rank": self.rank, "epoch": tracker.epoch},
        )
        with anyio.move_on_after(self.timeout):
            await self.reached.wait()
            return
        self.abandoned = f"{tracker.current!r} of epoch {tracker.epoch}"
        logger.warning(
            "Timeouts.stop=%s s passed in phase %s: abandoning it",
            self.timeout,
            self.abandoned,
            extra={"rank": self.rank, "epoch": tracker.epoch},
        )
        self.scope.cancel()

    def timeout_error(self) -> LampdistTimeout:
        if self.at_once:
            return LampdistTimeout(
                f"stop was requested in phase {self.abandoned} so nothing was left to finish: "
                "abandoned it at once",
                rank=self.rank,
                phase="stop",
            )
        return LampdistTimeout(
            f"stop was requested, but phase {self.abandoned} did not end within "
            f"Timeouts.stop={self.timeout} s: abandoned it; resume from the last checkpoint",
            rank=self.rank,
            phase="stop",
        )

    def check_abandoned(self) -> None:
        """Raise the stop timeout if :meth:`enforce` abandoned the run."""
        if self.abandoned is not None:
            raise self.timeout_error()


def resumed_schedule_state(schedule: LearningRateSchedule[Any], resume: Resumed | None) -> Any:
    """The schedule state to resume from, rebuilt against the run's own ``schedule``
    (``None``, the schedule's ``init``, for a new run). Raises :class:`CheckpointError`
    (phase ``'resume'``) when the stored state does not fit ``schedule``."""
    if resume is None:
        return None
    try:
        return state_from_json(schedule, resume.schedule_state)
    except ConfigError as exc:
        raise CheckpointError(
            f"the checkpoint's learning-rate schedule state does not fit this run's schedule: "
            f"{exc.message}",
            rank=0,
            phase="resume",
        ) from exc


def check_schedule_state(schedule: LearningRateSchedule[Any], state: Any, *, epoch: int) -> None:
    """Raise :class:`CheckpointError` unless ``state`` comes back from its JSON form as it is
    (a resumed run rebuilds it so), before it is checkpointed."""
    try:
        data = state_to_json(state)
        back = state_to_json(state_from_json(schedule, data))
    except ConfigError as exc:
        raise CheckpointError(
            f"epoch {epoch}: the learning-rate schedule state {state!r} cannot be checkpointed "
            f"and resumed: {exc.message}",
            rank=0,
            phase="checkpoint",
        ) from exc
    if back != data:
        raise CheckpointError(
            f"epoch {epoch}: the learning-rate schedule state {state!r} would resume as "
            f"{back!r}: give the state types that survive JSON (attrs or dataclass values of "
            "numbers, or plain JSON with finite floats)",
            rank=0,
            phase="checkpoint",
        )


def restore_rng(states: RngStates) -> None:
    """Restore the global RNG states saved with a checkpoint (the root, before it resumes)."""
    restore_rng_states(states)
