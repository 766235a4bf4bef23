"""Run every test marked ``gpu``, each in a process of its own, and report each exit code.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 tests/run_gpu.py [pytest paths...]

A failing NCCL test can take its process down (a signal, not a test failure); one process per
test keeps the others' results and names the test that did it. Each process runs with
``-X faulthandler`` so that a crash prints every thread's Python stack, and with a per-test
timeout when pytest-timeout is installed. Exits 1 when any test did not pass.

Tests with several GPUs in one process can hang in the CUDA driver (see
``local_data_parallel_training_loop``); a hung test ends at the timeout and is reported.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

TEST_TIMEOUT = 180  # seconds per test


def collect(paths: list[str]) -> list[str]:
    """The node ids of the ``gpu`` tests under ``paths``."""
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", *paths],
        capture_output=True,
        text=True,
        check=False,
        timeout=TEST_TIMEOUT,
    )
    return [line for line in listing.stdout.splitlines() if "::" in line]


def main(paths: list[str]) -> int:
    """Run each test; print one line per test and a summary."""
    timeout = []
    if importlib.util.find_spec("pytest_timeout") is not None:
        timeout = ["--timeout", str(TEST_TIMEOUT), "--timeout-method", "thread"]
    failed = []
    tests = collect(paths or ["tests"])
    for test in tests:
        command = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-m", "gpu", "-q"]
        try:
            done = subprocess.run(
                [*command, *timeout, test],
                check=False,
                capture_output=True,
                text=True,
                timeout=TEST_TIMEOUT + 60,
            )
        except subprocess.TimeoutExpired as expired:
            print(f"{'hung':>10}  {test}", flush=True)
            print(str(expired.stdout or "")[-3000:], flush=True)
            failed.append(test)
            continue
        status = "passed" if done.returncode == 0 else f"exit {done.returncode}"
        print(f"{status:>10}  {test}", flush=True)
        if done.returncode != 0:
            failed.append(test)
            print(done.stdout[-3000:] + done.stderr[-3000:], flush=True)
    print(f"{len(tests) - len(failed)} of {len(tests)} gpu tests passed")
    return 1 if failed or not tests else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
