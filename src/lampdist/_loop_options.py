"""The root's epoch loop: :class:`LoopOptions`, its :class:`Recovery` of a lost follower, and
the check of what its rules watch against what the model reports (:func:`check_monitors`)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import attrs

from ._effects import CheckpointState, OnPassEvent
from ._errors import ConfigError
from ._loop import check_max_epochs, check_smoothing, check_validation_frequency
from ._model_with_data import ModelWithData
from ._monitor import LOSSES, EarlyStopping, Monitor
from ._option_checks import is_int, optional, positive, validator, validator_by
from .schedules import LearningRateSchedule, from_epoch_count, noop

__all__ = ["LoopOptions", "Recovery", "check_monitors"]


def _is_epoch_schedule(value: object) -> bool:
    return callable(getattr(value, "learning_rate_factor", None))


def _as_epoch_schedule(value: Any) -> Any:
    """A plain function ``epoch -> factor`` as :func:`schedules.from_epoch_count` of it (what
    is neither is left for the validator to refuse)."""
    if _is_epoch_schedule(value) or not callable(value):
        return value
    return from_epoch_count(value)


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

    Under ``step_on="fsdp"`` no rank holds another's shards, so each rank keeps its own and
    its neighbour's in host memory after every pass (``fsdp_replica``, see
    docs/howto-recovery.md): a replacement receives its shards from the survivor that holds
    their replica; losing two neighbouring ranks at once loses a shard and ends the run
    (:class:`~lampdist.CheckpointError` naming them). With ``fsdp_replica=False`` nothing is
    kept: a loss sends every rank back to the newest checkpoint in ``checkpoint_state``
    (required), in-job, and the epochs after it run again.

    Raises :class:`~lampdist.ConfigError` for a ``rejoin_timeout`` that is not > 0, a
    ``max_recoveries`` that is not an int >= 1, an ``fsdp_replica`` that is not a bool and a
    ``snapshot_every_steps`` that is not an int >= 1 or ``None`` (the root also refuses it
    without ``StepOptions.steps_per_epoch``).
    """

    rejoin_timeout: float = attrs.field(
        default=300.0,
        validator=validator(positive, "> 0 seconds", "pass how long a replacement may take"),
    )
    """Seconds the root waits for the lost ranks to be back, from the loss."""
    max_recoveries: int = attrs.field(
        default=3,
        validator=validator(
            lambda value: is_int(value) and value >= 1,
            "an int >= 1",
            "pass LoopOptions(recovery=None) for no recovery",
        ),
    )
    """Recoveries allowed over the run; one more loss ends it."""
    fsdp_replica: bool = attrs.field(
        default=True,
        validator=validator(
            lambda value: isinstance(value, bool), "True or False", "pass fsdp_replica=True"
        ),
    )
    """Under ``step_on="fsdp"``: after every snapshot each rank keeps its own shards in host
    memory and a replica of rank ``(r + 1) % n``'s, from which a replacement receives its
    shards (one extra shard of host memory per rank). ``False``: no snapshot is kept; after a
    loss every rank, the replacement included, loads its shards of the newest checkpoint in
    ``LoopOptions.checkpoint_state`` (a :class:`~lampdist.ConfigError` without one), the
    ranks' places in their data and RNG states come from it too, and the root's epochs start
    again from its loop state and schedule state, as a run resumed from it
    (:attr:`Recovered.checkpoint_epoch` names it); the survivors' processes go on. A loss
    before the first checkpoint ends the run (:class:`~lampdist.CheckpointError` naming the
    rank, phase ``'recover'``)."""
    snapshot_every_steps: int | None = attrs.field(
        default=None,
        validator=validator(
            optional(lambda value: is_int(value) and value >= 1),
            "an int >= 1 or None",
            "pass None to snapshot after each pass only",
        ),
    )
    """Also snapshot every this many optimizer steps within a training pass (windows of
    ``StepOptions.steps_per_epoch``), so that a loss redoes at most this many steps, not the
    whole pass; ``None``: after each pass only. See ``docs/howto-recovery.md``."""


@attrs.frozen(kw_only=True)
class LoopOptions:
    """The root's epoch loop; followers ignore it. The rules are :func:`lampdist.epochs`'.

    Raises :class:`~lampdist.ConfigError` (phase ``'configure'``, naming the field) for a
    value out of range, and for ``checkpoint_interval`` without ``checkpoint_state``.
    """

    max_epochs: int = attrs.field(validator=validator_by(check_max_epochs))
    """Epochs run up to this one (an int >= 0), not included."""
    validation_frequency: int = attrs.field(
        default=1, validator=validator_by(check_validation_frequency)
    )
    """Epoch ``e`` is validated when ``e % validation_frequency == 0`` (an int >= 1)."""
    validation_loss_exponential_smoothing_factor: float = attrs.field(
        default=1.0, validator=validator_by(check_smoothing)
    )
    """The validation loss is smoothed exponentially with this factor, in (0, 1] (1.0: no
    smoothing)."""
    learning_rate_schedule: LearningRateSchedule[Any] = attrs.field(
        factory=noop,
        converter=_as_epoch_schedule,
        validator=validator(
            _is_epoch_schedule,
            "a learning-rate schedule (with a learning_rate_factor method) or a function "
            "epoch -> factor",
            "pass one of lampdist.schedules (e.g. schedules.cosine(...)), your own, or e.g. "
            "lambda epoch: 0.9**epoch",
        ),
    )
    """Sets each epoch's learning-rate factor (see :mod:`lampdist.schedules`): a schedule, or
    any function ``epoch -> factor`` (a lambda too), kept as
    :func:`schedules.from_epoch_count` of it; its state is ``None``, so checkpoints store
    nothing of it."""
    return_min_validation_loss_model: frozenset[int] = attrs.field(
        default=frozenset(),
        converter=_epoch_set,
        validator=validator(
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
        validator=validator(
            optional(callable),
            "an async callable or None",
            "pass checkpoint.to_directory(...)",
        ),
    )
    """Awaited after every epoch (:func:`lampdist.checkpoint.to_directory` builds one), or as
    ``checkpoint_interval`` says, and always after the last epoch trained, whatever ends the
    loop."""
    checkpoint_interval: float | None = attrs.field(
        default=None,
        validator=validator(
            optional(positive), "> 0 seconds or None", "pass None to checkpoint every epoch"
        ),
    )
    """Seconds of wall time (for preemptible jobs with short epochs): checkpoint after the
    first epoch that ends that long after the last checkpoint (``None``: after every
    epoch)."""
    on_event: OnPassEvent | None = attrs.field(
        default=None,
        validator=validator(
            optional(callable),
            "an async callable or None",
            "pass an async function of a lampdist.PassEvent",
        ),
    )
    """Receives the root's progress (:class:`~lampdist.PassEvent`)."""
    best_model_monitor: Monitor = attrs.field(
        factory=Monitor,
        validator=validator(
            lambda value: isinstance(value, Monitor),
            "a lampdist.Monitor",
            'pass e.g. lampdist.Monitor("validation_accuracy", mode="max")',
        ),
    )
    """What chooses the best model (by default the smoothed validation loss, lower is
    better)."""
    early_stopping: EarlyStopping | None = attrs.field(
        default=None,
        validator=validator(
            optional(lambda value: isinstance(value, EarlyStopping)),
            "a lampdist.EarlyStopping or None",
            "pass None not to stop early",
        ),
    )
    """Ends the loop once a watched value stops improving (:class:`~lampdist.EarlyStopping`)."""
    recovery: Recovery | None = attrs.field(
        default=None,
        validator=validator(
            optional(lambda value: isinstance(value, Recovery)),
            "a lampdist.Recovery or None",
            "pass lampdist.Recovery(rejoin_timeout=...) to survive a lost follower",
        ),
    )
    """Survive a lost follower within the job (:class:`~lampdist.Recovery`); ``None``: the
    loss of any rank ends the run."""
    log_every_n_steps: int | None = attrs.field(
        default=None,
        validator=validator(
            optional(lambda value: is_int(value) and value >= 1),
            "an int >= 1 or None",
            "pass None for the running progress events alone",
        ),
    )
    """Give ``on_event`` one more event every this many optimizer steps of a training pass
    (counted from each pass's start), never coalesced, whose ``loss`` is the exact mean over
    every rank of those steps' losses; it is told apart by
    :attr:`~lampdist.PassEvent.window_steps` (set to this number), and the trackers record it
    (``train/window_loss``). ``None``: only the running progress events, coalesced to at
    most one every 50 ms, and each pass's last."""
    peak_flops: float | None = attrs.field(
        default=None,
        validator=validator(
            optional(positive),
            "> 0 FLOP/s or None",
            "pass the dense peak FLOP/s of one device, e.g. 989e12 for an H100's bf16",
        ),
    )
    """The dense peak FLOP/s of one device for the training's precision, which
    :attr:`~lampdist.PassEvent.mfu` divides by (times the ranks); it wins over the
    ``LAMPDIST_PEAK_FLOPS`` environment variable and the table of known GPUs. ``None``: the
    variable, else the root GPU's known peak (none on a CPU)."""
    validation_set: str | None = attrs.field(
        default=None,
        validator=validator(
            optional(lambda value: isinstance(value, str) and value.isidentifier()),
            "the name of a validation set or None",
            'pass a key of ModelWithData.validation_batches, e.g. validation_set="val"',
        ),
    )
    """With several validation sets (``ModelWithData.validation_batches`` a mapping), the
    set whose loss and metrics are the curve's ``validation_loss`` and ``validation_NAME``:
    the values that the smoothing, the best model, plateau schedules and early stopping
    watch by default (``None``: the first set). Every set is also reported as
    ``validation_<set>_loss`` and ``validation_<set>_NAME``, which a
    :class:`~lampdist.Monitor` may watch too."""
    validate_before_training: bool = attrs.field(
        default=False,
        validator=validator(
            lambda value: isinstance(value, bool), "True or False", "pass True or False"
        ),
    )
    """Validate every set once before the first training pass of a new run (not on
    resume): the learning curve's point of epoch ``-1``, whose events come before the first
    training pass's (global step 0 in the trackers). It feeds none of the loop's rules."""

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


def _check_validation_set(loop: LoopOptions, data: ModelWithData, rank: int) -> tuple[str, ...]:
    """``data``'s validation sets; raise :class:`ConfigError` when ``loop.validation_set``
    names none of them."""
    sets, chosen = data.validation_sets, loop.validation_set
    if chosen is not None and chosen not in sets:
        have = f"its sets are {list(sets)}" if sets else "it has no named validation sets"
        raise ConfigError(
            f"LoopOptions.validation_set is {chosen!r}, which ModelWithData.validation_batches "
            f"does not name ({have}): pass one of its names, or None for the first",
            rank=rank,
            phase="configure",
        )
    return sets


def check_monitors(loop: LoopOptions, data: ModelWithData, *, rank: int = 0) -> None:
    """Raise :class:`ConfigError` before training when a rule of ``loop`` watches a metric
    that ``data.model`` does not report, or a validation value of a run that does not
    validate (except lamp's defaults: without validation the best model and a plateau
    watching the smoothed validation loss never act, as in lamp), and when
    ``loop.validation_set`` names no set of ``data``. A set's values count as reported
    (``validation_<set>_loss``, ``validation_<set>_NAME``)."""
    metrics = set(data.model.metrics)
    sets = _check_validation_set(loop, data, rank)
    per_set = {f"{s}_{value}" for s in sets for value in ("loss", *metrics)}
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
        names = metrics | per_set if monitor.validation else metrics
        if name not in names:
            known = ", ".join(f"{kind}_{n}" for n in sorted(names)) or "none"
            raise ConfigError(
                f"LoopOptions.{rule} watches {metric!r}, which is no metric of the model "
                f"(its metrics as {kind} values: {known}); add it to SupervisedModel.metrics "
                "or name a validation set's value",
                rank=rank,
                phase="configure",
            )
