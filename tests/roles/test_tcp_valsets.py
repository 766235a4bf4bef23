"""Two processes over TCP, one script for both ranks: two validation sets validated before
training, then an evaluation-only run of the checkpoint, each set's loss exact."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lampdist import checkpoint

from .reference import make_model
from .test_local_valsets import reference_loss, set_shards

ROOT_DIR = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_both(out: Path, mode: str) -> None:
    env = {**os.environ, "LAMPDIST_SECRET": "test-secret", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.roles.valsets_rank", "--rank", str(rank)]
            + ["--port", str(port), "--out", str(out), mode],
            cwd=ROOT_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        errors = [p.communicate(timeout=90)[1] for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, error in zip(processes, errors, strict=True):
        assert process.returncode == 0, error


def test_two_sets_validated_before_training_then_evaluated(tmp_path: Path) -> None:
    run_both(tmp_path, "train")
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert [point[0] for point in curve] == [-1, 0, 1]
    initial = {name: reference_loss(make_model(), shards) for name, shards in set_shards().items()}
    _, loss, metrics = curve[0]
    assert loss == metrics["validation_near_loss"]
    for name, value in initial.items():
        assert metrics[f"validation_{name}_loss"] == pytest.approx(value, rel=1e-12)
    run_both(tmp_path, "evaluate")
    resumed = checkpoint.load_latest(tmp_path / "ckpt")
    assert resumed is not None
    module = make_model()
    module.load_state_dict(resumed.training_state.model_state)
    want = {name: reference_loss(module, shards) for name, shards in set_shards().items()}
    evaluations = [json.loads((tmp_path / f"eval{r}.json").read_text()) for r in (0, 1)]
    assert evaluations[0] == evaluations[1]  # the same on every rank
    assert evaluations[0]["losses"] == {n: pytest.approx(v, rel=1e-12) for n, v in want.items()}
    assert evaluations[0]["examples"] == {"near": 12, "far": 9}
    last = curve[-1][2]  # the checkpoint's model is the last epoch's
    assert evaluations[0]["losses"]["far"] == pytest.approx(last["validation_far_loss"], rel=1e-12)
