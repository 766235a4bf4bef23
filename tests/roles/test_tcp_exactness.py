"""Two processes over TCP train exactly like one process on the concatenated batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import tcp_rank
from .reference import make_model, make_shards, reference_training

ROOT_DIR = Path(__file__).resolve().parents[2]


def spawn(rank: int, nranks: int, out: Path, port: int = 0) -> subprocess.Popen[str]:
    env = {**os.environ, "LAMPDIST_SECRET": "test-secret", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.roles.tcp_rank", "--rank", str(rank)]
        + ["--nranks", str(nranks), "--port", str(port), "--out", str(out)],
        cwd=ROOT_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_match_the_reference(tmp_path: Path) -> None:
    root = spawn(0, 2, tmp_path)
    follower = None
    try:
        assert root.stdout is not None
        line = root.stdout.readline()
        assert line.startswith("PORT "), line + (root.stderr.read() if root.stderr else "")
        follower = spawn(1, 2, tmp_path, port=int(line.split()[1]))
        _, root_err = root.communicate(timeout=60)
        _, follower_err = follower.communicate(timeout=60)
    finally:
        for process in (root, follower):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert root.returncode == 0, root_err
    assert follower is not None and follower.returncode == 0, follower_err

    expected, train_losses, valid_losses = reference_training(
        make_model(seed=0),
        tcp_rank.sgd,
        make_shards(tcp_rank.SIZES, seed=1),
        make_shards(tcp_rank.VALID_SIZES, seed=2),
        epochs=tcp_rank.EPOCHS,
        accumulate=tcp_rank.ACCUMULATE,
    )
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, want in expected.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-9, msg=name)
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert [c[0] for c in curve] == pytest.approx(train_losses, rel=1e-9)
    assert [c[1] for c in curve] == pytest.approx(valid_losses, rel=1e-9)
