"""Run the ranks of ``rank.py`` as subprocesses, time how they end, and leave nothing behind.

Every process a test starts carries a per-test token in its environment; :meth:`Cluster.close`
kills and waits for every rank that is still running, then scans ``/proc`` for any process
with that token, so a test fails if anything it started outlives it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs

ROOT_DIR = Path(__file__).resolve().parents[2]
SECRET = "reliability-secret"
TOKEN_VARIABLE = "LAMPDIST_RELIABILITY_TOKEN"
START_TIMEOUT = 90.0  # importing torch on a busy two-core machine takes several seconds
ERROR_PREFIX = "lampdist-rank: "


@attrs.define(eq=False)
class Rank:
    """One rank's process and what became of it."""

    rank: int
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    ended_at: float | None = None
    _waiter: threading.Thread | None = None

    def __attrs_post_init__(self) -> None:
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self.process.wait()
        self.ended_at = time.time()  # when it exited, to the reaping thread's precision

    @property
    def code(self) -> int | None:
        return self.process.returncode

    def stderr_text(self) -> str:
        return self.stderr.read_text(errors="replace")

    def error(self) -> str:
        """The error line the rank script prints before it exits with an error, or ''."""
        lines = [ln for ln in self.stderr_text().splitlines() if ln.startswith(ERROR_PREFIX)]
        return lines[-1].removeprefix(ERROR_PREFIX) if lines else ""

    def poll(self) -> bool:
        return self.ended_at is not None


@attrs.define(eq=False)
class Cluster:
    """The ranks of one run; use :func:`cluster`."""

    out: Path
    checkpoints: Path
    token: str
    ranks: dict[int, Rank] = attrs.field(factory=dict)
    port: int = 0

    def spawn(self, rank: int, nranks: int, args: Sequence[str] = ()) -> Rank:
        env = {
            **os.environ,
            "LAMPDIST_SECRET": SECRET,
            "PYTHONUNBUFFERED": "1",
            TOKEN_VARIABLE: self.token,
        }
        suffix = f"{rank}-{len([r for r in self.ranks.values() if r.rank == rank])}"
        stdout, stderr = self.out / f"stdout-{suffix}.txt", self.out / f"stderr-{suffix}.txt"
        command = [sys.executable, "-m", "tests.reliability.rank", "--rank", str(rank)]
        command += ["--nranks", str(nranks), "--out", str(self.out), "--port", str(self.port)]
        command += ["--checkpoints", str(self.checkpoints), *args]
        with stdout.open("wb") as out, stderr.open("wb") as err:
            process = subprocess.Popen(command, cwd=ROOT_DIR, env=env, stdout=out, stderr=err)
        handle = Rank(rank, process, stdout, stderr)
        self.ranks[rank] = handle
        return handle

    def start(
        self,
        nranks: int,
        args: Mapping[int, Sequence[str]] | None = None,
        common: Sequence[str] = (),
        followers: Sequence[int] | None = None,
    ) -> None:
        """Start the root, wait until it listens, then start the followers (all by default)."""
        args = args or {}
        root = self.spawn(0, nranks, [*common, *args.get(0, ())])
        deadline = time.monotonic() + START_TIMEOUT
        while not (match := re.search(r"^PORT (\d+)$", root.stdout.read_text(), re.MULTILINE)):
            if root.poll() or time.monotonic() > deadline:
                raise AssertionError(f"the root did not start:\n{root.stderr_text()}")
            time.sleep(0.02)
        self.port = int(match.group(1))
        for rank in range(1, nranks) if followers is None else followers:
            self.spawn(rank, nranks, [*common, *args.get(rank, ())])

    def wait(self, timeout: float, ranks: Sequence[int] | None = None) -> None:
        """Wait until the ranks (all by default) have exited; fail after ``timeout`` seconds."""
        chosen = [self.ranks[r] for r in (self.ranks if ranks is None else ranks)]
        deadline = time.monotonic() + timeout
        while not all(rank.poll() for rank in chosen):
            if time.monotonic() > deadline:
                alive = [r.rank for r in chosen if not r.poll()]
                for rank in alive:  # their stacks, for the failure message
                    self.signal(rank, signal.SIGUSR1)
                time.sleep(1.0)
                logs = "\n".join(f"rank {r.rank}:\n{r.stderr_text()}" for r in chosen)
                raise AssertionError(f"ranks {alive} still run after {timeout} s\n{logs}")
            time.sleep(0.02)

    def signal(self, rank: int, signum: signal.Signals) -> None:
        self.ranks[rank].process.send_signal(signum)

    def fault_time(self, rank: int) -> float:
        """When ``rank`` injected its fault (wall clock)."""
        record = json.loads((self.out / f"fault-rank{rank}.json").read_text())
        return float(record["time"])

    def close(self) -> None:
        """Kill and reap every rank still running, then check that nothing else is left."""
        for rank in self.ranks.values():
            if rank.process.poll() is None:
                rank.process.kill()
            rank.process.wait(timeout=30)
        left = leftover_processes(self.token)
        assert not left, f"processes left behind: {left}"


def leftover_processes(token: str) -> list[int]:
    """The pids of live processes whose environment holds ``token``."""
    needle = f"{TOKEN_VARIABLE}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environment.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


@contextmanager
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A :class:`Cluster` whose processes are all gone when the block ends."""
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    out.mkdir(exist_ok=True)
    handle = Cluster(out=out, checkpoints=checkpoints, token=uuid.uuid4().hex)
    try:
        yield handle
    finally:
        handle.close()


def report(case: str, rank: Rank, seconds: float | None) -> None:
    """One line per surviving rank for docs/reliability.md (``pytest -s`` shows them)."""
    took = "-" if seconds is None else f"{seconds:.2f}"
    print(
        f"\nRELIABILITY | {case} | rank {rank.rank} | exit {rank.code} | {took} s | "
        f"{rank.error()[:160]}"
    )
