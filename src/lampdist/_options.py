"""What the entry points take: option objects that travel together.

Every entry point takes the same objects, so a setting declared once reaches every role:

- :class:`StepOptions`: how every rank steps (what all ranks must agree on; checked at join);
- :class:`LoopOptions`: the root's epoch loop (lamp's names: ``max_epochs``,
  ``validation_frequency``, the schedule, smoothing, the best-model epochs, the checkpoint
  effect), what the best model and early stopping watch, and its progress effect;
- :class:`Timeouts`: the deadlines of joining, clique setup, each collective and a stop;
- :class:`ModelWithData`: one rank's model and batch sources.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import attrs
import torch

from ._defaults import COLLECTIVE_TIMEOUT, JOIN_TIMEOUT, SETUP_TIMEOUT, STOP_TIMEOUT
from ._effects import BatchSource, CheckpointState, OnPassEvent, PassAwareBatchSource
from ._errors import ConfigError
from ._loop import check_epochs_arguments
from ._model import SupervisedModel
from ._monitor import LOSSES, EarlyStopping, Monitor
from ._source import check_source
from ._state import LoopState
from .schedules import LearningRateSchedule, StepSchedule, noop

__all__ = [
    "LoopOptions",
    "ModelWithData",
    "StepOn",
    "StepOptions",
    "Timeouts",
    "check_monitors",
]

StepOn = Literal["root", "every_rank", "sharded"]


@attrs.frozen(kw_only=True)
class StepOptions:
    """How every rank steps; all ranks must pass equal ones (checked when they join).

    ``step_on="root"`` (lamp's design) keeps the optimizer on the root: gradients are reduced
    to it and the parameters broadcast back. ``step_on="every_rank"`` all-reduces the
    gradients and every rank steps its own optimizer (followers need ``optimizer_factory``
    too): one collective a step instead of two, the same updates. ``step_on="sharded"``
    reduce-scatters the gradients, so that each rank steps only the slice of the parameters it
    owns with ``1/n`` of the optimizer state, and all-gathers the parameters (followers need
    ``optimizer_factory`` too, and the optimizer must treat each element on its own: SGD,
    Adam, AdamW, Adagrad, RMSprop and the like; others raise
    :class:`~lampdist.ConfigError`); checkpoints still hold the whole optimizer state. Under
    every design lampdist runs the forward and backward passes and calls ``step()`` itself, so
    an optimizer whose ``step`` needs a closure (``LBFGS``) raises
    :class:`~lampdist.ConfigError` when it is built.
    ``accumulate_gradient_over_n_batches`` batches make one step. ``bucket_cap_mb`` cuts the
    gradients into buckets of about that many megabytes whose exchange starts while backward
    still runs (``None``: one exchange per flat buffer after backward). ``max_grad_norm``
    clips the averaged gradients by their global norm; ``non_finite_loss`` says what a step
    whose summed loss is not finite does (``"raise"`` :class:`~lampdist.NonFiniteLoss`, or
    ``"skip"`` the step with a warning; either names the ranks whose own loss was not finite,
    on CUDA only where every rank reads the step's loss at once: see docs/reliability.md).
    ``autocast_dtype`` runs forward passes under ``torch.autocast`` (bfloat16, or float16
    with dynamic loss scaling). ``shuffle_seed`` seeds the
    :class:`~lampdist.PassContext` of every pass, which a batch source that shuffles draws its
    order from (each rank, epoch and kind of pass gets its own seed).

    ``steps_per_epoch`` makes each epoch a window of that many optimizer steps over the
    training data instead of one pass over it: every rank reads its training source as one
    stream across epochs, calling it again for its next pass over the data when it runs out
    (the source's :class:`~lampdist.PassContext` then counts those passes in ``epoch``), so
    validation, checkpoints, the schedule and the best model come every N steps under lamp's
    rules. Checkpoints then hold each rank's place in its data (the source's
    ``state_dict()`` when it has one, as torchdata's ``StatefulDataLoader`` does, else the
    batches to skip), and a resumed run goes on with the next batch.
    ``learning_rate_per_step`` (needs ``steps_per_epoch``) multiplies the learning rate of
    each step by a :class:`~lampdist.schedules.StepSchedule` of the global step.

    Raises :class:`~lampdist.ConfigError` for values out of range.
    """

    accumulate_gradient_over_n_batches: int = 1
    autocast_dtype: torch.dtype | None = None
    step_on: StepOn = "root"
    bucket_cap_mb: float | None = None
    max_grad_norm: float | None = None
    non_finite_loss: Literal["raise", "skip"] = "raise"
    shuffle_seed: int = 0
    steps_per_epoch: int | None = None
    learning_rate_per_step: StepSchedule | None = None

    def __attrs_post_init__(self) -> None:
        accumulate = self.accumulate_gradient_over_n_batches
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ConfigError(
                f"accumulate_gradient_over_n_batches must be an int >= 1, got {accumulate!r}: "
                "pass 1 to step after every batch",
                phase="configure",
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(
                f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}", phase="configure"
            )
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ConfigError(
                "autocast_dtype must be torch.bfloat16, torch.float16 or None, "
                f"got {self.autocast_dtype}",
                phase="configure",
            )
        if self.non_finite_loss not in ("raise", "skip"):
            raise ConfigError(
                f"non_finite_loss must be 'raise' or 'skip', got {self.non_finite_loss!r}",
                phase="configure",
            )
        cap = self.bucket_cap_mb
        if cap is not None and (
            isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0
        ):
            raise ConfigError(
                f"bucket_cap_mb must be > 0 megabytes or None, got {cap!r}: pass None to "
                "exchange the gradients after backward",
                phase="configure",
            )
        seed = self.shuffle_seed
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"shuffle_seed must be an int, got {seed!r}", phase="configure")
        steps = self.steps_per_epoch
        if steps is not None and (
            isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
        ):
            raise ConfigError(
                f"steps_per_epoch must be an int >= 1 or None (an epoch is a pass over the "
                f"data), got {steps!r}",
                phase="configure",
            )
        per_step = self.learning_rate_per_step
        if per_step is not None:
            if not callable(getattr(per_step, "factor", None)):
                raise ConfigError(
                    "learning_rate_per_step must be a schedules.StepSchedule (e.g. "
                    f"schedules.warmup_cosine_steps(...)), got {per_step!r}",
                    phase="configure",
                )
            if steps is None:
                raise ConfigError(
                    "learning_rate_per_step needs steps_per_epoch: the global step of a "
                    "step is epoch * steps_per_epoch + the step in the epoch",
                    phase="configure",
                )
        if self.step_on not in ("root", "every_rank", "sharded"):
            raise ConfigError(
                f"step_on must be 'root', 'every_rank' or 'sharded', got {self.step_on!r}",
                phase="configure",
            )

    def agreed_fields(self) -> list[tuple[str, str]]:
        """Every field as (name, repr of its value): what ranks compare when they join."""
        return [(f.name, repr(getattr(self, f.name))) for f in attrs.fields(StepOptions)]


def _epoch_set(value: Iterable[int]) -> frozenset[int]:
    return frozenset(value)


@attrs.frozen(kw_only=True)
class LoopOptions:
    """The root's epoch loop; followers ignore it.

    Epochs run up to ``max_epochs``; epoch ``e`` is validated when ``e %
    validation_frequency == 0``, and the validation loss is smoothed exponentially with
    ``validation_loss_exponential_smoothing_factor`` (1.0: no smoothing).
    ``learning_rate_schedule`` sets each epoch's learning-rate factor (see
    :mod:`lampdist.schedules`). With ``return_min_validation_loss_model`` (a set of epochs),
    the model of the epoch with the lowest smoothed validation loss among them is kept, and
    every rank ends holding it; ``best_model_monitor`` chooses it by another value instead
    (``lampdist.Monitor("validation_accuracy", mode="max")``). ``early_stopping`` ends the
    loop once a watched value stops improving (:class:`~lampdist.EarlyStopping`).
    ``checkpoint_state`` is awaited after every epoch
    (:func:`lampdist.checkpoint.to_directory` builds one), or with ``checkpoint_interval``
    (seconds of wall time: for preemptible jobs with short epochs) after the first epoch that
    ends that long after the last checkpoint, and always after the last epoch trained,
    whatever ends the loop; ``on_event`` receives the root's
    progress (:class:`~lampdist.PassEvent`). The rules are :func:`lampdist.epochs`'.

    Raises :class:`~lampdist.ConfigError` for values out of range, and for
    ``checkpoint_interval`` without ``checkpoint_state``.
    """

    max_epochs: int
    validation_frequency: int = 1
    validation_loss_exponential_smoothing_factor: float = 1.0
    learning_rate_schedule: LearningRateSchedule[Any] = attrs.field(factory=noop)
    return_min_validation_loss_model: frozenset[int] = attrs.field(
        default=frozenset(), converter=_epoch_set
    )
    checkpoint_state: CheckpointState | None = None
    checkpoint_interval: float | None = None
    on_event: OnPassEvent | None = None
    best_model_monitor: Monitor = attrs.field(factory=Monitor)
    early_stopping: EarlyStopping | None = None

    def __attrs_post_init__(self) -> None:
        interval = self.checkpoint_interval
        if interval is not None and (
            isinstance(interval, bool) or not isinstance(interval, int | float) or not interval > 0
        ):
            raise ConfigError(
                f"checkpoint_interval must be > 0 seconds or None (every epoch), got {interval!r}",
                phase="configure",
            )
        if interval is not None and self.checkpoint_state is None:
            raise ConfigError(
                "checkpoint_interval says how often to checkpoint, but there is no "
                "checkpoint_state to checkpoint with: give both (checkpoint.to_directory(...))",
                phase="configure",
            )
        check_epochs_arguments(
            self.max_epochs,
            self.validation_frequency,
            self.validation_loss_exponential_smoothing_factor,
            LoopState(),
        )
        if not isinstance(self.best_model_monitor, Monitor):
            raise ConfigError(
                f"best_model_monitor must be a lampdist.Monitor, got {self.best_model_monitor!r}",
                phase="configure",
            )
        if self.early_stopping is not None and not isinstance(self.early_stopping, EarlyStopping):
            raise ConfigError(
                f"early_stopping must be a lampdist.EarlyStopping or None, "
                f"got {self.early_stopping!r}",
                phase="configure",
            )

    def _monitors(self) -> list[tuple[str, Monitor]]:
        """What the loop's rules watch, as (the rule, its monitor): the best model when
        ``return_min_validation_loss_model`` names epochs, early stopping, and the schedule
        when it has a ``monitor``."""
        found = []
        if self.return_min_validation_loss_model:
            found.append(("best_model_monitor", self.best_model_monitor))
        if self.early_stopping is not None:
            found.append(("early_stopping", self.early_stopping.monitor))
        schedule_monitor = getattr(self.learning_rate_schedule, "monitor", None)
        if isinstance(schedule_monitor, Monitor):
            found.append(("learning_rate_schedule", schedule_monitor))
        return found


def _seconds(name: str, *, zero: bool = False) -> Callable[[object, object, object], None]:
    def check(_: object, __: object, value: object) -> None:
        if value is None:
            return
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (value >= 0 if zero else value > 0)
        ):
            bound = ">= 0" if zero else "> 0"
            raise ConfigError(
                f"Timeouts.{name} must be {bound} seconds or None (no limit), got {value!r}",
                phase="configure",
            )

    return check


@attrs.frozen(kw_only=True)
class Timeouts:
    """The deadlines of a run, in seconds (``None``: no limit).

    ``join``: for the followers to join the root (and a follower to reach it); ``setup``: for
    every rank to open the clique; ``collective``: for each collective, counted from its
    start; ``stop``: once a stop is requested, for the epoch in progress to end and be
    checkpointed (keep it below your scheduler's grace period). Raises
    :class:`~lampdist.ConfigError` for a negative or zero value (``stop`` may be 0).
    """

    join: float | None = attrs.field(default=JOIN_TIMEOUT, validator=_seconds("join"))
    setup: float | None = attrs.field(default=SETUP_TIMEOUT, validator=_seconds("setup"))
    collective: float | None = attrs.field(
        default=COLLECTIVE_TIMEOUT, validator=_seconds("collective")
    )
    stop: float | None = attrs.field(default=STOP_TIMEOUT, validator=_seconds("stop", zero=True))


def check_monitors(loop: LoopOptions, data: ModelWithData, *, rank: int = 0) -> None:
    """Raise :class:`ConfigError` before training when a rule of ``loop`` watches a metric
    that ``data.model`` does not report, or a validation value of a run that does not
    validate (except lamp's defaults: without validation the best model and a plateau
    watching the smoothed validation loss never act, as in lamp)."""
    names = set(data.model.metrics)
    for rule, monitor in loop._monitors():
        metric = monitor.metric
        kind, _, name = metric.partition("_")
        if rule != "early_stopping" and monitor == Monitor():
            continue  # lamp's value: nothing to check, and without validation it never comes
        if monitor.validation and data.validation_batches is None:
            raise ConfigError(
                f"LoopOptions.{rule} watches {metric!r}, but there are no validation_batches: "
                "give validation batches or watch a training value",
                rank=rank,
                phase="configure",
            )
        if metric in LOSSES:
            continue
        if name not in names:
            known = ", ".join(f"{kind}_{n}" for n in sorted(names)) or "none"
            raise ConfigError(
                f"LoopOptions.{rule} watches {metric!r}, which is no metric of the model "
                f"(its metrics as {kind} values: {known}); add it to SupervisedModel.metrics",
                rank=rank,
                phase="configure",
            )


@attrs.frozen(kw_only=True)
class ModelWithData:
    """One rank's model and its batch sources (an entry of lamp's
    ``models_with_data_streams``): the training batches, and the validation batches when the
    run validates (every rank, or none). A source takes no argument, or one: the pass's
    :class:`~lampdist.PassContext` (see :class:`~lampdist.PassAwareBatchSource`).

    Raises :class:`~lampdist.ConfigError` for a source that is not callable or needs more
    than one argument.
    """

    model: SupervisedModel
    train_batches: BatchSource | PassAwareBatchSource
    validation_batches: BatchSource | PassAwareBatchSource | None = None

    def __attrs_post_init__(self) -> None:
        check_source(self.train_batches, "train_batches")
        if self.validation_batches is not None:
            check_source(self.validation_batches, "validation_batches")
