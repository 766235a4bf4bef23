"""Progress of a run on the root: a rich progress bar on a terminal, log lines elsewhere, and a
metrics file of one JSON line per pass."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.to_thread
import attrs
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .._effects import OnPassEvent
from .._state import PassEvent, Recovered, as_pass_event

__all__ = ["MetricsFile", "PassCounter", "Reporter", "open_reporter", "read_metrics"]

logger = logging.getLogger(__name__)


class Reporter(Protocol):
    """Shows a run's progress; ``update`` is called after every step and pass."""

    def update(self, event: PassEvent, counter: PassCounter) -> None:
        """Show ``event`` (with its metrics at the end of a pass)."""


@attrs.define(eq=False)
class PassCounter:
    """Counts the root's batches over the whole run, for the bar and the ETA."""

    first_epoch: int
    epochs: int
    batches_per_epoch: int
    done: int = 0
    started: float = attrs.field(factory=time.perf_counter)
    _current: tuple[int, int] = attrs.field(default=(-1, 0), init=False)  # (pass, batches)

    @property
    def total(self) -> int:
        """Batches of the epochs this run trains (the resumed ones excluded)."""
        return max(self.epochs - self.first_epoch, 0) * self.batches_per_epoch

    def advance(self, event: PassEvent) -> None:
        """Count the batches ``event`` adds to its pass."""
        pass_index, counted = self._current
        if pass_index != event.pass_index:
            counted = 0
        if self.done == 0:  # the clock starts with the first pass, after the set-up
            self.started = time.perf_counter() - event.seconds
        self.done += event.batches - counted
        self._current = (event.pass_index, event.batches)

    def eta(self) -> float | None:
        """Seconds left at the mean pace so far, or ``None`` before the first batch."""
        if self.done == 0:
            return None
        elapsed = time.perf_counter() - self.started
        return elapsed / self.done * max(self.total - self.done, 0)


def _loss(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.4f}"


def _telemetry_text(event: PassEvent) -> str:
    """A training pass's gradient norm and slowest rank's step split, for its log line."""
    text = ""
    if event.grad_norm is not None:
        text += f"; grad norm {event.grad_norm:.3g} (max {event.grad_norm_max:.3g})"
    slowest = event.slowest
    if slowest is not None and slowest.steps:
        parts = ", ".join(
            f"{part} {seconds * 1000:.2f}" for part, seconds in slowest.per_step().items()
        )
        text += f"; ms a step on rank {slowest.rank} (slowest): {parts}"
    return text


def _accuracy(metrics: Mapping[str, object]) -> float | None:
    """The pass's accuracy, if it reports one."""
    value = metrics.get("accuracy")
    return value if isinstance(value, float) else None


@attrs.define(eq=False)
class RichReporter:
    """A rich progress bar: epoch, pass, batch i/n, loss, examples/s, ETA."""

    progress: Progress
    task: TaskID
    epochs: int

    def update(self, event: PassEvent, counter: PassCounter) -> None:
        total = event.total_batches if event.total_batches is not None else "?"
        accuracy = _accuracy(event.metrics)
        fields: dict[str, Any] = {
            "epoch": f"epoch {event.epoch + 1}/{self.epochs}",
            "kind": event.kind,
            "batch": f"batch {event.batches}/{total}",
            "loss": f"loss {_loss(event.loss)}",
            "rate": f"{event.examples_per_second:,.0f} ex/s"
            + ("" if event.mfu is None else f" MFU {event.mfu:.1%}"),
        }
        if accuracy is not None:
            fields["loss"] += f" acc {accuracy:.1%}"
        self.progress.update(self.task, completed=counter.done, **fields)


@attrs.define(eq=False)
class LogReporter:
    """One INFO log line per pass, for logs and pipes."""

    epochs: int

    def update(self, event: PassEvent, counter: PassCounter) -> None:
        if not event.done:
            return
        eta = counter.eta()
        accuracy = _accuracy(event.metrics)
        logger.info(
            "epoch %d/%d %s: %d batches, loss %s%s, %.0f examples/s%s, %.2f s, ETA %s%s",
            event.epoch + 1,
            self.epochs,
            event.kind,
            event.batches,
            _loss(event.loss),
            f", accuracy {accuracy:.1%}" if accuracy is not None else "",
            event.examples_per_second,
            "" if event.mfu is None else f", MFU {event.mfu:.1%}",
            event.seconds,
            "-" if eta is None else f"{eta:.1f} s",
            _telemetry_text(event),
        )


@contextmanager
def open_reporter(console: Console, *, epochs: int, total: int) -> Iterator[Reporter]:
    """A :class:`RichReporter` when ``console`` is a terminal, else a :class:`LogReporter`."""
    if not console.is_terminal:
        yield LogReporter(epochs=epochs)
        return
    progress = Progress(
        TextColumn("{task.fields[epoch]} {task.fields[kind]:<5}"),
        BarColumn(),
        TextColumn("{task.fields[batch]}"),
        TextColumn("{task.fields[loss]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )
    with progress:
        task = progress.add_task(
            "train",
            total=total,
            epoch="",
            kind="",
            batch="",
            loss="",
            rate="",
        )
        yield RichReporter(progress=progress, task=task, epochs=epochs)


@attrs.define(eq=False)
class MetricsFile:
    """Appends one JSON line per finished pass to ``path`` (see :meth:`record`)."""

    path: Path

    def restart(self, first_epoch: int) -> None:
        """Keep only the lines of epochs before ``first_epoch`` (a resumed run re-runs the
        rest); an empty file for a new run."""
        kept = [m for m in read_metrics(self.path) if m["epoch"] < first_epoch]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(m) + "\n" for m in kept))

    async def record(self, event: PassEvent) -> None:
        """Append the finished pass ``event``, its metrics under ``"metrics"`` (vectors as
        lists); a training pass's line adds its telemetry (:meth:`PassEvent.telemetry`:
        ``step_split``, ``grad_norm``, ``mfu``, ...); a named validation set's pass adds
        ``validation_set``."""
        line: dict[str, Any] = {
            "epoch": event.epoch,
            "kind": event.kind,
            "pass_index": event.pass_index,
            "loss": event.loss,
            "examples": event.examples,
            "batches": event.batches,
            "seconds": round(event.seconds, 6),
            "examples_per_second": round(event.examples_per_second, 1),
        }
        line["metrics"] = {
            name: list(value) if isinstance(value, tuple) else value
            for name, value in event.metrics.items()
        }
        if event.kind == "train":
            line.update(event.telemetry())
        if event.validation_set is not None:
            line["validation_set"] = event.validation_set
        text = json.dumps(line) + "\n"

        def append() -> None:
            with self.path.open("a") as file:
                file.write(text)

        await anyio.to_thread.run_sync(append)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file, oldest first; none when it does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def on_pass_event(
    reporter: Reporter,
    counter: PassCounter,
    metrics: MetricsFile,
    tracker: OnPassEvent | None = None,
) -> Callable[[PassEvent | Recovered], Awaitable[None]]:
    """The ``on_event`` effect of the demo's root: count, write the metrics line (the pass's
    metrics come with its last event), give the event to ``tracker`` (if any), show
    progress."""

    async def on_event(event: PassEvent | Recovered) -> None:
        event = as_pass_event(event)  # recorded and shown as a recovery always was
        counter.advance(event)
        if event.done:
            await metrics.record(event)
        if tracker is not None:
            await tracker(event)
        reporter.update(event, counter)

    return on_event
