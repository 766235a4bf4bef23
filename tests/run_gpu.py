"""Run every test marked ``gpu``, each in a process of its own, and report each exit code.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 tests/run_gpu.py [pytest paths...]

A failing NCCL test can take its process down (a signal, not a test failure); one process per
test keeps the others' results and names the test that did it. Each process runs with
``-X faulthandler`` so that a crash prints every thread's Python stack, with pytest's
``faulthandler_timeout`` so that a test still running after ``STACKS_AFTER`` seconds prints
them too (a hang shows where it waits), and with a per-test timeout when pytest-timeout is
installed. Exits 1 when any test did not pass (a skipped test did not).

Tests with several GPUs in one process can hang in the CUDA driver (see
``local_data_parallel_training_loop``); a hung test ends at the timeout and is reported.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

TEST_TIMEOUT = 180  # seconds per test
STACKS_AFTER = 90  # seconds into a test when every thread's stack is printed


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
        command += ["-o", f"faulthandler_timeout={STACKS_AFTER}"]
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
            for output in (expired.stdout, expired.stderr):  # the stacks go to stderr
                text = output.decode(errors="replace") if isinstance(output, bytes) else output
                print((text or "")[-6000:], flush=True)
            failed.append(test)
            continue
        if done.returncode != 0:
            status = f"exit {done.returncode}"
        elif " passed" in done.stdout:
            status = "passed"
        else:  # pytest -q says "1 skipped" without 2 GPUs: a skip is no pass
            status = "skipped"
        print(f"{status:>10}  {test}", flush=True)
        if status != "passed":
            failed.append(test)
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:], flush=True)
    print(f"{len(tests) - len(failed)} of {len(tests)} gpu tests passed")
    return 1 if failed or not tests else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
