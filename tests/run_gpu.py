"""Run every test marked ``gpu``, each in a process of its own, and report each exit code.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 tests/run_gpu.py [pytest paths...]

A failing NCCL test can take its process down (a signal, not a test failure); one process per
test keeps the others' results and names the test that did it. Each process runs with
``-X faulthandler`` so that a crash prints every thread's Python stack, with pytest's
``faulthandler_timeout`` so that a test still running after ``STACKS_AFTER`` seconds prints
them too (a hang shows where it waits), and with a per-test timeout when pytest-timeout is
installed. Prints how many tests ran, passed, failed and skipped. A test skipped because it
needs more GPUs than the machine has ("needs 2 CUDA devices") is reported as such; any other
skip, on a machine that has the GPUs the test needs, counts as a failure. Exits 1 when any
test failed, hung or skipped that way, or when no test ran.

Tests with several GPUs in one process can hang in the CUDA driver (see
``local_data_parallel_training_loop``); a hung test ends at the timeout and is reported.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import torch

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


def gpus_needed(reason: str) -> int:
    """The GPUs a skip reason says the test needs ("needs 2 CUDA devices", "needs a CUDA
    device"); 0 when it names none."""
    found = re.search(r"needs (\d+|a) CUDA device", reason)
    if found is None:
        return 0
    return 1 if found.group(1) == "a" else int(found.group(1))


def main(paths: list[str]) -> int:
    """Run each test; print one line per test and a summary."""
    timeout = []
    if importlib.util.find_spec("pytest_timeout") is not None:
        timeout = ["--timeout", str(TEST_TIMEOUT), "--timeout-method", "thread"]
    failed = []
    passed = 0
    for_want_of_gpus = 0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tests = collect(paths or ["tests"])
    for test in tests:
        command = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-m", "gpu", "-q", "-rs"]
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
            passed += 1
        elif gpus_needed(done.stdout) > gpus:
            status = "no GPUs"  # needs more GPUs than this machine has
            for_want_of_gpus += 1
        else:  # skipped although the machine has what it needs: no pass
            status = "skipped"
        print(f"{status:>10}  {test}", flush=True)
        if status not in ("passed", "no GPUs"):
            failed.append(test)
        if done.returncode != 0 or status == "skipped":
            print(done.stdout[-3000:] + done.stderr[-3000:], flush=True)
    ran = len(tests) - for_want_of_gpus
    print(
        f"{len(tests)} gpu tests on {gpus} GPU(s): {ran} ran, {passed} passed, "
        f"{len(failed)} failed, hung or skipped, {for_want_of_gpus} skipped for want of GPUs"
    )
    return 1 if failed or ran == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
