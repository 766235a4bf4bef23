"""Values the epoch driver produces: the loop state and its learning curve."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

__all__ = [
    "CurvePoint",
    "EarlyStoppingState",
    "LoopState",
    "PassEvent",
    "Recovered",
    "TrainingState",
]


@attrs.frozen(kw_only=True)
class CurvePoint:
    """One epoch of the learning curve.

    ``validation_loss`` is the raw mean validation loss of the epoch and
    ``smoothed_validation_loss`` its exponentially smoothed value; both are ``None`` for an
    epoch that was not validated. ``metrics`` holds the epoch's metrics (see
    :attr:`lampdist.SupervisedModel.metrics`) as ``training_NAME`` and, when validated,
    ``validation_NAME``: floats, or tuples of floats for vector-valued metrics.
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
    """One in-job recovery, as the root's progress reports it (:attr:`PassEvent.recovered`).

    ``ranks`` were lost in ``phase`` of ``epoch`` (pass ``pass_index``, which is redone from
    its start); ``seconds`` ran from the moment the root learned of the loss to the moment
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
    """Set on the one event that reports an in-job recovery (see :class:`lampdist.Recovery`),
    sent before the pass in flight is redone: that event's ``step``, ``batches`` and
    ``examples`` are 0 and its ``seconds`` the recovery's."""

    @property
    def examples_per_second(self) -> float:
        """Examples of the whole clique per second of this pass so far."""
        return self.examples / self.seconds if self.seconds > 0 else 0.0
