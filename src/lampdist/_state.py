"""Values the epoch driver produces: the loop state and its learning curve."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import attrs

__all__ = [
    "CurvePoint",
    "EarlyStoppingState",
    "LoopState",
    "PassEvent",
    "Recovered",
    "StepSplit",
    "TrainingState",
    "as_pass_event",
]


@attrs.frozen(kw_only=True)
class CurvePoint:
    """One epoch of the learning curve.

    ``validation_loss`` is the raw mean validation loss of the epoch and
    ``smoothed_validation_loss`` its exponentially smoothed value; both are ``None`` for an
    epoch that was not validated. ``metrics`` holds the epoch's metrics (see
    :attr:`lampdist.SupervisedModel.metrics`) as ``training_NAME`` and, when validated,
    ``validation_NAME``: floats, or tuples of floats for vector-valued metrics.

    With several validation sets (see :class:`lampdist.ModelWithData`), ``validation_loss``,
    ``smoothed_validation_loss`` and ``validation_NAME`` are the driving set's
    (``LoopOptions.validation_set``), and ``metrics`` also holds every set's loss and metrics
    as ``validation_<set>_loss`` and ``validation_<set>_NAME``.

    With ``LoopOptions.validate_before_training``, a new run's curve begins with the point of
    epoch ``-1``: the validation of the model before any training, whose ``training_loss`` is
    NaN and ``smoothed_validation_loss`` ``None`` (it feeds none of the loop's rules).
    """

    epoch: int
    training_loss: float
    validation_loss: float | None = None
    smoothed_validation_loss: float | None = None
    metrics: Mapping[str, float | tuple[float, ...]] = attrs.field(factory=dict, hash=False)


@attrs.frozen(kw_only=True)
class EarlyStoppingState:
    """Where :class:`lampdist.EarlyStopping` stands: the best watched value so far (``None``
    before the first) and ``wait``, the epochs that reported it since it last improved."""

    best: float | None = None
    wait: int = 0


@attrs.frozen(kw_only=True)
class LoopState:
    """Where the epoch loop stands.

    ``epoch`` is the next epoch to run (the first epoch not run yet).
    ``last_validation_loss`` is the latest *smoothed* validation loss: it carries over epochs
    that are not validated, feeds the learning-rate schedule and seeds the next smoothing.
    ``min_validation_loss`` and ``min_validation_epoch`` track the best model saved so far:
    its watched value and its epoch (lamp's names: the lowest smoothed validation loss unless
    ``best_model_monitor`` watches another value, in either direction).
    ``learning_curve`` holds one :class:`CurvePoint` per epoch run, oldest first.
    ``early_stopping`` is the state of the early-stopping rule, when there is one.
    """

    epoch: int = 0
    last_validation_loss: float | None = None
    min_validation_loss: float | None = None
    min_validation_epoch: int | None = None
    learning_curve: tuple[CurvePoint, ...] = ()
    early_stopping: EarlyStoppingState | None = None


@attrs.frozen(kw_only=True)
class TrainingState:
    """Everything a distributed run needs to resume: the loop state, three state dicts and
    each rank's own state.

    ``model_state`` and ``optimizer_state`` are the root's ``state_dict()`` results (with
    ``step_on="sharded"``, the whole optimizer's state gathered from the ranks; a compiled
    model's of the module that ``torch.compile`` wrapped, so that its keys are the same either
    way); ``best_model_state`` is the model's state dict at the minimum validation loss, or ``None``
    when no best model has been saved. ``rank_states`` holds, per rank in rank order, what it
    needs to go on exactly where it stopped: its place in its training data
    (``"position"``, with ``StepOptions.steps_per_epoch``) and its RNG states; ``None`` in
    checkpoints that predate them. Under ``step_on="fsdp"`` no rank holds the whole model: each
    rank's shards are in the checkpoint directory (``shards``).
    """

    loop_state: LoopState
    model_state: Mapping[str, Any]
    optimizer_state: Mapping[str, Any]
    best_model_state: Mapping[str, Any] | None = None
    rank_states: tuple[Mapping[str, Any], ...] | None = None
    shards: Any = None
    """``step_on="fsdp"``: where every rank's shards of the model and optimizer state are (a
    ``lampdist._checkpoint.ShardedState``); ``model_state`` and ``optimizer_state`` are then
    empty. ``None`` for a checkpoint of whole state dicts."""


@attrs.frozen(kw_only=True)
class Recovered:
    """One in-job recovery (see :class:`lampdist.Recovery`): an event of its own, which
    ``LoopOptions.on_event`` receives beside the passes' :class:`PassEvent`, before the pass in
    flight is redone.

    ``ranks`` were lost in ``phase`` of ``epoch`` (pass ``pass_index``, which is redone from
    its step ``from_step``: 0, its start, unless ``Recovery.snapshot_every_steps`` kept a
    snapshot within it); ``seconds`` ran from the moment the root learned of the loss to the moment
    every rank was back in step, ``rejoin_seconds`` of them until the lost ranks' replacements
    had joined (their start-up, mostly); ``recoveries`` counts the run's recoveries, this one
    included.
    """

    ranks: tuple[int, ...]
    phase: str
    epoch: int
    pass_index: int
    seconds: float
    rejoin_seconds: float
    recoveries: int
    reason: str
    checkpoint_epoch: int | None = None
    """The epoch of the checkpoint the run went back to instead (``step_on="fsdp"`` with
    ``Recovery(fsdp_replica=False)``: the passes from ``pass_index``, the first after it, are
    run again); ``None`` when the pass in flight is redone from the snapshot."""
    from_step: int = 0

    def __getattr__(self, name: str) -> Any:
        # Before a recovery was an event of its own, it came as a PassEvent whose
        # ``recovered`` held it and whose counts were placeholders: code written for that
        # keeps working, warned.
        if name.startswith("_") or (not hasattr(PassEvent, name) and name not in _PASS_FIELDS):
            raise AttributeError(name)
        warnings.warn(
            f"a recovery is an event of its own: check isinstance(event, lampdist.Recovered) "
            f"instead of reading Recovered.{name} as a PassEvent's",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(as_pass_event(self), name)


@attrs.frozen(kw_only=True)
class StepSplit:
    """Where one rank's steps of a training pass spent their time, in seconds summed over the
    pass's ``steps`` (:attr:`PassEvent.step_split`).

    ``data``: waiting for the next batch; ``forward_backward``: the model's forward and
    backward passes (under ``step_on="fsdp"`` with the collectives that run inside them);
    ``exchange``: waiting for the gradients' exchange and, where the root steps, for the
    parameters; ``optimizer``: averaging, clipping and the optimizer's step; ``idle``: the
    rest of the step (the host's bookkeeping between the parts, and on a GPU the time the
    device waited for the host). On a GPU the parts are the device's time between CUDA
    events recorded at each part's end; on the CPU the host's clock.
    """

    rank: int
    steps: int
    data: float
    forward_backward: float
    exchange: float
    optimizer: float
    idle: float

    @property
    def seconds(self) -> float:
        """The steps' time: every part."""
        return self.data + self.forward_backward + self.exchange + self.optimizer + self.idle

    @property
    def busy(self) -> float:
        """The steps' time less the exchange's: what the rank's own work took (the ranks'
        steps take as long as each other's, the faster ones waiting in the exchange)."""
        return self.seconds - self.exchange

    def to_plain(self) -> dict[str, float | int]:
        """The split as JSON-ready values: the rank, the steps and each part's seconds."""
        return {
            "rank": self.rank,
            "steps": self.steps,
            "data": self.data,
            "forward_backward": self.forward_backward,
            "exchange": self.exchange,
            "optimizer": self.optimizer,
            "idle": self.idle,
        }

    def per_step(self) -> dict[str, float]:
        """Seconds per step of each part, by name (empty for a pass without steps)."""
        if self.steps == 0:
            return {}
        return {
            "data": self.data / self.steps,
            "forward_backward": self.forward_backward / self.steps,
            "exchange": self.exchange / self.steps,
            "optimizer": self.optimizer / self.steps,
            "idle": self.idle / self.steps,
        }


@attrs.frozen(kw_only=True)
class PassEvent:
    """Progress of a pass, reported on the root: during a training pass after its first step,
    then the newest at most every 50 ms (events in between are coalesced, never waited for),
    and always at the end of every pass.

    ``batches`` counts the root's own batches so far and ``total_batches`` is the root's batch
    count when its source has a length, else ``None``; ``examples`` counts the whole clique's
    examples so far and ``loss`` is their example-weighted mean loss; ``done`` marks the last
    event of the pass. ``metrics`` holds the pass's metrics over the whole clique on the last
    event (keyed by the names of :attr:`lampdist.SupervisedModel.metrics`), and is empty on
    the others.
    """

    epoch: int
    kind: Literal["train", "valid"]
    pass_index: int
    step: int
    batches: int
    total_batches: int | None
    examples: int
    loss: float
    seconds: float
    done: bool
    metrics: Mapping[str, float | tuple[float, ...]] = attrs.field(factory=dict, hash=False)
    recovered: Recovered | None = None
    """Deprecated, always ``None``: an in-job recovery is an event of its own,
    :class:`Recovered`, which ``on_event`` receives (it still answers a PassEvent's fields,
    with a ``DeprecationWarning``: ``recovered`` is itself, the counts placeholders)."""
    tokens: int | None = None
    """The whole clique's tokens so far, where the batches say (see
    :attr:`lampdist.SupervisedModel.token_count`), else ``None``: on the last event the sum
    over every rank, on the others estimated from the root's tokens per example."""
    flops_per_example: float | None = None
    """The model's FLOPs for one example's forward and backward, when known (see
    :attr:`lampdist.SupervisedModel.flops_per_example`)."""
    peak_flops: float | None = None
    """The clique's peak FLOP/s: the root device's dense peak for the training's precision
    times the ranks (``None`` on a CPU or an unknown GPU; ``LoopOptions.peak_flops`` or
    ``LAMPDIST_PEAK_FLOPS`` sets a device's)."""
    grad_norm: float | None = None
    """On a training pass's last event, with :attr:`lampdist.StepOptions.measure_grad_norm` or
    ``max_grad_norm``: the mean over the pass's steps of the global norm of the averaged
    gradients before clipping (``grad_norm_max`` their largest)."""
    grad_norm_max: float | None = None
    step_split: tuple[StepSplit, ...] = ()
    """On a training pass's last event, with :attr:`lampdist.StepOptions.measure_step_split`: where
    each rank's steps spent their time, by rank."""
    window_steps: int | None = None
    """Set on the events of :attr:`lampdist.LoopOptions.log_every_n_steps` (to its N), one per
    N optimizer steps of a training pass, never coalesced: ``step`` ends the window, and
    ``examples``, ``loss`` and ``seconds`` are the window's own, ``loss`` the exact mean over
    every rank of its N steps, weighted as the pass's loss is. ``None`` on the other events,
    the running ones (whose ``loss`` is the pass's mean so far) and each pass's last."""
    validation_set: str | None = None
    """The validation set a validation pass ran over, where ``validation_batches`` names
    several (see :class:`lampdist.ModelWithData`); ``None`` for one source and for training."""

    @property
    def examples_per_second(self) -> float:
        """Examples of the whole clique per second of this pass so far."""
        return self.examples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens of the whole clique per second of this pass so far, where known."""
        if self.tokens is None:
            return None
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization: the model's FLOPs per second over the clique's peak
        (``None`` where either is unknown)."""
        if self.flops_per_example is None or self.peak_flops is None:
            return None
        return self.flops_per_example * self.examples_per_second / self.peak_flops

    @property
    def slowest(self) -> StepSplit | None:
        """The step split of the rank whose own work took longest (:attr:`StepSplit.busy`)."""
        if not self.step_split:
            return None
        return max(self.step_split, key=lambda split: split.busy)

    def telemetry(self) -> dict[str, Any]:
        """The event's throughput and telemetry as JSON-ready values, what the trackers and
        the demo's ``metrics.jsonl`` record: ``tokens``, ``tokens_per_second``, ``mfu``,
        ``grad_norm``, ``grad_norm_max`` (each ``None`` where unknown) and ``step_split``
        (``None``, or ``{"ranks": [...], "slowest": {...}}``: each rank's
        :meth:`StepSplit.to_plain`, and the slowest rank's)."""
        slowest = self.slowest
        return {
            "tokens": self.tokens,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "grad_norm": self.grad_norm,
            "grad_norm_max": self.grad_norm_max,
            "step_split": None
            if slowest is None
            else {
                "ranks": [split.to_plain() for split in self.step_split],
                "slowest": slowest.to_plain(),
            },
        }


_PASS_FIELDS = frozenset(field.name for field in attrs.fields(PassEvent))
"""What a PassEvent answers (its properties too, through ``hasattr``)."""


def as_pass_event(event: PassEvent | Recovered) -> PassEvent:
    """``event`` as a :class:`PassEvent`: a recovery as the PassEvent it used to come as
    (``recovered`` set, placeholders for the counts: no step, no loss), for code that records
    both alike (the trackers)."""
    if isinstance(event, PassEvent):
        return event
    return PassEvent(
        epoch=event.epoch,
        kind="valid" if event.phase == "valid" else "train",
        pass_index=event.pass_index,
        step=0,
        batches=0,
        total_batches=None,
        examples=0,
        loss=math.nan,
        seconds=event.seconds,
        done=False,
        recovered=event,
    )
