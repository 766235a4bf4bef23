"""The MLflow tracker: one MLflow run, written on the root."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import attrs

from .._state import PassEvent
from ._base import BufferedTracker, HyperparameterValue, Outcome, event_scalars
from ._optional import require

__all__ = ["MlflowTracker"]

_STATUS: dict[Outcome, str] = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
_METRICS_PER_CALL = 1000  # MLflow's limits on one log_batch
_PARAMS_PER_CALL = 100


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _tags(value: Mapping[str, str] | None) -> dict[str, str] | None:
    return None if value is None else dict(value)


@attrs.define(eq=False)
class MlflowTracker(BufferedTracker):
    """Logs the run as one MLflow run (``pip install "lampdist[mlflow]"``): the events'
    metrics with their global step, the hyperparameters as params, the summary as metrics.

    The metrics are those of :class:`~lampdist.trackers.TensorBoardTracker`, under the same
    names (``train/running_loss``, ``train/examples_per_second``, ``train/loss``,
    ``valid/loss``, ``valid/examples_per_second``, ``summary/<name>``), at the global step
    (the optimizer steps since the run began, from ``first_step`` on).

    ``tracking_uri`` is the tracking server or store (``None``: MLflow's default, which
    ``MLFLOW_TRACKING_URI`` sets); ``experiment_name`` the experiment, created when missing
    (``None``: MLflow's ``Default``); ``run_name`` and ``tags`` are the new run's. The run
    is created on opening (:attr:`run_id` names it) and ends on leaving ``async with`` as
    ``FINISHED``, ``FAILED`` after an error or ``KILLED`` after a cancellation or
    :class:`~lampdist.Interrupted`. The metrics are buffered and sent in a worker thread at
    the end of every pass, at least every 5 seconds and on closing, through an
    ``MlflowClient`` of the tracker's own (MLflow's global active run is left alone). See
    :class:`~lampdist.trackers.Tracker`.

    :raises ConfigError: on opening, when the mlflow package is missing.
    """

    tracking_uri: str | None = None
    experiment_name: str | None = None
    run_name: str | None = None
    tags: Mapping[str, str] | None = attrs.field(default=None, converter=_tags)
    _client: Any = attrs.field(default=None, init=False)
    _entities: Any = attrs.field(default=None, init=False)
    _run_id: str | None = attrs.field(default=None, init=False)
    _metrics: list[Any] = attrs.field(factory=list, init=False)
    _params: list[Any] = attrs.field(factory=list, init=False)

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id once the tracker is open, else ``None``."""
        return self._run_id

    def _open(self) -> None:
        needs = {"package": "mlflow", "extra": "mlflow", "tracker": "MlflowTracker"}
        tracking = require("mlflow.tracking", **needs)
        self._entities = require("mlflow.entities", **needs)
        client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        name = self.experiment_name or "Default"
        experiment = client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment is not None else client.create_experiment(name)
        )
        run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
        self._client, self._run_id = client, run.info.run_id

    def _record_event(self, event: PassEvent, global_step: int) -> None:
        self._add_metrics(event_scalars(event), global_step)

    def _record_hyperparameters(self, hyperparameters: dict[str, HyperparameterValue]) -> None:
        self._params += [self._entities.Param(k, str(v)) for k, v in hyperparameters.items()]

    def _record_summary(self, summary: dict[str, float], global_step: int) -> None:
        self._add_metrics({f"summary/{k}": v for k, v in summary.items()}, global_step)

    def _add_metrics(self, values: dict[str, float], global_step: int) -> None:
        now = int(time.time() * 1000)
        metric = self._entities.Metric
        self._metrics += [metric(k, float(v), now, global_step) for k, v in values.items()]

    def _take(self) -> Callable[[], None]:
        metrics, self._metrics = self._metrics, []
        params, self._params = self._params, []
        return partial(self._send, metrics, params)

    def _send(self, metrics: Sequence[Any], params: Sequence[Any]) -> None:
        for chunk in _chunks(params, _PARAMS_PER_CALL):
            self._client.log_batch(self._run_id, params=chunk, synchronous=True)
        for chunk in _chunks(metrics, _METRICS_PER_CALL):
            self._client.log_batch(self._run_id, metrics=chunk, synchronous=True)

    def _close(self, outcome: Outcome) -> None:
        self._client.set_terminated(self._run_id, status=_STATUS[outcome])
