"""Failures under the real torchrun, as a user of the README's script sees them: which rank
torchrun names as the root cause, each rank's exit code, the last line each rank prints, and
no rank left to torchrun's SIGKILL after its 30 s grace period.

Each case starts ``torchrun --standalone --nproc-per-node 2 torchrun_rank.py`` with one
fault (see that script) and ``--redirects 3``, so that each rank's stderr lands in a file of
its own. The times from the fault to the end of the job are printed (``pytest -s``); the
assertions are about outcomes, not speed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import pytest

import lampdist

ROOT_DIR = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("torchrun_rank.py")
SOURCE = Path(lampdist.__file__).resolve().parents[1]
SIGKILLED = -9
ENDED_BY_SIGTERM = (143, -15, 1)
"""A joining rank that torchrun's SIGTERM ended at once: 143 once lampdist's signal handling
is up (the README's script exits 128 + 15), -15 before it (Python's default action), or 1
when it saw the root's channel close first. The outcome these tests rule out is -9:
torchrun's SIGKILL after its 30 s grace period."""


@attrs.frozen
class Job:
    """What one torchrun job left behind."""

    returncode: int
    exitcodes: dict[int, int]
    """Each failed rank's exit code, from torchrun's summary (a rank that exited 0 is absent)."""
    root_cause: int | None
    stderr: dict[int, str]
    torchrun_stderr: str
    after_fault: float | None
    """Seconds from the fault (the time the faulty rank noted before it acted; else the first
    line naming an error in any rank's stderr) to the job's end."""

    def last_line(self, rank: int) -> str:
        lines = [line for line in self.stderr[rank].splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def explain(self) -> str:
        ranks = "\n".join(f"--- rank {r} ---\n{text[-3000:]}" for r, text in self.stderr.items())
        return f"{ranks}\n--- torchrun ---\n{self.torchrun_stderr[-3000:]}"


def run_job(tmp_path: Path, *args: str, nranks: int = 2, timeout: float = 120) -> Job:
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir(parents=True)
    env = {
        **os.environ,
        "LAMPDIST_SECRET": "torchrun-secret",
        # the lampdist these tests import (a mutant's copy under tests/mutants.py)
        "PYTHONPATH": os.pathsep.join([str(SOURCE), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(nranks), "--log-dir", str(logs), "--redirects", "3"]
    command += [str(SCRIPT), "--out", str(out), *args]
    first_error: list[float] = []
    done = threading.Event()

    def watch_for_errors() -> None:  # the moment an error line first appears in a rank's file
        while not done.wait(0.02):
            for path in logs.glob("**/stderr.log"):
                if "Error" in path.read_text(errors="replace"):
                    first_error.append(time.time())
                    return

    watcher = threading.Thread(target=watch_for_errors, daemon=True)
    watcher.start()
    try:
        finished = subprocess.run(
            command,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    finally:
        done.set()
        watcher.join()
    ended = time.time()
    fault = out / "fault.json"
    if fault.exists():
        first_error[:0] = [json.loads(fault.read_text())["time"]]
    stderr = {
        int(path.parent.name): path.read_text(errors="replace")
        for path in logs.glob("**/attempt_0/*/stderr.log")
    }
    summary = finished.stderr
    exitcodes = {
        int(rank): int(code)
        for rank, code in re.findall(
            r"rank\s*: (\d+) \(local_rank.*\n\s*exitcode\s*: (-?\d+)", summary
        )
    }
    cause = re.search(r"Root Cause.*?\n.*?\n.*?\n.*?rank\s*: (\d+)", summary, re.DOTALL)
    return Job(
        returncode=finished.returncode,
        exitcodes=exitcodes,
        root_cause=int(cause.group(1)) if cause else None,
        stderr=stderr,
        torchrun_stderr=summary,
        after_fault=ended - first_error[0] if first_error else None,
    )


def exit_time(tmp_path: Path, rank: int) -> float:
    """When ``rank``'s interpreter began to exit (the rank script notes it at exit)."""
    return float(json.loads((tmp_path / "out" / f"exit-{rank}").read_text())["time"])


def report(name: str, job: Job) -> None:
    took = f"{job.after_fault:.1f} s" if job.after_fault is not None else "?"
    print(f"\n{name}: the job ended {took} after the fault; exit codes {job.exitcodes}")


def test_the_rank_script_ends_as_the_readme_does() -> None:
    """The script under test is the README's: its last lines are the README's own."""
    readme = (ROOT_DIR / "README.md").read_text()
    block = readme.split("logging.basicConfig(", 1)[1].split("```", 1)[0]
    assert block.strip() in SCRIPT.read_text()


def test_the_same_call_on_every_rank_gives_every_rank_the_final_state(tmp_path: Path) -> None:
    """The rank script has no rank branch: every rank gives lampdist.train the same loop with
    the same tracker; the root's tracker alone writes (one run), and every rank returns the
    root's final loop state."""
    job = run_job(tmp_path)
    assert job.returncode == 0, job.explain()
    out = tmp_path / "out"
    states = [json.loads((out / f"state-{rank}.json").read_text()) for rank in range(2)]
    assert states[0] == states[1] and len(states[0]["curve"]) == 3, states
    records = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    kinds = [record["record"] for record in records]
    assert kinds.count("hyperparameters") == 1 and kinds.count("summary") == 1, kinds
    windows = [r["step"] for r in records if r["record"] == "event" and r["window_steps"]]
    assert windows == [2, 4, 6] * 3, windows  # three epochs of 6 steps, every 2 steps


def test_a_killed_follower_is_the_roots_error_not_a_graceful_stop(tmp_path: Path) -> None:
    job = run_job(tmp_path, "--fault", "kill", "--checkpoints", str(tmp_path / "ck"))
    report("follower SIGKILL in training", job)
    assert job.exitcodes == {0: 1, 1: SIGKILLED}, job.explain()
    assert job.root_cause == 1, job.explain()
    last = job.last_line(0)
    assert "PeerDisconnected: rank 1, phase 'train'" in last, job.explain()
    assert "Interrupted" not in job.stderr[0], job.explain()


def test_a_killed_root_ends_the_follower_with_its_error(tmp_path: Path) -> None:
    job = run_job(tmp_path, "--fault", "kill", "--fault-rank", "0")
    report("root SIGKILL in training", job)
    assert job.exitcodes == {0: SIGKILLED, 1: 1}, job.explain()
    assert "PeerDisconnected: rank 0, phase 'train'" in job.last_line(1), job.explain()


@pytest.mark.slow
def test_fsdp_under_torchrun_trains_checkpoints_and_names_a_killed_follower(
    tmp_path: Path,
) -> None:
    """step_on='fsdp' as torchrun starts it: the clique opens torch's default group itself (the
    launcher's variables are not used for it), the run trains in windows with a metric and
    early stopping and writes sharded checkpoints; a follower killed in training is the
    root's error."""
    checkpoints = tmp_path / "ck"
    job = run_job(tmp_path / "ok", "--step-on", "fsdp", "--checkpoints", str(checkpoints))
    assert job.returncode == 0, job.explain()
    newest = sorted(checkpoints.glob("epoch-*"))[-1]
    assert sorted(p.name for p in (newest / "shards").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    killed = run_job(tmp_path / "killed", "--step-on", "fsdp", "--fault", "kill")
    report("follower SIGKILL in training under fsdp", killed)
    assert killed.exitcodes == {0: 1, 1: SIGKILLED}, killed.explain()
    assert "PeerDisconnected: rank 1, phase 'train'" in killed.last_line(0), killed.explain()


def test_a_refused_secret_ends_the_joining_root_at_once(tmp_path: Path) -> None:
    """The root, still waiting for followers, gets torchrun's SIGTERM: nothing to drain, so
    it ends at once (before: it waited Timeouts.stop, 30 s, and torchrun SIGKILLed it)."""
    job = run_job(tmp_path, "--fault", "secret")
    report("refused secret", job)
    assert job.exitcodes[1] == 1, job.explain()
    assert job.exitcodes[0] in ENDED_BY_SIGTERM, job.explain()
    assert job.root_cause == 1, job.explain()
    assert "AuthenticationError: rank 1, phase 'handshake'" in job.last_line(1), job.explain()


@pytest.mark.slow
def test_a_refused_checkpoint_directory_ends_the_joining_follower_at_once(
    tmp_path: Path,
) -> None:
    checkpoints = tmp_path / "ck"
    first = run_job(tmp_path / "first", "--epochs", "1", "--checkpoints", str(checkpoints))
    assert first.returncode == 0, first.explain()
    job = run_job(tmp_path / "second", "--checkpoints", str(checkpoints))  # a new run there
    report("refused checkpoint directory", job)
    assert job.exitcodes[0] == 1, job.explain()
    assert job.exitcodes[1] in ENDED_BY_SIGTERM, job.explain()
    assert job.root_cause == 0, job.explain()
    assert "CheckpointError: rank 0, phase 'configure'" in job.last_line(0), job.explain()


def test_a_batch_of_the_wrong_shape_names_the_follower_as_the_root_cause(
    tmp_path: Path,
) -> None:
    job = run_job(tmp_path, "--fault", "bad-shape")
    report("wrong-shape batch on rank 1", job)
    # torchrun names the first process it sees gone, polling every 0.1 s: the follower must
    # be gone more than a poll before the root (each rank notes when its interpreter exits)
    if job.exitcodes.get(0) != -15:  # -15: torchrun saw rank 1 gone and signalled the root
        exited = {rank: exit_time(tmp_path, rank) for rank in (0, 1)}
        assert exited[0] - exited[1] > 0.1, (exited, job.explain())
    assert job.root_cause == 1, job.explain()
    assert job.exitcodes[1] == 1, job.explain()
    last = job.last_line(1)
    assert "TrainingError: rank 1, phase 'train'" in last, job.explain()
    assert "float32[16, 7]" in last, job.explain()  # the batch's shapes
    assert "RankFailed: rank 1, phase 'train'" in job.stderr[0], job.explain()
    # the failed rank does not also warn that the root went away: it knows why
    assert "without STOP" not in job.stderr[1], job.explain()


def test_with_three_ranks_the_failed_follower_is_still_the_root_cause(tmp_path: Path) -> None:
    """The root lets the failed rank go before it tells the other follower why the run
    stops: that follower must not exit (with the root's reason) before the culprit."""
    job = run_job(tmp_path, "--fault", "bad-shape", "--fault-rank", "2", nranks=3)
    report("wrong-shape batch on rank 2 of 3", job)
    for other in (0, 1):
        if job.exitcodes.get(other) != -15:  # else torchrun saw rank 2 gone and signalled it
            exited = exit_time(tmp_path, other) - exit_time(tmp_path, 2)
            assert exited > 0.1, (other, exited, job.explain())
    assert job.root_cause == 2, job.explain()
    assert "TrainingError: rank 2, phase 'train'" in job.last_line(2), job.explain()


@pytest.mark.parametrize("nranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_stalled_follower_is_the_root_cause_within_seconds(tmp_path: Path, nranks: int) -> None:
    """The last follower stops (SIGSTOP) in a training pass, with the default timeouts: the
    root finds it unresponsive after heartbeat_timeout (5 s), ends its process, and every
    other rank leaves its collective at once; torchrun names the stalled rank as the root
    cause, and the job ends well within 10 s of the stall (not at Timeouts.collective)."""
    stalled = nranks - 1
    job = run_job(tmp_path, "--fault", "stop", "--fault-rank", str(stalled), nranks=nranks)
    report(f"SIGSTOP of rank {stalled} of {nranks}", job)
    assert job.root_cause == stalled, job.explain()
    assert job.exitcodes[stalled] == SIGKILLED, job.explain()
    assert job.after_fault is not None and job.after_fault < 10, job.explain()
    assert f"PeerUnresponsive: rank {stalled}, phase 'train'" in job.stderr[0], job.explain()


def test_a_non_finite_loss_names_the_rank_it_came_from(tmp_path: Path) -> None:
    """The root finds the NaN and stops the run with its error: the follower lets the root's
    process end first, so that torchrun names the root as the root cause and does not end it
    by a signal, even where the root's interpreter is slow to exit."""
    job = run_job(tmp_path, "--fault", "nan", "--slow-exit", "0")
    report("NaN loss on rank 1", job)
    assert job.exitcodes[0] == 1, job.explain()
    assert job.root_cause == 0, job.explain()
    last = job.last_line(0)
    assert "NonFiniteLoss: rank 0, phase 'train'" in last, job.explain()
    assert "rank 1" in last.split("phase 'train'", 1)[1], job.explain()


def test_ranks_that_disagree_exit_2(tmp_path: Path) -> None:
    job = run_job(tmp_path, "--fault", "width")
    report("a wider model on rank 1", job)
    # Both ranks raise at the agreement check; the one still tearing down when torchrun
    # signals the other's exit may end by that SIGTERM, having printed its error.
    codes = job.exitcodes
    assert sorted(codes) == [0, 1] and 2 in codes.values(), job.explain()
    assert set(codes.values()) <= {2, -15}, job.explain()
    for rank, code in codes.items():
        if code == 2:  # (one that torchrun's SIGTERM ended may not have printed its line)
            assert job.last_line(rank).startswith("MismatchError: rank "), job.explain()


def test_bad_settings_exit_2(tmp_path: Path) -> None:
    """The root's optimizer factory returns no optimizer: the root exits 2, and the follower,
    still joining, ends at once on torchrun's SIGTERM."""
    job = run_job(tmp_path, "--fault", "config", "--fault-rank", "0")
    report("bad settings on the root", job)
    assert job.exitcodes[0] == 2, job.explain()
    assert job.exitcodes[1] in ENDED_BY_SIGTERM, job.explain()
    assert job.root_cause == 0, job.explain()
    assert job.last_line(0).startswith("ConfigError: rank 0, phase 'configure'"), job.explain()


def test_bad_settings_on_a_follower_only_exit_2_on_every_rank(tmp_path: Path) -> None:
    """Only the follower's optimizer factory returns no optimizer (under ``every_rank`` it
    steps too): it reports its ConfigError to the root before it exits, and the root raises
    it in turn, so the README's script exits 2 on every rank, the follower first."""
    job = run_job(tmp_path, "--fault", "config", "--fault-rank", "1", "--step-on", "every_rank")
    report("bad settings on the follower", job)
    assert job.exitcodes == {0: 2, 1: 2}, job.explain()
    assert job.root_cause == 1, job.explain()
    raised = "ConfigError: rank 1, phase 'configure': optimizer_factory must return"
    assert job.last_line(0).startswith(raised), job.explain()
    assert job.last_line(1).startswith(raised), job.explain()
