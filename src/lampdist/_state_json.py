"""The JSON form of a :class:`LoopState`: what a checkpoint's ``state.json`` holds and what the
root's STOP carries to the followers."""

from __future__ import annotations

from typing import Any

from ._state import CurvePoint, EarlyStoppingState, LoopState

__all__ = ["loop_state_from_json", "loop_state_to_json"]


def loop_state_to_json(state: LoopState) -> dict[str, Any]:
    """The loop state as JSON. A curve point's ``metrics`` and the ``early_stopping`` state
    are written only when there are some, so that a run without them writes what earlier
    versions wrote (and read)."""
    data: dict[str, Any] = {
        "epoch": state.epoch,
        "last_validation_loss": state.last_validation_loss,
        "min_validation_loss": state.min_validation_loss,
        "min_validation_epoch": state.min_validation_epoch,
        "learning_curve": [_point_to_json(point) for point in state.learning_curve],
    }
    if state.early_stopping is not None:
        stopping = state.early_stopping
        data["early_stopping"] = {"best": stopping.best, "wait": stopping.wait}
    return data


def _point_to_json(point: CurvePoint) -> dict[str, Any]:
    data: dict[str, Any] = {
        "epoch": point.epoch,
        "training_loss": point.training_loss,
        "validation_loss": point.validation_loss,
        "smoothed_validation_loss": point.smoothed_validation_loss,
    }
    if point.metrics:
        data["metrics"] = {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in point.metrics.items()
        }
    return data


def _point_from_json(data: dict[str, Any]) -> CurvePoint:
    metrics = {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in data.get("metrics", {}).items()
    }
    return CurvePoint(
        epoch=data["epoch"],
        training_loss=data["training_loss"],
        validation_loss=data["validation_loss"],
        smoothed_validation_loss=data["smoothed_validation_loss"],
        metrics=metrics,
    )


def loop_state_from_json(data: dict[str, Any]) -> LoopState:
    """The loop state :func:`loop_state_to_json` wrote (any lampdist's: the metrics and the
    early-stopping state may be absent)."""
    stopping = data.get("early_stopping")
    return LoopState(
        epoch=data["epoch"],
        last_validation_loss=data["last_validation_loss"],
        min_validation_loss=data["min_validation_loss"],
        min_validation_epoch=data["min_validation_epoch"],
        learning_curve=tuple(_point_from_json(point) for point in data["learning_curve"]),
        early_stopping=None
        if stopping is None
        else EarlyStoppingState(best=stopping["best"], wait=stopping["wait"]),
    )
