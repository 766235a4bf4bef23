"""Tracker sinks for the training loop's events, written on the root only.

A tracker is an :class:`~lampdist.OnPassEvent` effect, so it goes where the root's progress
goes, ``LoopOptions(on_event=...)``, and an async context manager that opens the sink and
closes it, flushed, on success, error and cancellation::

    async with trackers.TensorBoardTracker("runs/digits") as tracker:
        await tracker.log_hyperparameters({"lr": 0.05, "batch_size": 32})
        state = await lampdist.drive_distributed_training(
            ..., loop=lampdist.LoopOptions(max_epochs=10, on_event=tracker)
        )
        await tracker.log_summary(state)

:func:`fan_out` makes several trackers one. Only the root reports events, so a tracker
records on the root only: give every rank the same one (one script, one call to
:func:`lampdist.train`), and on a follower it opens nothing and drops what it is given (it
reads the rank from the launcher's variables, or from its ``rank`` argument).
Each sink's package is optional (``pip install "lampdist[tensorboard]"``, ``"lampdist[mlflow]"``)
and imported when the tracker opens; a missing one raises :class:`~lampdist.ConfigError`
that says what to install. Blocking work (opening, writing, closing) runs in worker threads,
never on the event loop.
"""

from ._base import Tracker as Tracker
from ._fan_out import fan_out as fan_out
from ._files import CsvTracker as CsvTracker
from ._files import JsonLinesTracker as JsonLinesTracker
from ._mlflow import MlflowTracker as MlflowTracker
from ._tensorboard import TensorBoardTracker as TensorBoardTracker

__all__ = [
    "CsvTracker",
    "JsonLinesTracker",
    "MlflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "fan_out",
]
