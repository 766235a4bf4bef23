"""lampdist.trackers: a short real training writes through each sink, and the files are read
back; the sinks close, flushed, on error and cancellation, and never write on the loop."""

from __future__ import annotations

import csv
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any, Literal

import anyio
import attrs
import numpy as np
import pytest

import lampdist
from lampdist import trackers
from lampdist._wakeup import on_event_loop_thread

from .roles.test_local_failures import entries, sgd

EPOCHS = 3
STEPS_PER_EPOCH = 3  # entries(): three batches a rank, a step each
HYPERPARAMETERS = {"lr": 0.1, "optimizer": {"name": "sgd", "nesterov": False}, "widths": (3, 6)}
FLAT_HYPERPARAMETERS = {
    "lr": 0.1,
    "optimizer/name": "sgd",
    "optimizer/nesterov": False,
    "widths": "(3, 6)",
}
ASYNCIO = pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a real training


def expected_step(event: lampdist.PassEvent) -> int:
    """The global step of ``event`` in :func:`train`'s run: steps across epochs."""
    return STEPS_PER_EPOCH * event.epoch + (event.step if event.kind == "train" else 3)


def float32(value: float) -> float:
    """``value`` as TensorBoard stores a scalar."""
    return float(np.float32(value))


async def train(
    tracker: trackers.Tracker, epochs: int = EPOCHS, *, metrics: bool = False
) -> tuple[lampdist.LoopState, list[lampdist.PassEvent]]:
    """Two ranks in this process train ``epochs`` epochs with ``tracker`` on the root (with
    ``metrics``, a model that reports its mean absolute error), logging the hyperparameters
    before and the summary after; what the root reported."""
    seen: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        seen.append(event)
        await tracker(event)

    await tracker.log_hyperparameters(HYPERPARAMETERS)
    with anyio.fail_after(60):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[with_metrics(e) if metrics else e for e in entries(2)],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(
                max_epochs=epochs,
                on_event=on_event,
                return_min_validation_loss_model=range(epochs),
            ),
        )
    await tracker.log_summary(state)
    return state, seen


def with_metrics(entry: lampdist.ModelWithData) -> lampdist.ModelWithData:
    """``entry`` whose model reports its mean absolute error (a metric of every pass end)."""
    mae = lampdist.Metric(lambda out, y: ((out - y).abs().sum(), y.numel()))
    assert isinstance(entry.model, lampdist.SupervisedModel)
    model = lampdist.SupervisedModel(entry.model.module, entry.model.loss_fn, metrics={"mae": mae})
    return attrs.evolve(entry, model=model)


def expected_summary(state: lampdist.LoopState) -> dict[str, float]:
    last = state.learning_curve[-1]
    assert state.min_validation_loss is not None and state.min_validation_epoch is not None
    assert last.validation_loss is not None and last.smoothed_validation_loss is not None
    return {
        "epochs": EPOCHS,
        "min_validation_loss": state.min_validation_loss,
        "min_validation_epoch": state.min_validation_epoch,
        "last_epoch": EPOCHS - 1,
        "last_training_loss": last.training_loss,
        "last_validation_loss": last.validation_loss,
        "last_smoothed_validation_loss": last.smoothed_validation_loss,
    }


def event(epoch: int, step: int, *, done: bool = False, kind: str = "train") -> lampdist.PassEvent:
    """A synthetic event of pass ``2 * epoch`` (training) or ``2 * epoch + 1``."""
    return lampdist.PassEvent(
        epoch=epoch,
        kind="train" if kind == "train" else "valid",
        pass_index=2 * epoch + (kind != "train"),
        step=step,
        batches=step,
        total_batches=STEPS_PER_EPOCH,
        examples=8 * step,
        loss=1.0 / (1 + epoch + step),
        seconds=0.01 * step,
        done=done,
    )


def open_files_under(directory: Path) -> list[str]:
    """The files under ``directory`` that this process holds open (Linux)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            held.append(target)
    return held


def tensorboard_writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread"]


# Reading the sinks back


def read_tensorboard(log_dir: Path) -> Any:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    reader = accumulator.EventAccumulator(str(log_dir), size_guidance={accumulator.SCALARS: 0})
    reader.Reload()
    return reader


def scalars(reader: Any, tag: str) -> list[tuple[int, float]]:
    return [(s.step, s.value) for s in reader.Scalars(tag)]


def tensorboard_hyperparameters(reader: Any) -> dict[str, Any]:
    plugin_data = pytest.importorskip("tensorboard.plugins.hparams.plugin_data_pb2")
    content = reader.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data.HParamsPluginData.FromString(content).session_start_info
    return {
        name: value.string_value if value.HasField("string_value") else value.number_value
        for name, value in start.hparams.items()
    }


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def check_event_records(records: list[dict[str, Any]], seen: list[lampdist.PassEvent]) -> None:
    """Event records (from JSON or CSV, as strings) hold every event the root reported."""
    assert len(records) == len(seen)
    for record, sent in zip(records, seen, strict=True):
        assert int(record["global_step"]) == expected_step(sent)
        assert (int(record["epoch"]), record["kind"]) == (sent.epoch, sent.kind)
        assert (int(record["step"]), int(record["examples"])) == (sent.step, sent.examples)
        assert float(record["loss"]) == sent.loss  # written exactly (repr), read exactly
        assert float(record["examples_per_second"]) == sent.examples_per_second
        assert str(record["done"]).lower() == str(sent.done).lower()
        metrics = record["metrics"]
        if isinstance(metrics, str) or metrics is None:  # CSV: JSON text, empty without any
            metrics = json.loads(metrics) if metrics else {}
        assert metrics == dict(sent.metrics)
    assert any(sent.metrics for sent in seen)  # the pass ends carry the model's metric


@pytest.fixture
def mlflow_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A local MLflow file store (MLflow 3 asks to allow it) without telemetry."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    pytest.importorskip("mlflow")
    return f"file://{tmp_path / 'mlruns'}"


# A real training through each sink


@ASYNCIO
async def test_tensorboard_holds_every_event_at_its_global_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    async with trackers.TensorBoardTracker(tmp_path / "tb") as tracker:
        state, seen = await train(tracker)
    reader = read_tensorboard(tmp_path / "tb")
    training = [e for e in seen if e.kind == "train"]
    assert any(not e.done for e in training)  # per-step events, not only pass ends
    assert scalars(reader, "train/running_loss") == [
        (expected_step(e), float32(e.loss)) for e in training
    ]
    assert scalars(reader, "train/examples_per_second") == [
        (expected_step(e), float32(e.examples_per_second)) for e in training
    ]
    steps = [step for step, _ in scalars(reader, "train/running_loss")]
    assert steps == sorted(set(steps))  # strictly increasing across epochs
    ends = [STEPS_PER_EPOCH * (p.epoch + 1) for p in state.learning_curve]
    assert scalars(reader, "train/loss") == [
        (step, float32(p.training_loss)) for step, p in zip(ends, state.learning_curve, strict=True)
    ]
    assert scalars(reader, "valid/loss") == [
        (step, float32(p.validation_loss or 0))
        for step, p in zip(ends, state.learning_curve, strict=True)
    ]
    summary = expected_summary(state)
    last = EPOCHS * STEPS_PER_EPOCH
    for name, value in summary.items():
        assert scalars(reader, f"summary/{name}") == [(last, float32(value))]  # once
    parts = ("data", "forward_backward", "exchange", "optimizer", "idle")
    ranks = {split.rank for split in training[-1].step_split}
    assert scalars(reader, "step/slowest/data") == [
        (expected_step(e), float32(e.slowest.per_step()["data"]))
        for e in training
        if e.done and e.slowest is not None
    ]
    assert set(reader.Tags()["scalars"]) == {
        "train/running_loss",
        "train/examples_per_second",
        "train/loss",
        "valid/loss",
        "valid/examples_per_second",
        *(f"summary/{name}" for name in summary),
        *(f"step/slowest/{part}" for part in parts),
        *(f"step/rank_{rank}/{part}" for rank in ranks for part in parts),
    }
    hyperparameters = tensorboard_hyperparameters(reader)
    assert hyperparameters == {**FLAT_HYPERPARAMETERS, "optimizer/nesterov": 0.0}  # a number


@ASYNCIO
async def test_mlflow_holds_one_run_with_params_and_metrics(mlflow_store: str) -> None:
    tracker = trackers.MlflowTracker(
        tracking_uri=mlflow_store, experiment_name="digits", run_name="first", tags={"team": "a"}
    )
    assert tracker.run_id is None
    async with tracker:
        state, seen = await train(tracker)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store)
    experiment = client.get_experiment_by_name("digits")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == tracker.run_id
    assert (run.info.run_name, run.info.status) == ("first", "FINISHED")
    assert run.data.tags["team"] == "a"
    assert run.data.params == {name: str(value) for name, value in FLAT_HYPERPARAMETERS.items()}

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    training = [e for e in seen if e.kind == "train"]
    assert history("train/running_loss") == [(expected_step(e), e.loss) for e in training]
    assert history("train/loss") == [
        (STEPS_PER_EPOCH * (p.epoch + 1), p.training_loss) for p in state.learning_curve
    ]
    assert history("valid/loss") == [
        (STEPS_PER_EPOCH * (p.epoch + 1), p.validation_loss) for p in state.learning_curve
    ]
    last = EPOCHS * STEPS_PER_EPOCH
    for name, value in expected_summary(state).items():
        assert history(f"summary/{name}") == [(last, value)]  # once


@ASYNCIO
async def test_json_lines_hold_each_event_and_the_records_once(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "run.jsonl"
    async with trackers.JsonLinesTracker(path) as tracker:
        state, seen = await train(tracker, metrics=True)
    records = read_json_lines(path)
    assert records[0] == {"record": "hyperparameters", "hyperparameters": FLAT_HYPERPARAMETERS}
    assert records[-1] == {
        "record": "summary",
        "global_step": EPOCHS * STEPS_PER_EPOCH,
        "summary": expected_summary(state),
    }
    assert [r["record"] for r in records[1:-1]] == ["event"] * len(seen)
    check_event_records(records[1:-1], seen)


@ASYNCIO
async def test_csv_tables_hold_each_event_and_the_records(tmp_path: Path) -> None:
    async with trackers.CsvTracker(tmp_path / "csv") as tracker:
        state, seen = await train(tracker, metrics=True)
    check_event_records(read_csv(tmp_path / "csv" / "events.csv"), seen)
    hyperparameters = read_csv(tmp_path / "csv" / "hyperparameters.csv")
    assert {row["name"]: row["value"] for row in hyperparameters} == {
        name: str(value) for name, value in FLAT_HYPERPARAMETERS.items()
    }
    summary = {
        row["name"]: float(row["value"]) for row in read_csv(tmp_path / "csv" / "summary.csv")
    }
    assert summary == {"global_step": EPOCHS * STEPS_PER_EPOCH, **expected_summary(state)}


# Opening, closing and what may be called when


def every_sink(directory: Path, mlflow_uri: str | None = None) -> dict[str, trackers.Tracker]:
    sinks: dict[str, trackers.Tracker] = {
        "jsonl": trackers.JsonLinesTracker(directory / "run.jsonl"),
        "csv": trackers.CsvTracker(directory / "csv"),
        "tensorboard": trackers.TensorBoardTracker(directory / "tb"),
    }
    if mlflow_uri is not None:
        sinks["mlflow"] = trackers.MlflowTracker(tracking_uri=mlflow_uri)
    return sinks


def events_written(sink: str, directory: Path) -> list[tuple[int, float]]:
    """(global step, loss) of the training events a sink wrote."""
    if sink == "jsonl":
        records = read_json_lines(directory / "run.jsonl")
        return [(r["global_step"], r["loss"]) for r in records if r["record"] == "event"]
    if sink == "csv":
        rows = read_csv(directory / "csv" / "events.csv")
        return [(int(r["global_step"]), float(r["loss"])) for r in rows]
    return scalars(read_tensorboard(directory / "tb"), "train/running_loss")


@pytest.mark.parametrize("ending", ["error", "cancellation"])
@pytest.mark.parametrize("sink", ["jsonl", "csv", "tensorboard"])
async def test_a_sink_is_flushed_and_closed_on_error_and_cancellation(
    tmp_path: Path, sink: str, ending: str
) -> None:
    if sink == "tensorboard":
        pytest.importorskip("tensorboard")
    tracker = every_sink(tmp_path)[sink]
    sent = [event(0, 1), event(0, 2)]  # within a pass: nothing has flushed them yet
    with anyio.CancelScope() as scope:
        with pytest.raises(ZeroDivisionError) if ending == "error" else nullcontext():
            async with tracker:
                await tracker.log_hyperparameters({"lr": 0.1})
                for each in sent:
                    await tracker(each)
                if ending == "error":
                    raise ZeroDivisionError("the training failed")
                scope.cancel()
                await anyio.sleep_forever()
    assert scope.cancelled_caught == (ending == "cancellation")
    want = [(e.step, e.loss) for e in sent]
    written = events_written(sink, tmp_path)
    assert written == ([(s, float32(v)) for s, v in want] if sink == "tensorboard" else want)
    assert open_files_under(tmp_path) == []
    assert tensorboard_writer_threads() == []


@pytest.mark.parametrize("sink", ["jsonl", "csv", "tensorboard"])
async def test_each_pass_end_is_written_while_the_run_goes_on(
    tmp_path: Path, sink: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass's end is on disk before the next pass starts, and within a pass the events
    are written every ``FLUSH_INTERVAL`` seconds (0 here: at every event)."""
    if sink == "tensorboard":
        pytest.importorskip("tensorboard")
    sent = [event(0, 1), event(0, 3, done=True)]
    want = [(e.step, float32(e.loss) if sink == "tensorboard" else e.loss) for e in sent]
    async with every_sink(tmp_path)[sink] as tracker:
        for each in sent:
            await tracker(each)
        assert await anyio.to_thread.run_sync(events_written, sink, tmp_path) == want
        monkeypatch.setattr("lampdist.trackers._base.FLUSH_INTERVAL", 0.0)
        await tracker(event(1, 1))
        written = await anyio.to_thread.run_sync(events_written, sink, tmp_path)
        assert [step for step, _ in written] == [1, 3, 4]


async def test_a_tracker_cancelled_while_opening_is_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancellation comes while the worker thread opens the writer: the tracker still
    closes it (its thread ends) once open."""
    summary_writer = pytest.importorskip("torch.utils.tensorboard").SummaryWriter
    opening = summary_writer.__init__
    opened = threading.Event()

    def slow_open(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.3)
        opening(*args, **kwargs)
        opened.set()

    monkeypatch.setattr(summary_writer, "__init__", slow_open)
    with anyio.move_on_after(0.05) as scope:
        async with trackers.TensorBoardTracker(tmp_path / "tb"):
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert await anyio.to_thread.run_sync(opened.wait, 30)  # the writer was opened
    assert tensorboard_writer_threads() == []


@pytest.mark.parametrize(
    ("ending", "status"),
    [("success", "FINISHED"), ("error", "FAILED"), ("cancellation", "KILLED")],
)
async def test_mlflow_ends_the_run_with_its_outcome_after_the_last_flush(
    mlflow_store: str, ending: str, status: str
) -> None:
    tracker = trackers.MlflowTracker(tracking_uri=mlflow_store)
    with anyio.CancelScope() as scope:
        with pytest.raises(ZeroDivisionError) if ending == "error" else nullcontext():
            async with tracker:
                await tracker(event(0, 1))
                await tracker(event(0, 2))
                if ending == "error":
                    raise ZeroDivisionError("the training failed")
                if ending == "cancellation":
                    scope.cancel()
                    await anyio.sleep_forever()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store)
    assert tracker.run_id is not None
    run = client.get_run(tracker.run_id)
    assert run.info.status == status
    history = client.get_metric_history(tracker.run_id, "train/running_loss")
    assert sorted(m.step for m in history) == [1, 2]


async def test_hyperparameters_and_summary_are_logged_once(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    async with trackers.JsonLinesTracker(path) as tracker:
        await tracker.log_hyperparameters({"lr": 0.1})
        with pytest.raises(lampdist.ConfigError, match="log_hyperparameters was called twice"):
            await tracker.log_hyperparameters({"lr": 0.2})
        await tracker.log_summary(lampdist.LoopState(epoch=1))
        with pytest.raises(lampdist.ConfigError, match="log_summary was called twice"):
            await tracker.log_summary(lampdist.LoopState(epoch=2))
    kinds = [record["record"] for record in read_json_lines(path)]
    assert kinds == ["hyperparameters", "summary"]


async def test_a_tracker_records_only_while_open(tmp_path: Path) -> None:
    tracker = trackers.CsvTracker(tmp_path / "csv")
    with pytest.raises(lampdist.ConfigError, match=r"not open: use 'async with CsvTracker"):
        await tracker(event(0, 1))
    async with tracker:
        await tracker(event(0, 1, done=True))
    with pytest.raises(lampdist.ConfigError, match="is closed") as closed:
        await tracker.log_summary(lampdist.LoopState())
    assert closed.value.phase == "track"
    with pytest.raises(lampdist.ConfigError, match="opened before: create a new one"):
        async with tracker:
            pass
    assert len(read_csv(tmp_path / "csv" / "events.csv")) == 1


def test_first_step_must_be_a_count() -> None:
    with pytest.raises(lampdist.ConfigError, match="first_step must be an int >= 0"):
        trackers.JsonLinesTracker("run.jsonl", first_step=-1)


@pytest.mark.parametrize(
    ("create", "package", "extra"),
    [
        (lambda d: trackers.TensorBoardTracker(d / "tb"), "tensorboard", "tensorboard"),
        (lambda d: trackers.MlflowTracker(tracking_uri=f"file://{d}/mlruns"), "mlflow", "mlflow"),
    ],
)
async def test_a_missing_package_says_which_extra_to_install(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    create: Callable[[Path], trackers.Tracker],
    package: str,
    extra: str,
) -> None:
    with suppress(ImportError):  # torch's writer imported before must not hide the package
        importlib.import_module("torch.utils.tensorboard")
    monkeypatch.setitem(sys.modules, package, None)
    tracker = create(tmp_path)  # creating imports nothing
    with pytest.raises(lampdist.ConfigError, match=rf'pip install "lampdist\[{extra}\]"') as caught:
        async with tracker:
            pass
    assert caught.value.phase == "configure"
    assert not any(tmp_path.iterdir())  # noqa: ASYNC240  # a test's check, not its work


@pytest.fixture
def off_the_loop(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Patches the sinks' blocking calls to note each one made on an event loop's thread."""
    on_loop: list[str] = []

    def watch(owner: Any, name: str) -> None:
        blocking = getattr(owner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if on_event_loop_thread():
                on_loop.append(name)
            return blocking(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)

    from lampdist.trackers import _files

    watch(_files, "_append_text")
    watch(_files, "_write_text")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        pass
    else:
        for name in ("__init__", "add_scalar", "flush", "close"):
            watch(SummaryWriter, name)
    return on_loop


async def test_sinks_write_in_worker_threads(tmp_path: Path, off_the_loop: list[str]) -> None:
    pytest.importorskip("tensorboard")
    async with trackers.fan_out(*every_sink(tmp_path).values()) as tracker:
        await tracker.log_hyperparameters({"lr": 0.1})
        await tracker(event(0, 1))
        await tracker(event(0, 3, done=True))
        await tracker.log_summary(lampdist.LoopState(epoch=1))
    assert events_written("jsonl", tmp_path) == [(1, event(0, 1).loss), (3, event(0, 3).loss)]
    assert off_the_loop == []


# Several trackers as one


async def test_fan_out_gives_every_tracker_everything(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    async with trackers.fan_out(
        trackers.JsonLinesTracker(first), trackers.JsonLinesTracker(second)
    ) as tracker:
        await tracker.log_hyperparameters({"lr": 0.1})
        await tracker(event(0, 1))
        await tracker.log_summary(lampdist.LoopState(epoch=1))
    assert read_json_lines(first) == read_json_lines(second)
    assert [r["record"] for r in read_json_lines(first)] == ["hyperparameters", "event", "summary"]


async def test_fan_out_closes_the_open_trackers_when_one_fails_to_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    opened = trackers.JsonLinesTracker(tmp_path / "run.jsonl")
    with pytest.raises(lampdist.ConfigError, match="tensorboard"):
        async with trackers.fan_out(opened, trackers.TensorBoardTracker(tmp_path / "tb")):
            pass
    with pytest.raises(lampdist.ConfigError, match="is closed"):
        await opened(event(0, 1))


# A resumed run


async def test_a_resumed_run_continues_the_global_step_in_tensorboard(tmp_path: Path) -> None:
    """The first run checkpointed epoch 0 (3 steps) and logged 2 steps of epoch 1 before
    it stopped; the resumed run starts at step 3, and TensorBoard keeps the first run's
    steps up to 3 (its validation at step 3 included) and the resumed run's after."""
    pytest.importorskip("tensorboard")
    log_dir = tmp_path / "tb"
    async with trackers.TensorBoardTracker(log_dir) as first:
        for each in [event(0, 1), event(0, 3, done=True), event(0, 3, done=True, kind="valid")]:
            await first(each)
        await first(event(1, 1))
        await first(event(1, 2))
    # TensorBoard reads a directory's event files in the order of their names, which start
    # with the second they were created in: a resumed run is a later process, so a later one.
    await anyio.sleep(1.01 - time.time() % 1)
    async with trackers.TensorBoardTracker(log_dir, first_step=3) as resumed:
        for each in [event(1, 2), event(1, 3, done=True), event(1, 3, done=True, kind="valid")]:
            await resumed(each)
    reader = read_tensorboard(log_dir)
    assert scalars(reader, "train/running_loss") == [
        (1, float32(event(0, 1).loss)),
        (3, float32(event(0, 3).loss)),
        (5, float32(event(1, 2).loss)),
        (6, float32(event(1, 3).loss)),
    ]
    assert [step for step, _ in scalars(reader, "valid/loss")] == [3, 6]


def test_the_metrics_of_a_pass_end_are_scalars_of_their_own() -> None:
    from lampdist.trackers._base import event_scalars

    def event(kind: Literal["train", "valid"], done: bool, **metrics: Any) -> lampdist.PassEvent:
        return lampdist.PassEvent(
            epoch=0,
            kind=kind,
            pass_index=0,
            step=3,
            batches=3,
            total_batches=3,
            examples=30,
            loss=0.5,
            seconds=1.0,
            done=done,
            metrics=metrics,
        )

    running = event("train", False)
    end = event("valid", True, accuracy=0.75, per_class=(1.0, 0.5))
    assert "train/accuracy" not in event_scalars(running)
    scalars = event_scalars(end)
    assert scalars["valid/accuracy"] == 0.75
    assert (scalars["valid/per_class/0"], scalars["valid/per_class/1"]) == (1.0, 0.5)
    assert scalars["valid/loss"] == 0.5


def test_a_recovery_takes_back_the_steps_of_the_pass_it_redoes() -> None:
    """A follower lost during the snapshot after pass 0: pass 0 ended, then the recovery's
    event, then pass 0 again. The redone pass's events keep their global steps, the next
    pass's follow on as if the pass had run once, and the recovery is its own scalars."""
    from lampdist.trackers._base import StepClock, event_scalars

    clock = StepClock()
    first = [clock.advance(event(0, step, done=step == 3)) for step in (1, 2, 3)]
    recovered = lampdist.PassEvent(
        epoch=0,
        kind="train",
        pass_index=0,
        step=0,
        batches=0,
        total_batches=None,
        examples=0,
        loss=float("nan"),
        seconds=1.5,
        done=False,
        recovered=lampdist.Recovered(
            ranks=(2,),
            phase="checkpoint",
            epoch=0,
            pass_index=0,
            seconds=1.5,
            rejoin_seconds=1.2,
            recoveries=1,
            reason="rank 2: PeerDisconnected",
        ),
    )
    assert clock.advance(recovered) == 0
    again = [clock.advance(event(0, step, done=step == 3)) for step in (1, 2, 3)]
    assert again == first == [1, 2, 3]
    assert clock.advance(event(1, 1)) == 4
    assert event_scalars(recovered) == {"recovery/seconds": 1.5, "recovery/recoveries": 1.0}


def test_going_back_to_a_checkpoint_takes_back_the_steps_of_every_pass_after_it() -> None:
    """fsdp without its replica: epochs 0 to 2 trained, a loss in epoch 3 went back to the
    checkpoint of epoch 0 (the recovery's pass_index, 2, is the first pass run again): the
    steps of epochs 1 and 2 are taken back and their redone events keep their steps."""
    from lampdist.trackers._base import StepClock

    clock = StepClock()
    first = [
        clock.advance(event(epoch, step, done=step == 2)) for epoch in (0, 1, 2) for step in (1, 2)
    ]
    recovered = lampdist.Recovered(
        ranks=(1,),
        phase="train",
        epoch=3,
        pass_index=2,
        seconds=1.0,
        rejoin_seconds=1.0,
        recoveries=1,
        reason="rank 1: PeerDisconnected",
        checkpoint_epoch=0,
    )
    assert clock.advance(lampdist._state.as_pass_event(recovered)) == 2
    again = [
        clock.advance(event(epoch, step, done=step == 2)) for epoch in (1, 2) for step in (1, 2)
    ]
    assert again == first[2:] == [3, 4, 5, 6]
