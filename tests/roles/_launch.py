"""Every rank of a rank script (``python -m tests.roles.<script>``) as its own process over
TCP on 127.0.0.1: the root first, which prints ``PORT <n>``, then the followers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[2]


def spawn(
    script: str, rank: int, nranks: int, out: Path, port: int, *extra: str
) -> subprocess.Popen[str]:
    env = {**os.environ, "LAMPDIST_SECRET": "test-secret", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", f"tests.roles.{script}", "--rank", str(rank)]
        + ["--nranks", str(nranks), "--port", str(port), "--out", str(out), *extra],
        cwd=ROOT_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def launch_ranks(script: str, out: Path, nranks: int, *extra: str) -> list[tuple[int, str]]:
    """Every rank of ``script`` to its end (2 minutes at most, then killed): each one's exit
    code and stderr, by rank."""
    root = spawn(script, 0, nranks, out, 0, *extra)
    followers: list[subprocess.Popen[str]] = []
    try:
        assert root.stdout is not None
        line = root.stdout.readline()
        assert line.startswith("PORT "), line + (root.stderr.read() if root.stderr else "")
        port = int(line.split()[1])
        followers = [spawn(script, rank, nranks, out, port, *extra) for rank in range(1, nranks)]
        errors = [process.communicate(timeout=120)[1] for process in [root, *followers]]
    finally:
        for process in [root, *followers]:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [
        (process.returncode, error)
        for process, error in zip([root, *followers], errors, strict=True)
    ]
