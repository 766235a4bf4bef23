"""What every tracker shares: the protocol, the global step, the once-only records, and a
base class that opens, buffers, flushes and closes off the event loop."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Literal, Protocol, Self, TypeAlias

import anyio
import anyio.to_thread
import attrs

from .._errors import ConfigError, Interrupted
from .._launched_rank import launched_rank
from .._state import LoopState, PassEvent, Recovered, as_pass_event

__all__ = [
    "FLUSH_INTERVAL",
    "SUMMARY_NAMES",
    "BufferedTracker",
    "HyperparameterValue",
    "Outcome",
    "StepClock",
    "Tracker",
    "check_first_step",
    "event_scalars",
    "flatten_hyperparameters",
    "summary_values",
]

FLUSH_INTERVAL = 5.0
"""Seconds between flushes within a pass; every pass end flushes too."""

SUMMARY_NAMES = (
    "epochs",
    "min_validation_loss",
    "min_validation_epoch",
    "last_epoch",
    "last_training_loss",
    "last_validation_loss",
    "last_smoothed_validation_loss",
)
"""The names :func:`summary_values` may give, in its order."""

HyperparameterValue: TypeAlias = bool | int | float | str
Outcome = Literal["finished", "failed", "killed"]


class Tracker(Protocol):
    """A sink for the root's training events: an :class:`~lampdist.OnPassEvent` effect to
    give as ``LoopOptions(on_event=...)``, and an async context manager that opens the sink
    and closes it (flushed) on success, error and cancellation.

    Inside ``async with``, call :meth:`log_hyperparameters` once before training and
    :meth:`log_summary` once with the final :class:`~lampdist.LoopState`. Only the root
    reports events: lampdist's trackers record on the root only, so one script gives every
    rank the same tracker (see :class:`BufferedTracker`'s ``rank``); a tracker of your own
    that a follower opened would write an empty run.
    """

    async def __aenter__(self) -> Self:
        """Open the sink (in a worker thread).

        :raises ConfigError: the sink's optional package is missing (the message names the
            extra to install), or the tracker was opened before.
        """

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Write what is buffered and close the sink, even when cancelled."""

    async def __call__(self, event: PassEvent | Recovered, /) -> None:
        """Record one of the root's :class:`~lampdist.PassEvent` or
        :class:`~lampdist.Recovered`; the buffer is written at the end of every pass and at
        least every few seconds, in a worker thread.

        :raises ConfigError: the tracker is not open.
        """

    async def log_hyperparameters(self, hyperparameters: Mapping[str, Any], /) -> None:
        """Record the run's hyperparameters, once (nested mappings become ``a/b`` keys;
        values other than bool, int, float and str are written as ``str(value)``).

        :raises ConfigError: the tracker is not open, or they were logged before.
        """

    async def log_summary(self, state: LoopState, /) -> None:
        """Record the final loop state, once, as named values (``None`` ones left out):
        ``epochs`` (epochs run, resumed ones included), ``min_validation_loss``,
        ``min_validation_epoch``, and the learning curve's last point: ``last_epoch``,
        ``last_training_loss``, ``last_validation_loss``, ``last_smoothed_validation_loss``.

        :raises ConfigError: the tracker is not open, or a summary was logged before.
        """

    async def aclose(self) -> None:
        """Write what is buffered and close the sink; closing twice does nothing."""


def flatten_hyperparameters(
    hyperparameters: Mapping[str, Any], prefix: str = ""
) -> dict[str, HyperparameterValue]:
    """``{"optimizer": {"lr": 0.1}, "layers": (4, 2)}`` -> ``{"optimizer/lr": 0.1, "layers":
    "(4, 2)"}``: nested mappings become ``/``-joined keys, and every value other than a
    bool, int, float or str becomes ``str(value)``; every sink takes these values."""
    flat: dict[str, HyperparameterValue] = {}
    for key, value in hyperparameters.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten_hyperparameters(value, f"{name}/")
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def summary_values(state: LoopState) -> dict[str, float]:
    """The summary of a run's final loop state, by name; names whose value is ``None`` are
    left out.

    ``epochs`` (epochs run, resumed ones included), ``min_validation_loss`` and
    ``min_validation_epoch`` (the best model's watched value and epoch, under lamp's names:
    the value of ``LoopOptions.best_model_monitor``, the smoothed validation loss unless it
    watches another), and the learning curve's last point: ``last_epoch``,
    ``last_training_loss``, ``last_validation_loss``, ``last_smoothed_validation_loss``.
    """
    values: dict[str, float | None] = {
        "epochs": state.epoch,
        "min_validation_loss": state.min_validation_loss,
        "min_validation_epoch": state.min_validation_epoch,
    }
    if state.learning_curve:
        last = state.learning_curve[-1]
        values |= {
            "last_epoch": last.epoch,
            "last_training_loss": last.training_loss,
            "last_validation_loss": last.validation_loss,
            "last_smoothed_validation_loss": last.smoothed_validation_loss,
        }
    return {name: value for name, value in values.items() if value is not None}


def event_scalars(event: PassEvent) -> dict[str, float]:
    """The scalars a metrics sink (TensorBoard, MLflow) records for ``event``.

    Every training event: ``train/running_loss`` (the pass's example-weighted mean loss so
    far) and ``train/examples_per_second``; the end of a training pass adds ``train/loss``;
    the end of a validation pass gives ``valid/loss`` and ``valid/examples_per_second``. The
    end of either adds the pass's metrics (:attr:`PassEvent.metrics`) as ``KIND/NAME``, a
    vector-valued one as ``KIND/NAME/INDEX``. A training event adds, where known,
    ``train/tokens_per_second`` and ``train/mfu``; the end of a training pass its gradient
    norm (``train/grad_norm``, ``train/grad_norm_max``) and its step split as seconds per step
    of each part, for the slowest rank (``step/slowest/PART``) and each rank
    (``step/rank_R/PART``). The event that reports an in-job recovery
    (:class:`~lampdist.Recovered`, recorded as a PassEvent whose ``recovered`` holds it)
    gives ``recovery/seconds`` and ``recovery/recoveries``
    instead, and the event of a window of ``LoopOptions.log_every_n_steps`` steps
    (:attr:`PassEvent.window_steps` set) ``train/window_loss``, the mean loss of its steps.
    A validation pass over a named set (:attr:`PassEvent.validation_set`, with
    several validation sets) gives its values as ``valid/<set>/loss``,
    ``valid/<set>/examples_per_second`` and ``valid/<set>/NAME``.
    """
    scalars: dict[str, float] = {}
    if event.recovered is not None:
        return {
            "recovery/seconds": event.recovered.seconds,
            "recovery/recoveries": float(event.recovered.recoveries),
        }
    if event.window_steps is not None:  # LoopOptions.log_every_n_steps: the window's mean
        return {"train/window_loss": event.loss}
    if event.kind == "train":
        scalars = {
            "train/running_loss": event.loss,
            "train/examples_per_second": event.examples_per_second,
        }
        if event.tokens_per_second is not None:
            scalars["train/tokens_per_second"] = event.tokens_per_second
        if event.mfu is not None:
            scalars["train/mfu"] = event.mfu
        if event.done:
            scalars["train/loss"] = event.loss
            if event.grad_norm is not None and event.grad_norm_max is not None:
                scalars["train/grad_norm"] = event.grad_norm
                scalars["train/grad_norm_max"] = event.grad_norm_max
            slowest = event.slowest
            if slowest is not None:
                for part, seconds in slowest.per_step().items():
                    scalars[f"step/slowest/{part}"] = seconds
                for split in event.step_split:
                    for part, seconds in split.per_step().items():
                        scalars[f"step/rank_{split.rank}/{part}"] = seconds
    elif event.done:
        scalars = {"valid/loss": event.loss, "valid/examples_per_second": event.examples_per_second}
    if event.done:
        for name, value in event.metrics.items():
            if isinstance(value, tuple):
                for index, item in enumerate(value):
                    scalars[f"{event.kind}/{name}/{index}"] = float(item)
            else:
                scalars[f"{event.kind}/{name}"] = float(value)
    if event.validation_set is not None:  # a named set's values: valid/<set>/...
        prefix = f"valid/{event.validation_set}/"
        scalars = {prefix + name.removeprefix("valid/"): value for name, value in scalars.items()}
    return scalars


@attrs.define(eq=False)
class StepClock:
    """The global step: optimizer steps since the run began, across epochs.

    ``first_step`` is the global step before this run's first step: 0 for a new run, the
    steps the earlier runs made for a resumed one. A training event's step is the steps of
    the finished training passes plus its own; a validation event's is the steps so far.
    """

    first_step: int = 0
    _finished: int = attrs.field(default=0, init=False)
    _passes: dict[int, int] = attrs.field(factory=dict, init=False)
    """The steps of each finished training pass, by pass index (a recovery may redo one)."""

    @property
    def step(self) -> int:
        """The global step after the last finished training pass."""
        return self.first_step + self._finished

    def advance(self, event: PassEvent) -> int:
        """The global step of ``event``; a training pass's last event ends its pass. A
        recovery's event takes back the steps of the pass it redoes, if that had ended (of
        every pass from it, when the run went back to a checkpoint)."""
        if event.recovered is not None:
            for index in [i for i in self._passes if i >= event.pass_index]:
                self._finished -= self._passes.pop(index)
            return self.step
        if event.kind != "train":
            return self.step
        step = self.step + event.step
        if event.done:
            self._finished += event.step
            self._passes[event.pass_index] = event.step
        return step


def _outcome(exc: BaseException | None) -> Outcome:
    if exc is None:
        return "finished"
    if isinstance(exc, anyio.get_cancelled_exc_class() | KeyboardInterrupt | Interrupted):
        return "killed"
    return "failed"


def check_first_step(first_step: int) -> None:
    """Raise :class:`~lampdist.ConfigError` unless ``first_step`` is an int >= 0."""
    if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
        raise ConfigError(
            f"first_step must be an int >= 0, got {first_step!r}: pass 0 for a new run",
            phase="configure",
        )


@attrs.define(eq=False)
class BufferedTracker(abc.ABC):
    """A :class:`Tracker` whose subclass records on the event loop (cheap: into a buffer
    or a queue) and does its blocking work in worker threads (open, write, close).

    ``rank`` is this process's rank: ``None`` reads it from the launcher's variables when
    the tracker opens (torchrun's ``RANK``, else SLURM's ``SLURM_PROCID``, as
    :func:`lampdist.launch.from_env` does; 0 in a process no launcher started). On any rank
    but 0 the tracker is inert: opening it opens no file, connection or run, and its events,
    hyperparameters and summary are dropped, so that the same script and the same call serve
    every rank (pass ``rank=env.rank`` for ranks started otherwise).

    Invariant: ``_state`` goes ``new`` -> ``open`` -> ``closed``; events and records are
    taken only while ``open``, and only on the root (``_on_root``). ``_flush_lock`` keeps
    the writes in the order of the records when several tasks flush.
    """

    first_step: int = attrs.field(default=0, kw_only=True)
    rank: int | None = attrs.field(default=None, kw_only=True)
    _state: Literal["new", "open", "closed"] = attrs.field(default="new", init=False)
    _clock: StepClock = attrs.field(init=False)
    _flush_lock: anyio.Lock = attrs.field(factory=anyio.Lock, init=False)
    _flushed_at: float = attrs.field(default=0.0, init=False)
    _logged: set[str] = attrs.field(factory=set, init=False)
    _on_root: bool = attrs.field(default=True, init=False)

    def __attrs_post_init__(self) -> None:
        check_first_step(self.first_step)
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank < 0):
            raise ConfigError(
                f"rank must be an int >= 0 or None, got {self.rank!r}: pass None to read it "
                "from the launcher's variables",
                phase="configure",
            )
        self._clock = StepClock(self.first_step)

    # What a subclass does: ``_open``, the job that ``_take`` returns and ``_close`` run in a
    # worker thread; the ``_record_*`` methods and ``_take`` on the event loop.

    @abc.abstractmethod
    def _open(self) -> None:
        """Import the sink's package and open it (a worker thread)."""

    @abc.abstractmethod
    def _record_event(self, event: PassEvent, global_step: int) -> None:
        """Record ``event`` at ``global_step`` (the event loop: no blocking I/O)."""

    @abc.abstractmethod
    def _record_hyperparameters(self, hyperparameters: dict[str, HyperparameterValue]) -> None:
        """Record the flattened hyperparameters (the event loop)."""

    @abc.abstractmethod
    def _record_summary(self, summary: dict[str, float], global_step: int) -> None:
        """Record the summary's values at ``global_step`` (the event loop)."""

    @abc.abstractmethod
    def _take(self) -> Callable[[], None]:
        """Take what was recorded since the last call; return the job that writes it (a
        worker thread runs the job)."""

    @abc.abstractmethod
    def _close(self, outcome: Outcome) -> None:
        """Release the sink after the last write, whatever the ``outcome`` (a worker
        thread)."""

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise ConfigError(
                f"{type(self).__name__} was opened before: create a new one for each run",
                phase="configure",
            )
        rank = self.rank if self.rank is not None else launched_rank()
        self._on_root = rank == 0
        if self._on_root:
            # Not abandoned on cancellation: a sink opened meanwhile reaches __aexit__ (the
            # body's first await raises the cancellation), which closes it.
            await anyio.to_thread.run_sync(self._open)
        self._flushed_at = time.monotonic()
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._shut(_outcome(exc))

    async def aclose(self) -> None:
        """Write what is buffered and close the sink; closing twice does nothing."""
        await self._shut("finished")

    async def __call__(self, event: PassEvent | Recovered, /) -> None:
        self._check_open("record an event")
        if not self._on_root:
            return
        event = as_pass_event(event)  # a recovery is recorded as it always was
        self._record_event(event, self._clock.advance(event))
        if event.done or time.monotonic() - self._flushed_at >= FLUSH_INTERVAL:
            await self._flush()

    async def log_hyperparameters(self, hyperparameters: Mapping[str, Any], /) -> None:
        """Record the run's hyperparameters, once; see :class:`Tracker`."""
        self._check_once("log_hyperparameters", "log them once, before training")
        if not self._on_root:
            return
        self._record_hyperparameters(flatten_hyperparameters(hyperparameters))
        await self._flush()

    async def log_summary(self, state: LoopState, /) -> None:
        """Record the final loop state, once; see :class:`Tracker`."""
        self._check_once("log_summary", "log it once, with the final LoopState")
        if not self._on_root:
            return
        self._record_summary(summary_values(state), self._clock.step)
        await self._flush()

    def _check_open(self, what: str) -> None:
        if self._state == "open":
            return
        name = type(self).__name__
        if self._state == "new":
            message = f"{name} is not open: use 'async with {name}(...) as tracker' to {what}"
        else:
            message = f"{name} is closed: cannot {what} after its 'async with' block"
        raise ConfigError(message, phase="track")

    def _check_once(self, method: str, advice: str) -> None:
        self._check_open(f"call {method}")
        if method in self._logged:
            raise ConfigError(f"{method} was called twice: {advice}", phase="track")
        self._logged.add(method)

    async def _flush(self) -> None:
        async with self._flush_lock:
            await anyio.to_thread.run_sync(self._take())
            self._flushed_at = time.monotonic()

    async def _shut(self, outcome: Outcome) -> None:
        if self._state != "open" or not self._on_root:
            self._state = "closed"
            return
        self._state = "closed"
        # Shielded without a deadline: a worker thread cannot be interrupted, and leaving
        # it behind would leave the sink open.
        with anyio.CancelScope(shield=True):
            try:
                await self._flush()
            finally:
                await anyio.to_thread.run_sync(self._close, outcome)
