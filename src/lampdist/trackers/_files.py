"""Trackers that write plain files: JSON lines, and CSV tables."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs

from .._state import PassEvent
from ._base import BufferedTracker, HyperparameterValue, Outcome

__all__ = ["EVENT_FIELDS", "CsvTracker", "JsonLinesTracker", "event_record"]

EVENT_FIELDS = (
    "global_step",
    "epoch",
    "kind",
    "pass_index",
    "step",
    "batches",
    "total_batches",
    "examples",
    "loss",
    "seconds",
    "examples_per_second",
    "done",
    "metrics",
    "tokens",
    "tokens_per_second",
    "mfu",
    "grad_norm",
    "grad_norm_max",
    "step_split",
    "window_steps",
)
"""The fields of an event record, in the order of the CSV columns."""


def event_record(event: PassEvent, global_step: int) -> dict[str, Any]:
    """``event``'s fields, its global step, its examples per second and its telemetry
    (:meth:`~lampdist.PassEvent.telemetry`), by name (``metrics`` as a dict of floats and
    lists); a validation pass over a named set adds ``validation_set``, its name (after
    :data:`EVENT_FIELDS`, so that a run of one source records what it always did)."""
    record = {"global_step": global_step, **attrs.asdict(event), **event.telemetry()}
    record["examples_per_second"] = event.examples_per_second
    fields = {name: record[name] for name in EVENT_FIELDS}
    if event.validation_set is not None:
        fields["validation_set"] = event.validation_set
    return fields


def _append_text(path: Path, text: str) -> None:
    with path.open("a", encoding="utf-8") as file:
        file.write(text)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def _nothing() -> None:
    pass


def _run_all(jobs: Sequence[Callable[[], None]]) -> None:
    for job in jobs:
        job()


@attrs.define(eq=False)
class JsonLinesTracker(BufferedTracker):
    """Appends one JSON object a line to ``path``: an ``{"record": "event", ...}`` line for
    every :class:`~lampdist.PassEvent` the root reports (with the fields of
    :class:`~lampdist.trackers.CsvTracker`'s columns, and ``validation_set`` for a named
    validation set's pass), one
    ``{"record": "hyperparameters", "hyperparameters": {...}}`` line and one
    ``{"record": "summary", "global_step": ..., "summary": {...}}`` line.

    ``global_step`` counts the optimizer steps from ``first_step`` on (see
    :class:`~lampdist.trackers.TensorBoardTracker`). The lines are written in a worker thread
    at the end of every pass, at least every 5 seconds and on closing; the file is open only
    while a write runs, and a file that exists is appended to (a resumed run follows the run
    it resumes). ``async with`` opens the tracker; see :class:`~lampdist.trackers.Tracker`.
    """

    path: Path = attrs.field(converter=Path)
    _lines: list[str] = attrs.field(factory=list, init=False)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _append_text(self.path, "")  # fails now, not at the first pass, where it cannot write

    def _record_event(self, event: PassEvent, global_step: int) -> None:
        self._add({"record": "event", **event_record(event, global_step)})

    def _record_hyperparameters(self, hyperparameters: dict[str, HyperparameterValue]) -> None:
        self._add({"record": "hyperparameters", "hyperparameters": hyperparameters})

    def _record_summary(self, summary: dict[str, float], global_step: int) -> None:
        self._add({"record": "summary", "global_step": global_step, "summary": summary})

    def _add(self, record: dict[str, Any]) -> None:
        self._lines.append(json.dumps(record) + "\n")

    def _take(self) -> Callable[[], None]:
        lines, self._lines = self._lines, []
        return partial(_append_text, self.path, "".join(lines)) if lines else _nothing

    def _close(self, outcome: Outcome) -> None:
        pass  # no file stays open between writes


def _csv_text(rows: Iterable[Sequence[Any]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    return buffer.getvalue()


@attrs.define(eq=False)
class CsvTracker(BufferedTracker):
    """Writes CSV tables into ``directory``: ``events.csv``, one row for every
    :class:`~lampdist.PassEvent` the root reports (appended to an existing file), and
    ``hyperparameters.csv`` and ``summary.csv`` with ``name,value`` rows (the summary's
    first row is the ``global_step``).

    The events' columns: ``global_step`` (the optimizer steps from ``first_step`` on; see
    :class:`~lampdist.trackers.TensorBoardTracker`), the event's fields (``epoch``,
    ``kind``, ``pass_index``, ``step``, ``batches``, ``total_batches``, ``examples``,
    ``loss``, ``seconds``), ``examples_per_second``, ``done`` and ``metrics`` (the pass's
    metrics as a JSON object, on a pass's last event). A validation pass over a named set
    (several validation sets) has the kind ``valid/<set>``. An empty cell is ``None``
    (``total_batches`` of a source without a length, ``metrics`` of the other events). Rows
    are written in a worker thread at the end of every pass, at least every 5 seconds and on
    closing; no file stays open between writes. ``async with`` opens the tracker; see
    :class:`~lampdist.trackers.Tracker`.
    """

    directory: Path = attrs.field(converter=Path)
    _jobs: list[Callable[[], None]] = attrs.field(factory=list, init=False)
    _rows: list[list[Any]] = attrs.field(factory=list, init=False)

    @property
    def events_path(self) -> Path:
        """The events table."""
        return self.directory / "events.csv"

    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.events_path
        if not path.exists() or path.stat().st_size == 0:
            _append_text(path, _csv_text([EVENT_FIELDS]))

    def _record_event(self, event: PassEvent, global_step: int) -> None:
        record = event_record(event, global_step)
        name = record.pop("validation_set", None)
        if name is not None:  # the columns stay those of one source: the kind names the set
            record["kind"] = f"valid/{name}"
        record["metrics"] = json.dumps(record["metrics"]) if record["metrics"] else None
        split = record["step_split"]
        record["step_split"] = None if split is None else json.dumps(split)
        self._rows.append(list(record.values()))

    def _record_hyperparameters(self, hyperparameters: dict[str, HyperparameterValue]) -> None:
        rows = [("name", "value"), *hyperparameters.items()]
        self._jobs.append(
            partial(_write_text, self.directory / "hyperparameters.csv", _csv_text(rows))
        )

    def _record_summary(self, summary: dict[str, float], global_step: int) -> None:
        rows = [("name", "value"), ("global_step", global_step), *summary.items()]
        self._jobs.append(partial(_write_text, self.directory / "summary.csv", _csv_text(rows)))

    def _take(self) -> Callable[[], None]:
        jobs, self._jobs = self._jobs, []
        if self._rows:
            rows, self._rows = self._rows, []
            jobs.insert(0, partial(_append_text, self.events_path, _csv_text(rows)))
        return partial(_run_all, jobs)

    def _close(self, outcome: Outcome) -> None:
        pass  # no file stays open between writes
