"""``python -m lampdist`` is the command line."""

from __future__ import annotations

import subprocess
import sys


def test_python_m_lampdist_runs_the_command_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lampdist", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: lampdist" in done.stdout
    assert "demo" in done.stdout


def test_a_bad_demo_flag_shows_the_demos_usage() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lampdist", "demo", "--bogus"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "usage: lampdist demo" in done.stderr
    assert "unrecognized arguments: --bogus" in done.stderr
