"""``lampdist demo`` end to end, as a user runs it: subprocesses, real files, real signals."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from rich.console import Console

from lampdist import ConfigError, LoopState, PassEvent
from lampdist._epoch._clock import PARTS
from lampdist.cli._data import create_model, load_digits
from lampdist.cli._demo import DemoOptions, DemoResult, choose_launch, run_demo
from lampdist.cli._demo import _prepare as prepare
from lampdist.cli._progress import PassCounter, read_metrics
from lampdist.cli._summary import summary_lines

ROOT_DIR = Path(__file__).resolve().parents[2]


def environment(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT_DIR / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the demo runs on asyncio (anyio.run's default)


def start_demo(*args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "lampdist", "demo", *args],
        cwd=cwd,
        env=environment(LAMPDIST_SECRET="demo-test"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_demo_trains_writes_its_files_and_resumes(tmp_path: Path) -> None:
    out, tensorboard = tmp_path / "run", tmp_path / "tb"
    flags = ["--epochs", "2", "--out", str(out), "--tensorboard", str(tensorboard)]
    first = await anyio.run_process(
        [sys.executable, "-m", "lampdist", "demo", *flags],
        cwd=tmp_path,
        env=environment(),
        check=False,
    )
    stdout, stderr = first.stdout.decode(), first.stderr.decode()
    assert first.returncode == 0, stderr
    accuracy = re.search(r"validation accuracy ([\d.]+)%", stdout)
    assert accuracy is not None, stdout
    assert float(accuracy.group(1)) > 50  # chance is 10%
    assert "2 epochs (1-2) on 2 ranks (cpu)" in stdout
    assert "epoch 2/2 valid" in stderr  # plain log lines: stdout is no terminal here
    metrics = read_metrics(out / "metrics.jsonl")
    assert [(m["epoch"], m["kind"]) for m in metrics] == [
        (0, "train"),
        (0, "valid"),
        (1, "train"),
        (1, "valid"),
    ]
    assert all(0 <= m["metrics"]["accuracy"] <= 1 for m in metrics)  # training passes too
    assert metrics[1]["examples"] == 359  # the whole validation split, over both ranks
    for line in metrics[::2]:  # a training pass's telemetry, on a CPU without a peak
        assert line["mfu"] is None
        assert line["grad_norm"] > 0 and line["grad_norm_max"] >= line["grad_norm"]
        split = line["step_split"]
        assert [rank["rank"] for rank in split["ranks"]] == [0, 1]
        assert split["slowest"] in split["ranks"]
        assert all(rank["steps"] == line["batches"] for rank in split["ranks"])
        seconds = sum(split["slowest"][part] for part in PARTS)
        assert 0 < seconds <= line["seconds"] * 1.05
    assert all("step_split" not in line for line in metrics[1::2])  # validation passes
    assert re.search(r"grad norm [\d.e+-]+ \(max [\d.e+-]+\); ms a step on rank \d", stderr)
    assert (out / "learning_curve.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "checkpoints" / "epoch-000002").is_dir()
    state = torch.load(out / "model.pt", weights_only=True)
    assert state["0.weight"].shape == (128, 64)

    assert f"tensorboard --logdir {tensorboard}" in stdout

    # --resume, in this process (what the command runs after parsing its flags)
    await anyio.sleep(1.01 - time.time() % 1)  # a later event file (see test_trackers.py)
    options = DemoOptions(epochs=3, resume=True, out=out, tensorboard=tensorboard)
    resumed = await run_demo(options, Console(file=io.StringIO()), environ={})
    assert resumed is not None
    assert (resumed.first_epoch, resumed.state.epoch) == (2, 3)
    assert len(resumed.state.learning_curve) == 3  # the history came back with the checkpoint
    assert "1 epoch (3-3) on 2 ranks (cpu)" in summary_lines(resumed)[0]
    epochs = [m["epoch"] for m in read_metrics(out / "metrics.jsonl")]
    assert epochs == [0, 0, 1, 1, 2, 2]
    # the reported accuracy is the best epoch's validation metric, and that is the accuracy
    # of the model the run ends with on the whole validation split, computed in one piece
    state = resumed.state
    best = state.min_validation_epoch
    assert best is not None
    accuracies = [p.metrics["validation_accuracy"] for p in state.learning_curve]
    assert accuracies[best] == max(accuracies) == resumed.accuracy
    assert f"best epoch {best + 1} (validation accuracy" in "\n".join(summary_lines(resumed))
    data = load_digits(0)
    module = create_model(0)
    module.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    with torch.no_grad():
        right = (module(data.valid_inputs).argmax(dim=1) == data.valid_labels).double().mean()
    assert resumed.accuracy == pytest.approx(float(right), abs=1e-12)
    # the TensorBoard scalars of both runs: the steps go on across the resume
    check_tensorboard(tensorboard, read_metrics(out / "metrics.jsonl"))


def check_tensorboard(log_dir: Path, metrics: list[dict[str, Any]]) -> None:
    """The passes' losses in ``log_dir`` are those of ``metrics`` (the demo's file), at
    the global steps: the root's batch count of a training pass is its steps."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    reader = accumulator.EventAccumulator(str(log_dir), size_guidance={accumulator.SCALARS: 0})
    reader.Reload()
    steps = metrics[0]["batches"]

    def passes(kind: str) -> list[tuple[int, float]]:
        return [
            (steps * (m["epoch"] + 1), float(np.float32(m["loss"])))
            for m in metrics
            if m["kind"] == kind
        ]

    assert [(s.step, s.value) for s in reader.Scalars("train/loss")] == passes("train")
    assert [(s.step, s.value) for s in reader.Scalars("valid/loss")] == passes("valid")
    running = [s.step for s in reader.Scalars("train/running_loss")]
    assert running == sorted(set(running))
    assert [s.value for s in reader.Scalars("summary/epochs")][-1] == max(
        m["epoch"] + 1 for m in metrics
    )


async def test_a_resumed_demo_ends_bitwise_like_an_uninterrupted_one(tmp_path: Path) -> None:
    """The demo shuffles its training batches with each pass's generator, so a run resumed
    at epoch 2 draws the orders an uninterrupted one drew."""
    quiet = Console(file=io.StringIO())
    whole, split = tmp_path / "whole", tmp_path / "split"
    await run_demo(DemoOptions(epochs=3, out=whole), quiet, environ={})
    await run_demo(DemoOptions(epochs=2, out=split), quiet, environ={})
    await run_demo(DemoOptions(epochs=3, out=split, resume=True), quiet, environ={})
    want = torch.load(whole / "model.pt", weights_only=True)
    got = torch.load(split / "model.pt", weights_only=True)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


async def test_a_new_run_refuses_to_overwrite_one(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "epoch-000001").mkdir(parents=True)
    with pytest.raises(ConfigError, match="already holds a run: pass --resume"):
        await prepare(tmp_path, resume=False)
    assert await prepare(tmp_path / "new", resume=True) is None  # nothing to resume: start anew


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("signum", "to_every_rank"),
    [
        (signal.SIGTERM, False),  # a scheduler's SIGTERM to the root
        (signal.SIGINT, True),  # Ctrl-C in a terminal, or torchrun forwarding it: every rank
    ],
)
def test_ranks_in_separate_processes_and_a_graceful_stop_on_a_signal(
    tmp_path: Path, signum: signal.Signals, to_every_rank: bool
) -> None:
    out = tmp_path / "run"
    flags = ["--nranks", "2", "--port", str(free_port()), "--epochs", "10000", "--out", str(out)]
    root = start_demo("--role", "root", *flags, cwd=tmp_path)
    follower = start_demo("--role", "follower", "--rank", "1", *flags, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while len(read_metrics(out / "metrics.jsonl")) < 3:  # one epoch and its checkpoint done
            assert root.poll() is None and follower.poll() is None, "a rank ended early"
            assert time.monotonic() < deadline, "the ranks made no progress"
            time.sleep(0.1)
        root.send_signal(signum)
        if to_every_rank:
            follower.send_signal(signum)
        _, root_err = root.communicate(timeout=30)
        _, follower_err = follower.communicate(timeout=30)
    finally:
        for process in (root, follower):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert root.returncode == 128 + signum, root_err
    assert f"stopped by {signum.name}; continue with: lampdist demo --resume" in root_err
    # the root finished its epoch and checkpointed it, then stopped the follower in order
    assert follower.returncode == 0, follower_err
    assert "Traceback" not in root_err + follower_err
    metrics = read_metrics(out / "metrics.jsonl")
    newest = max(int(path.name.split("-")[1]) for path in (out / "checkpoints").glob("epoch-*"))
    assert newest == 1 + max(m["epoch"] for m in metrics)  # the last epoch begun was committed


def test_the_demo_writes_tensorboard_on_the_root_only(tmp_path: Path) -> None:
    """Ranks in separate processes, each given --tensorboard: the root writes the event
    files during its run; the follower opens no tracker."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    flags = ["--nranks", "2", "--port", str(free_port()), "--epochs", "2", "--out", str(out)]
    root = start_demo("--role", "root", *flags, "--tensorboard", "tb-root", cwd=tmp_path)
    follower = start_demo(
        "--role", "follower", "--rank", "1", *flags, "--tensorboard", "tb-follower", cwd=tmp_path
    )
    try:
        _, root_err = root.communicate(timeout=120)
        _, follower_err = follower.communicate(timeout=30)
    finally:
        for process in (root, follower):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert (root.returncode, follower.returncode) == (0, 0), root_err + follower_err
    check_tensorboard(tmp_path / "tb-root", read_metrics(out / "metrics.jsonl"))
    assert not (tmp_path / "tb-follower").exists()


def test_choose_launch_from_role_flags() -> None:
    options = DemoOptions(role="follower", rank=1, nranks=3, host="10.0.0.5", port=4000)
    launch = choose_launch(options, {"LAMPDIST_SECRET": "s", "RANK": "7"})
    assert launch is not None
    assert (launch.rank, launch.nranks, launch.host, launch.port) == (1, 3, "10.0.0.5", 4000)
    assert launch.device == torch.device("cpu")


def test_choose_launch_under_torchrun_and_here() -> None:
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    launch = choose_launch(DemoOptions(), {**torchrun, "LAMPDIST_SECRET": "s"})
    assert launch is not None and (launch.rank, launch.port) == (0, 29501)
    assert choose_launch(DemoOptions(), {"PATH": "/bin"}) is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (DemoOptions(role="root", rank=1, nranks=2, port=1), "the root is rank 0"),
        (DemoOptions(role="follower", rank=1, nranks=2), "--role needs --nranks and --port"),
        (DemoOptions(role="follower", rank=1, nranks=2, port=1), "LAMPDIST_SECRET"),
    ],
)
def test_choose_launch_refuses_bad_flags(options: DemoOptions, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        choose_launch(options, {})


def event(pass_index: int, batches: int, seconds: float) -> PassEvent:
    return PassEvent(
        epoch=0,
        kind="train",
        pass_index=pass_index,
        step=batches,
        batches=batches,
        total_batches=10,
        examples=batches * 8,
        loss=1.0,
        seconds=seconds,
        done=False,
    )


def test_pass_counter_counts_batches_across_passes() -> None:
    counter = PassCounter(first_epoch=1, epochs=3, batches_per_epoch=12)
    assert counter.total == 24 and counter.eta() is None
    counter.advance(event(0, 4, 0.5))
    counter.advance(event(0, 10, 1.0))
    counter.advance(event(1, 2, 0.1))
    assert counter.done == 12
    eta = counter.eta()
    assert eta is not None and eta > 0


def test_the_summary_of_one_rank_and_one_epoch_is_singular(tmp_path: Path) -> None:
    """The summary counts epochs from 1, as the progress does: the run's epoch 0 is "1-1"."""
    result = DemoResult(
        state=LoopState(epoch=1),
        accuracy=0.5,
        seconds=1.0,
        nranks=1,
        device="cpu",
        out=tmp_path,
        first_epoch=0,
    )
    assert summary_lines(result)[0] == "1 epoch (1-1) on 1 rank (cpu) in 1.0 s"


def test_metrics_lines_are_json(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"epoch": 0}) + "\n\n" + json.dumps({"epoch": 1}) + "\n")
    assert read_metrics(path) == [{"epoch": 0}, {"epoch": 1}]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_a_stop_before_the_first_checkpoint_offers_nothing_to_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    flags = ["--nranks", "2", "--port", str(free_port()), "--out", str(out)]
    root = start_demo("--role", "root", *flags, cwd=tmp_path)  # its follower never comes
    try:
        # Past the imports and the data (a fixed sleep was too short on a loaded machine):
        # the demo logs this line just before it starts the run; the command handles signals
        # from its start, so one sent right after the line is not lost.
        assert root.stderr is not None
        seen: list[str] = []
        while not any("training on 2 ranks" in line for line in seen):
            line = root.stderr.readline()
            assert line, "".join(seen)  # the demo ended before it started training
            seen.append(line)
        assert root.poll() is None, root.communicate()[1]
        root.send_signal(signal.SIGINT)
        _, rest = root.communicate(timeout=90)  # the join has Timeouts.stop (30 s) to end
        err = "".join(seen) + rest
    finally:
        if root.poll() is None:
            root.kill()
            root.wait()
    assert root.returncode == 128 + signal.SIGINT, err
    assert "stopped by SIGINT before the first checkpoint: nothing to resume" in err
    assert "--resume" not in err
    assert "Traceback" not in err
