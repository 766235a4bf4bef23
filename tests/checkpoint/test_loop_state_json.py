"""The loop state's JSON form: metrics and early stopping round-trip, and what earlier
versions wrote (no metrics, no early-stopping state) still loads."""

from __future__ import annotations

import json
import math

from lampdist import CurvePoint, EarlyStoppingState, LoopState
from lampdist._checkpoint._format import dump_json, loop_state_from_json, loop_state_to_json

EARLIER = {  # a loop state as lampdist wrote it before metrics existed
    "epoch": 2,
    "last_validation_loss": 0.5,
    "min_validation_loss": 0.5,
    "min_validation_epoch": 1,
    "learning_curve": [
        {
            "epoch": 0,
            "training_loss": 1.0,
            "validation_loss": 0.7,
            "smoothed_validation_loss": 0.7,
        },
        {"epoch": 1, "training_loss": 0.8, "validation_loss": 0.5, "smoothed_validation_loss": 0.5},
    ],
}


def test_a_loop_state_without_metrics_loads_and_is_written_as_before() -> None:
    state = loop_state_from_json(EARLIER)
    assert state.early_stopping is None
    assert [point.metrics for point in state.learning_curve] == [{}, {}]
    assert loop_state_to_json(state) == EARLIER


def test_metrics_and_early_stopping_round_trip_through_json() -> None:
    state = LoopState(
        epoch=2,
        min_validation_loss=0.9,
        min_validation_epoch=1,
        learning_curve=(
            CurvePoint(epoch=0, training_loss=1.0, metrics={"training_accuracy": 0.5}),
            CurvePoint(
                epoch=1,
                training_loss=0.8,
                validation_loss=0.5,
                smoothed_validation_loss=0.5,
                metrics={
                    "training_accuracy": 0.6,
                    "validation_accuracy": 0.9,
                    "validation_recall": (0.25, 1.0, math.inf),
                },
            ),
        ),
        early_stopping=EarlyStoppingState(best=0.9, wait=1),
    )
    data = json.loads(dump_json(loop_state_to_json(state)))
    assert loop_state_from_json(data) == state
