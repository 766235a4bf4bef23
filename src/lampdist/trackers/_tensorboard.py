"""The TensorBoard tracker: torch's ``SummaryWriter``, written on the root."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import attrs

from .._state import PassEvent
from ._base import (
    SUMMARY_NAMES,
    BufferedTracker,
    HyperparameterValue,
    Outcome,
    event_scalars,
)
from ._optional import require

__all__ = ["TensorBoardTracker"]


@attrs.define(eq=False)
class TensorBoardTracker(BufferedTracker):
    """Writes TensorBoard event files into ``log_dir`` with torch's ``SummaryWriter``
    (``pip install "lampdist[tensorboard]"``).

    Scalars, each at the global step (the optimizer steps since the run began, across
    epochs): ``train/running_loss`` (the pass's example-weighted mean loss so far) and
    ``train/examples_per_second`` for every training event (at most one every 50 ms, and
    the pass's last); ``train/loss`` at the end of each training pass; ``valid/loss`` and
    ``valid/examples_per_second`` at the end of each validation pass (``valid/<set>/loss``,
    ... for each of several validation sets); ``summary/<name>``
    for each value of :meth:`log_summary`. The hyperparameters go to TensorBoard's
    HParams dashboard, with the summary's tags as its metrics.

    ``first_step`` is the global step the run starts from: 0 for a new run; for a resumed
    run, the steps the earlier run made up to its checkpoint (its ``epoch`` times the steps
    of an epoch), so that the steps go on where they were and TensorBoard hides what the
    earlier run logged after them (the ``SummaryWriter``'s ``purge_step``).

    ``SummaryWriter`` writes from its own thread; the tracker hands it the buffered scalars
    and flushes it in a worker thread at the end of every pass and at least every 5 seconds,
    and closes it (which ends its thread) on leaving ``async with``, on success, error and
    cancellation alike. See
    :class:`~lampdist.trackers.Tracker`.

    :raises ConfigError: on opening, when the tensorboard package is missing.
    """

    log_dir: Path = attrs.field(converter=Path)
    _writer: Any = attrs.field(default=None, init=False)
    _summaries: Any = attrs.field(default=None, init=False)
    _scalars: list[tuple[str, float, int]] = attrs.field(factory=list, init=False)
    _hparams: list[Any] = attrs.field(factory=list, init=False)

    def _open(self) -> None:
        needs = {"package": "tensorboard", "extra": "tensorboard", "tracker": "TensorBoardTracker"}
        tensorboard = require("torch.utils.tensorboard", **needs)
        self._summaries = require("torch.utils.tensorboard.summary", **needs)
        # The steps after first_step are this run's: TensorBoard hides the earlier ones.
        purge_step = self.first_step + 1 if self.first_step > 0 else None
        self._writer = tensorboard.SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    # On the event loop the records are only listed: ``SummaryWriter.add_scalar`` waits
    # when its queue is full, and while a flush holds the queue's lock.

    def _record_event(self, event: PassEvent, global_step: int) -> None:
        self._scalars += [(tag, value, global_step) for tag, value in event_scalars(event).items()]

    def _record_hyperparameters(self, hyperparameters: dict[str, HyperparameterValue]) -> None:
        metrics = {f"summary/{name}": 0.0 for name in SUMMARY_NAMES}  # declares the tags
        self._hparams += self._summaries.hparams(hyperparameters, metrics)

    def _record_summary(self, summary: dict[str, float], global_step: int) -> None:
        self._scalars += [
            (f"summary/{name}", value, global_step) for name, value in summary.items()
        ]

    def _take(self) -> Callable[[], None]:
        hparams, self._hparams = self._hparams, []
        scalars, self._scalars = self._scalars, []
        return partial(_write, self._writer, hparams, scalars)

    def _close(self, outcome: Outcome) -> None:
        self._writer.close()


def _write(writer: Any, hparams: list[Any], scalars: list[tuple[str, float, int]]) -> None:
    """Write what was recorded, then flush (a worker thread)."""
    for summary in hparams:
        writer.file_writer.add_summary(summary)
    for tag, value, step in scalars:
        writer.add_scalar(tag, value, step)
    writer.flush()
