"""A step-based run between processes, killed mid-window and resumed: every rank goes on with
its next batch and its own RNG state (dropout on every rank), bitwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .test_tcp_exactness import ROOT_DIR

pytest.importorskip("torchdata.stateful_dataloader")


def _spawn(
    rank: int, out: Path, checkpoints: Path, port: int, *extra: str
) -> subprocess.Popen[str]:
    env = {**os.environ, "LAMPDIST_SECRET": "test-secret", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.roles.steps_rank", "--rank", str(rank), "--nranks", "2"]
        + ["--port", str(port), "--out", str(out), "--checkpoints", str(checkpoints), *extra],
        cwd=ROOT_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(out: Path, checkpoints: Path, *extra: str) -> tuple[int, int, str]:
    """Both ranks to their end: their exit codes and the root's stderr."""
    out.mkdir(parents=True, exist_ok=True)
    root = _spawn(0, out, checkpoints, 0, *extra)
    follower = None
    try:
        assert root.stdout is not None
        line = root.stdout.readline()
        assert line.startswith("PORT "), line + (root.stderr.read() if root.stderr else "")
        follower = _spawn(1, out, checkpoints, int(line.split()[1]), *extra)
        _, root_err = root.communicate(timeout=90)
        follower.communicate(timeout=90)
    finally:
        for process in (root, follower):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert follower is not None
    return root.returncode, follower.returncode, root_err


@pytest.mark.slow
@pytest.mark.parametrize("step_on", ["every_rank", "fsdp"])
def test_two_processes_killed_mid_window_resume_bitwise(tmp_path: Path, step_on: str) -> None:
    """Windows of steps over stateful loaders, a per-step schedule, dropout: a run killed in
    the middle of a window resumes from its checkpoint to the uninterrupted run's weights,
    bitwise (under fsdp: every rank's shards)."""
    design = ("--step-on", step_on)
    whole = _run(tmp_path / "whole", tmp_path / "whole-checkpoints", *design)
    assert whole[:2] == (0, 0), whole[2]
    # Rank 1's 6th batch is the second of epoch 2: the run dies in the middle of a window.
    crashed = _run(tmp_path / "crashed", tmp_path / "checkpoints", "--crash-after", "5", *design)
    assert crashed[0] != 0 and crashed[1] != 0
    assert "crashes after 5 batches" in crashed[2]
    resumed = _run(tmp_path / "resumed", tmp_path / "checkpoints", "--resume", *design)
    assert resumed[:2] == (0, 0), resumed[2]
    for rank in range(2):
        want = torch.load(tmp_path / "whole" / f"rank{rank}.pt", weights_only=True)
        got = torch.load(tmp_path / "resumed" / f"rank{rank}.pt", weights_only=True)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (rank, name)
