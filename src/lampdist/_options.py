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

import numbers
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeGuard

import attrs
import torch

from ._defaults import COLLECTIVE_TIMEOUT, JOIN_TIMEOUT, SETUP_TIMEOUT, STOP_TIMEOUT
from ._effects import BatchSource, CheckpointState, OnPassEvent, PassAwareBatchSource
from ._errors import ConfigError
from ._fsdp_options import FsdpPolicy
from ._loop import check_max_epochs, check_smoothing, check_validation_frequency
from ._model import SupervisedModel
from ._monitor import LOSSES, EarlyStopping, Monitor
from ._source import check_source
from .schedules import LearningRateSchedule, StepSchedule, noop

__all__ = [
    "LoopOptions",
    "ModelWithData",
    "StepOn",
    "StepOptions",
    "Timeouts",
    "check_monitors",
]

StepOn = Literal["root", "every_rank", "sharded", "fsdp"]

_Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _check(rule: Callable[[Any], bool], wants: str, instead: str) -> _Validator:
    """A validator that refuses a value for which ``rule`` is false with a
    :class:`ConfigError` (phase ``'configure'``): the field must be ``wants``; ``instead``
    says what to pass."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not rule(value):
            raise ConfigError(
                f"{type(instance).__name__}.{attribute.name} must be {wants}, got {value!r}: "
                f"{instead}",
                phase="configure",
            )

    return validate


def _by(check: Callable[[object, str], None]) -> _Validator:
    """A validator from a check that names the value it refuses (shared with
    :func:`lampdist.epochs`, which takes the same arguments)."""

    def validate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check(value, f"{type(instance).__name__}.{attribute.name}")

    return validate


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    """A number (not a bool) > 0; NaN is not."""
    return _is_number(value) and value > 0


def _optional(rule: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or rule(value)


def _is_step_schedule(value: object) -> bool:
    return callable(getattr(value, "factor", None))


def _is_epoch_schedule(value: object) -> bool:
    return callable(getattr(value, "learning_rate_factor", None))


@attrs.frozen(kw_only=True)
class StepOptions:
    """How every rank steps; all ranks must pass equal ones (checked when they join).

    ``step_on`` chooses the design: where the optimizer steps and how the gradients travel.
    Under every design lampdist runs the forward and backward passes and calls ``step()``
    itself, so an optimizer whose ``step`` needs a closure (``LBFGS``) raises
    :class:`~lampdist.ConfigError` when it is built.

    ``steps_per_epoch`` makes each epoch a window of that many optimizer steps over the
    training data instead of one pass over it: every rank reads its training source as one
    stream across epochs, calling it again for its next pass over the data when it runs out
    (the source's :class:`~lampdist.PassContext` then counts those passes in ``epoch``), so
    validation, checkpoints, the schedule and the best model come every N steps under lamp's
    rules. Checkpoints then hold each rank's place in its data (the source's
    ``state_dict()`` when it has one, as torchdata's ``StatefulDataLoader`` does, else the
    batches to skip), and a resumed run goes on with the next batch.

    Raises :class:`~lampdist.ConfigError` (phase ``'configure'``, naming the field) for a
    value out of range, and for ``learning_rate_per_step`` without ``steps_per_epoch``.
    """

    accumulate_gradient_over_n_batches: int = attrs.field(
        default=1,
        validator=_check(
            lambda value: _is_int(value) and value >= 1,
            "an int >= 1",
            "pass 1 to step after every batch",
        ),
    )
    """How many batches make one step (an int >= 1): their gradients add up before it."""
    autocast_dtype: torch.dtype | None = attrs.field(
        default=None,
        validator=_check(
            lambda value: value in (None, torch.bfloat16, torch.float16),
            "torch.bfloat16, torch.float16 or None",
            "pass None to run the forward passes in the parameters' dtype",
        ),
    )
    """Run forward passes under ``torch.autocast`` in this dtype: ``torch.bfloat16``, or
    ``torch.float16`` with dynamic loss scaling (``None``: no autocast)."""
    step_on: StepOn = attrs.field(
        default="root",
        validator=_check(
            lambda value: value in ("root", "every_rank", "sharded", "fsdp"),
            "'root', 'every_rank', 'sharded' or 'fsdp'",
            "pass 'root' to step on the root alone (lamp's design)",
        ),
    )
    """Where the optimizer steps. ``"root"`` (lamp's design) keeps the optimizer on the root:
    gradients are reduced to it and the parameters broadcast back. ``"every_rank"``
    all-reduces the gradients and every rank steps its own optimizer (followers need
    ``optimizer_factory`` too): one collective a step instead of two, the same updates.
    ``"sharded"`` reduce-scatters the gradients, so that each rank steps only the slice of the
    parameters it owns with ``1/n`` of the optimizer state, and all-gathers the parameters
    (followers need ``optimizer_factory`` too, and the optimizer must treat each element on
    its own: SGD, Adam, AdamW, Adagrad, RMSprop and the like; others raise
    :class:`~lampdist.ConfigError`); checkpoints still hold the whole optimizer state.
    ``"fsdp"`` shards the model itself with FSDP2 (``fully_shard``, as ``fsdp`` says), so that
    parameters, gradients and optimizer state are each ``1/n`` per rank and a model bigger
    than one device trains (one rank per process; see docs/howto-big-models.md)."""
    bucket_cap_mb: float | None = attrs.field(
        default=None,
        validator=_check(
            _optional(_positive),
            "> 0 megabytes or None",
            "pass None to exchange the gradients after backward",
        ),
    )
    """Cut the gradients into buckets of about this many megabytes whose exchange starts while
    backward still runs (``None``: one exchange per flat buffer after backward)."""
    max_grad_norm: float | None = attrs.field(
        default=None,
        validator=_check(
            _optional(lambda value: isinstance(value, numbers.Real) and float(value) > 0),
            "a number > 0 or None",
            "pass None not to clip",
        ),
    )
    """Clip the averaged gradients by their global norm to at most this (``None``: no
    clipping)."""
    grad_norm: bool = attrs.field(
        default=False,
        validator=_check(lambda value: isinstance(value, bool), "a bool", "pass True or False"),
    )
    """Report the global norm of the averaged gradients before clipping, per training pass
    (:attr:`~lampdist.PassEvent.grad_norm`). Always on with ``max_grad_norm``, which computes
    it anyway; otherwise it costs one norm a step, and under ``"sharded"`` and ``"fsdp"`` one
    all-reduce of a scalar a step."""
    grad_norm_every: int = attrs.field(
        default=1,
        validator=_check(
            lambda value: _is_int(value) and value >= 1,
            "an int >= 1",
            "pass 1 to measure every step",
        ),
    )
    """With ``grad_norm`` (and no ``max_grad_norm``, which measures every step): measure the
    norm on the first step of each pass and every this many steps after it, and report the
    mean and the largest of those (the norm reads every gradient once: on a model whose step
    is mostly the optimizer's memory traffic, such as the benchmark's ``mlp``, about 10% of a
    step; every 10 steps, 1%)."""
    step_split: bool = attrs.field(
        default=True,
        validator=_check(lambda value: isinstance(value, bool), "a bool", "pass True or False"),
    )
    """Measure where each rank's steps spend their time (:attr:`~lampdist.PassEvent.step_split`):
    clocks on the CPU, CUDA timing events on a GPU (no host synchronization); ``False``
    measures nothing."""
    non_finite_loss: Literal["raise", "skip"] = attrs.field(
        default="raise",
        validator=_check(
            lambda value: value in ("raise", "skip"),
            "'raise' or 'skip'",
            "pass 'skip' to skip such steps with a warning",
        ),
    )
    """What a step whose summed loss is not finite does: ``"raise"``
    :class:`~lampdist.NonFiniteLoss`, or ``"skip"`` the step with a warning; either names the
    ranks whose own loss was not finite, on CUDA only where every rank reads the step's loss
    at once (see docs/reliability.md)."""
    shuffle_seed: int = attrs.field(
        default=0, validator=_check(_is_int, "an int", "pass e.g. shuffle_seed=0")
    )
    """Seeds the :class:`~lampdist.PassContext` of every pass, which a batch source that
    shuffles draws its order from (each rank, epoch and kind of pass gets its own seed)."""
    steps_per_epoch: int | None = attrs.field(
        default=None,
        validator=_check(
            _optional(lambda value: _is_int(value) and value >= 1),
            "an int >= 1 or None",
            "pass None for epochs of one pass over the data",
        ),
    )
    """Make each epoch a window of this many optimizer steps over the training data (see
    above); ``None``: an epoch is one pass over it."""
    learning_rate_per_step: StepSchedule | None = attrs.field(
        default=None,
        validator=_check(
            _optional(_is_step_schedule),
            "a schedules.StepSchedule or None",
            "pass e.g. schedules.warmup_cosine_steps(...)",
        ),
    )
    """Multiply the learning rate of each step by a :class:`~lampdist.schedules.StepSchedule`
    of the global step (needs ``steps_per_epoch``)."""

    fsdp: FsdpPolicy = attrs.field(
        factory=FsdpPolicy,
        validator=_check(
            lambda value: isinstance(value, FsdpPolicy),
            "a lampdist.FsdpPolicy",
            "pass e.g. FsdpPolicy(shard_modules=(MyBlock,))",
        ),
    )
    """How ``step_on="fsdp"`` shards the model and its precision (ignored by the other
    designs)."""

    def __attrs_post_init__(self) -> None:
        if self.step_on == "fsdp" and self.bucket_cap_mb is not None:
            raise ConfigError(
                "StepOptions.bucket_cap_mb does not apply to step_on='fsdp', which exchanges "
                "the gradients of each sharded module as its backward ends (choose the "
                "modules with FsdpPolicy.shard_modules); pass bucket_cap_mb=None",
                phase="configure",
            )
        if self.learning_rate_per_step is not None and self.steps_per_epoch is None:
            raise ConfigError(
                "StepOptions.learning_rate_per_step needs steps_per_epoch: the global step of "
                "a step is epoch * steps_per_epoch + the step in the epoch; pass both",
                phase="configure",
            )

    @property
    def bucket_cap_bytes(self) -> int | None:
        """``bucket_cap_mb`` in bytes (at least 1), or ``None``: the one reading of it."""
        if self.bucket_cap_mb is None:
            return None
        return max(1, int(self.bucket_cap_mb * 2**20))

    def agreed_fields(self) -> list[tuple[str, str]]:
        """Every field as (name, repr of its value): what ranks compare when they join."""
        return [(f.name, repr(getattr(self, f.name))) for f in attrs.fields(StepOptions)]


def _epoch_set(value: Any) -> Any:
    """Epochs as a frozenset (what is not iterable is left for the validator to refuse)."""
    return frozenset(value) if isinstance(value, Iterable) else value


def _is_epoch_set(value: object) -> bool:
    return isinstance(value, frozenset) and all(
        isinstance(epoch, numbers.Integral) and not isinstance(epoch, bool) for epoch in value
    )


@attrs.frozen(kw_only=True)
class Recovery:
    """In-job recovery of a lost follower, for :attr:`LoopOptions.recovery`.

    When a follower is lost while the root trains (its process killed, its machine gone, its
    heartbeats missed, its connection dropped), the root aborts the clique, tells the
    survivors to hold, and waits up to ``rejoin_timeout`` seconds for a process that joins
    the control channel as that rank: the same command that started the rank, started
    again. The agreement check then runs on every rank of the clique's next generation; the
    root gives every rank the state at the end of the last completed pass (the model, the
    optimizer state, each rank's place in its training data and its RNG states, kept in the
    root's memory after every pass) and redoes the pass in flight from its start, so that the
    run ends where an uninterrupted run ends, bitwise.

    The run still ends for the root's own loss, a follower not back within
    ``rejoin_timeout`` (:class:`~lampdist.JoinTimeout` naming it), more than
    ``max_recoveries`` recoveries, and a follower's own error (which a new process would
    repeat). A replacement that fails the agreement check is refused (it raises
    :class:`~lampdist.MismatchError`) and the root goes on waiting.

    Raises :class:`~lampdist.ConfigError` for a ``rejoin_timeout`` that is not > 0 and a
    ``max_recoveries`` that is not an int >= 1.
    """

    rejoin_timeout: float = attrs.field(
        default=300.0,
        validator=_check(_positive, "> 0 seconds", "pass how long a replacement may take"),
    )
    """Seconds the root waits for the lost ranks to be back, from the loss."""
    max_recoveries: int = attrs.field(
        default=3,
        validator=_check(
            lambda value: _is_int(value) and value >= 1,
            "an int >= 1",
            "pass LoopOptions(recovery=None) for no recovery",
        ),
    )
    """Recoveries allowed over the run; one more loss ends it."""


@attrs.frozen(kw_only=True)
class LoopOptions:
    """The root's epoch loop; followers ignore it. The rules are :func:`lampdist.epochs`'.

    Raises :class:`~lampdist.ConfigError` (phase ``'configure'``, naming the field) for a
    value out of range, and for ``checkpoint_interval`` without ``checkpoint_state``.
    """

    max_epochs: int = attrs.field(validator=_by(check_max_epochs))
    """Epochs run up to this one (an int >= 0), not included."""
    validation_frequency: int = attrs.field(default=1, validator=_by(check_validation_frequency))
    """Epoch ``e`` is validated when ``e % validation_frequency == 0`` (an int >= 1)."""
    validation_loss_exponential_smoothing_factor: float = attrs.field(
        default=1.0, validator=_by(check_smoothing)
    )
    """The validation loss is smoothed exponentially with this factor, in (0, 1] (1.0: no
    smoothing)."""
    learning_rate_schedule: LearningRateSchedule[Any] = attrs.field(
        factory=noop,
        validator=_check(
            _is_epoch_schedule,
            "a learning-rate schedule (with a learning_rate_factor method)",
            "pass one of lampdist.schedules (e.g. schedules.cosine(...)) or your own",
        ),
    )
    """Sets each epoch's learning-rate factor (see :mod:`lampdist.schedules`)."""
    return_min_validation_loss_model: frozenset[int] = attrs.field(
        default=frozenset(),
        converter=_epoch_set,
        validator=_check(
            _is_epoch_set,
            "an iterable of epochs (ints)",
            "pass e.g. range(max_epochs) to keep the best model of any epoch",
        ),
    )
    """Keep the model of the epoch with the lowest smoothed validation loss among these
    epochs (any iterable of ints), or the best by ``best_model_monitor``; every rank ends
    holding it."""
    checkpoint_state: CheckpointState | None = attrs.field(
        default=None,
        validator=_check(
            _optional(callable),
            "an async callable or None",
            "pass checkpoint.to_directory(...)",
        ),
    )
    """Awaited after every epoch (:func:`lampdist.checkpoint.to_directory` builds one), or as
    ``checkpoint_interval`` says, and always after the last epoch trained, whatever ends the
    loop."""
    checkpoint_interval: float | None = attrs.field(
        default=None,
        validator=_check(
            _optional(_positive), "> 0 seconds or None", "pass None to checkpoint every epoch"
        ),
    )
    """Seconds of wall time (for preemptible jobs with short epochs): checkpoint after the
    first epoch that ends that long after the last checkpoint (``None``: after every
    epoch)."""
    on_event: OnPassEvent | None = attrs.field(
        default=None,
        validator=_check(
            _optional(callable),
            "an async callable or None",
            "pass an async function of a lampdist.PassEvent",
        ),
    )
    """Receives the root's progress (:class:`~lampdist.PassEvent`)."""
    best_model_monitor: Monitor = attrs.field(
        factory=Monitor,
        validator=_check(
            lambda value: isinstance(value, Monitor),
            "a lampdist.Monitor",
            'pass e.g. lampdist.Monitor("validation_accuracy", mode="max")',
        ),
    )
    """What chooses the best model (by default the smoothed validation loss, lower is
    better)."""
    early_stopping: EarlyStopping | None = attrs.field(
        default=None,
        validator=_check(
            _optional(lambda value: isinstance(value, EarlyStopping)),
            "a lampdist.EarlyStopping or None",
            "pass None not to stop early",
        ),
    )
    """Ends the loop once a watched value stops improving (:class:`~lampdist.EarlyStopping`)."""
    recovery: Recovery | None = attrs.field(
        default=None,
        validator=_check(
            _optional(lambda value: isinstance(value, Recovery)),
            "a lampdist.Recovery or None",
            "pass lampdist.Recovery(rejoin_timeout=...) to survive a lost follower",
        ),
    )
    """Survive a lost follower within the job (:class:`~lampdist.Recovery`); ``None``: the
    loss of any rank ends the run."""

    def __attrs_post_init__(self) -> None:
        if self.checkpoint_interval is not None and self.checkpoint_state is None:
            raise ConfigError(
                "LoopOptions.checkpoint_interval says how often to checkpoint, but there is no "
                "checkpoint_state to checkpoint with: give both (checkpoint.to_directory(...))",
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

    ``end_unresponsive``: what the root does with a follower that the control channel finds
    unresponsive (:class:`~lampdist.PeerUnresponsive`: its connection open, its heartbeats
    gone for the channel's ``heartbeat_timeout``). Every rank leaves its collectives with it
    at once either way; with ``True`` (the default) the root also ends the follower's process
    with SIGKILL when it runs on the root's machine, so that a launcher sees it fail (and
    torchrun names it as the root cause) and a supervisor can restart it. With ``False``, or
    on another machine, the stalled process exits with a named error when it wakes up.
    """

    join: float | None = attrs.field(default=JOIN_TIMEOUT, validator=_seconds("join"))
    setup: float | None = attrs.field(default=SETUP_TIMEOUT, validator=_seconds("setup"))
    collective: float | None = attrs.field(
        default=COLLECTIVE_TIMEOUT, validator=_seconds("collective")
    )
    stop: float | None = attrs.field(default=STOP_TIMEOUT, validator=_seconds("stop", zero=True))
    end_unresponsive: bool = attrs.field(
        default=True,
        validator=_check(lambda value: isinstance(value, bool), "True or False", "pass a bool"),
    )


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
