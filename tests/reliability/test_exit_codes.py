"""A finished run exits 0, always: no thread of lampdist's is inside torch when the
interpreter shuts down.

Python 3.11 to 3.13 end a daemon thread that wants the GIL back once the interpreter's
shutdown has begun with ``pthread_exit``; its unwinding crosses torch's C++ frames (pybind11's
GIL guards are destructors, which may not throw) and the process aborts: "terminate called
without an active exception", exit -6, after a run that completed. lampdist leaves daemon
threads behind on purpose (a loading thread inside the batch source, a clique's watcher in a
store call, an abandoned process group's destructor); the process waits for them at exit
(``lampdist._preload.await_own_threads``), before the shutdown begins.

The first tests show the mechanism in one process, deterministically; the last runs short
finished 2-rank runs, recovered and not, through ``benchmarks/exit_codes.py``, with a batch
source that computes with torch (so that the loading thread is inside torch as the run
ends), and checks every exit code and, through a probe that runs last at exit, that no
lampdist thread was left when the interpreter began to shut down.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lampdist import _preload

ROOT = Path(__file__).resolve().parents[2]
EXIT_CODES = ROOT / "benchmarks" / "exit_codes.py"
RUNS = 5  # of each variant: 10 finished 2-rank runs, 5 of them with a follower recovered
VARIANTS = "plain-compute,recovered-compute"
# A batch source that spends 0.3 s a batch in torch operations: the loading thread is inside
# torch when the run ends (without the wait at exit, 44 of 48 such processes exited -6).
COMPUTE_SECONDS = "0.3"
TIMEOUT = 480  # about 100 s on an idle two-core machine

# A daemon thread that enters torch, the GIL released, as the process exits: a store wait of
# argv[2] seconds, which has to end after the interpreter's shutdown has begun and before it
# has ended (a few tenths of a second on an idle machine).
INSIDE_TORCH = """
import atexit, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from lampdist import _preload

store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
go, inside = threading.Event(), threading.Event()

def wait() -> None:
    go.wait()
    inside.set()
    try:
        store.wait(["never"], timedelta(seconds=float(sys.argv[2])))
    except Exception:
        pass

def enter_torch() -> None:
    go.set()
    inside.wait(10)
    time.sleep(0.05)

_preload.register_exit_hook()
atexit.register(enter_torch)  # registered after lampdist's handler: it runs before it
threading.Thread(target=wait, name=sys.argv[1], daemon=True).start()
"""

# Registered when the interpreter starts, so it runs last at exit, after lampdist's handler.
PROBE = """
import atexit, json, os, sys, threading

def _probe() -> None:
    names = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    sys.stderr.write(f"EXIT-PROBE {os.getpid()} {json.dumps(names)}\\n")
    sys.stderr.flush()

atexit.register(_probe)
"""
PROBED = re.compile(r"^EXIT-PROBE \d+ (\[.*\])$", re.MULTILINE)


def _run_inside_torch(thread_name: str, wait: float = 0.3) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", INSIDE_TORCH, thread_name, str(wait)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_process_waits_at_exit_for_a_lampdist_thread_inside_torch() -> None:
    done = _run_inside_torch("lampdist-test-wait")
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 parks such a thread")
def test_a_thread_it_does_not_wait_for_aborts_the_process() -> None:
    """The same thread under another name, which the exit does not wait for: what the test
    above guards against. The wait has to end inside the shutdown, whose length varies with
    the machine's load: a few lengths are tried, and one of them has to abort."""
    outcomes = []
    for wait in (0.1, 0.3, 0.05, 0.2, 0.5):
        done = _run_inside_torch("someone-else", wait)
        if done.returncode == -6:
            assert "terminate called without an active exception" in done.stderr
            return
        outcomes.append((wait, done.returncode, done.stderr[-500:]))
    pytest.fail(f"no wait ended inside the shutdown: {outcomes}")


def test_a_thread_that_outlasts_the_wait_is_named(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, name="lampdist-test-stuck", daemon=True)
    brief = threading.Thread(target=time.sleep, args=(0.1,), name="lampdist-test-brief")
    stuck.start()
    brief.start()
    try:
        with caplog.at_level(logging.WARNING, logger="lampdist._preload"):
            left = _preload.await_own_threads(0.5)
        assert "lampdist-test-stuck" in left  # (with any other test's threads still there)
        assert "lampdist-test-brief" not in left
        assert not brief.is_alive()
        assert "lampdist-test-stuck" in caplog.text
    finally:
        release.set()
        stuck.join()


def _counted_logs(workdir: Path) -> list[Path]:
    """The stderr of every process of every job that had to exit 0 (not a killed follower)."""
    logs = []
    for job in sorted(path for path in workdir.iterdir() if path.is_dir()):
        for log in sorted(job.glob("*.err")):
            if job.name.startswith("recovered") and log.name == "rank1-0.err":
                continue  # SIGKILLed: the fault
            logs.append(log)
    return logs


@pytest.mark.slow
def test_finished_runs_exit_0_and_leave_no_thread_to_the_shutdown(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")])),
    }
    workdir, report_path = tmp_path / "work", tmp_path / "report.json"
    command = [sys.executable, str(EXIT_CODES), "--runs", str(RUNS), "--variants", VARIANTS]
    command += ["--compute-seconds", COMPUTE_SECONDS, "--budget", "400"]
    command += ["--json", str(report_path), "--workdir", str(workdir), "--keep"]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert report_path.exists(), f"exit {result.returncode}: {result.stdout[-4000:]}"
    report = json.loads(report_path.read_text())
    details = json.dumps(report["nonzero_details"] + report["unfinished_details"], indent=1)
    assert report["finished_runs"] == 2 * RUNS, details[-6000:]
    assert report["nonzero_exits"] == 0, details[-6000:]
    left: dict[str, list[str]] = {}
    for log in _counted_logs(workdir):
        found = PROBED.findall(log.read_text(errors="replace"))
        assert len(found) == 1, f"{log}: no exit probe (did the process end normally?)"
        names = [name for name in json.loads(found[0]) if name.startswith("lampdist-")]
        if names:
            left[f"{log.parent.name}/{log.name}"] = names
    assert not left, f"lampdist threads alive as the interpreter shut down: {left}"
