"""A job of :mod:`.tcp_rank` processes over TCP on 127.0.0.1, for the tests that kill ranks
and start them again (recovery, bounded redo, stateful sources, fsdp): the job itself
(:class:`Job`), the same run without a loss (:func:`uninterrupted`), and the bitwise
comparison of two runs' ends (:func:`assert_same_run`)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from ._launch import spawn

NRANKS = 3
NEVER = "1000000"
"""A ``--die-after`` no rank reaches: the uninterrupted run reads its data the same way."""


class Job:
    """A root and its followers, each rank's arguments its own; :meth:`replace` starts a
    rank's command again (as a supervisor restarts a lost process)."""

    def __init__(
        self,
        out: Path,
        args: Sequence[str],
        per_rank: dict[int, list[str]],
        *,
        nranks: int = NRANKS,
    ) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.nranks = out, nranks
        self.per_rank = {rank: [*args, *per_rank.get(rank, [])] for rank in range(nranks)}
        self.ended: list[subprocess.Popen[str]] = []
        root = self.spawn(0, 0)
        assert root.stdout is not None
        line = root.stdout.readline()
        assert line.startswith("PORT "), line + (root.stderr.read() if root.stderr else "")
        self.port = int(line.split()[1])
        self.ranks = {0: root}
        for rank in range(1, nranks):
            self.ranks[rank] = self.spawn(rank, self.port)

    def spawn(self, rank: int, port: int, *extra: str) -> subprocess.Popen[str]:
        """Start rank ``rank``'s process (its arguments, then ``extra``) on the root's
        ``port`` (0 for the root itself); the caller reaps it."""
        return spawn("tcp_rank", rank, self.nranks, self.out, port, *self.per_rank[rank], *extra)

    def wait_for(self, rank: int, timeout: float = 60) -> int:
        """Wait until rank ``rank``'s process ends; its exit code."""
        return self.ranks[rank].wait(timeout=timeout)

    def replace(self, rank: int, *extra: str) -> None:
        """Start rank ``rank`` again (its process has ended), with ``extra`` arguments."""
        old = self.ranks[rank]
        assert old.poll() is not None
        self.ended.append(old)
        self.ranks[rank] = self.spawn(rank, self.port, *extra)

    def finish(self, timeout: float = 120) -> dict[int, tuple[int, str]]:
        """Every live rank's exit code and stderr, by rank."""
        try:
            return {
                rank: (process.wait(timeout=timeout), stderr(process))
                for rank, process in self.ranks.items()
            }
        finally:
            self.kill()

    def kill(self) -> None:
        for process in [*self.ranks.values(), *self.ended]:
            if process.poll() is None:
                process.kill()
                process.wait()


def stderr(process: subprocess.Popen[str]) -> str:
    assert process.stderr is not None
    return process.stderr.read()


def uninterrupted(out: Path, args: Sequence[str], *, nranks: int = NRANKS) -> None:
    """The same run without a loss (every rank exits 0)."""
    job = Job(out, [*args, "--die-after", NEVER], {}, nranks=nranks)
    for rank, (code, error) in job.finish().items():
        assert code == 0, f"rank {rank}: {error}"


def assert_same_run(
    got: Path, want: Path, *, nranks: int = NRANKS, optimizers: bool = True
) -> None:
    """Every rank's final weights (its shards under fsdp) and, where a rank keeps one, its
    optimizer's state (unless ``optimizers`` is false: ``got`` is a program that writes
    weights only), and the learning curve, bitwise."""
    names = ("rank{}.pt", "optim{}.pt") if optimizers else ("rank{}.pt",)
    for rank in range(nranks):
        for name in (pattern.format(rank) for pattern in names):
            assert (got / name).exists() == (want / name).exists(), f"rank {rank}: {name}"
            if not (want / name).exists():
                continue
            mine = _flat(torch.load(got / name, weights_only=True, map_location="cpu"))
            theirs = _flat(torch.load(want / name, weights_only=True, map_location="cpu"))
            assert mine.keys() == theirs.keys(), f"rank {rank}: {name}"
            for key, tensor in mine.items():
                assert torch.equal(tensor, theirs[key]), f"rank {rank}: {name} {key}"
    assert (got / "curve.json").read_text() == (want / "curve.json").read_text()


def _flat(parts: dict[str, object], prefix: str = "") -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in parts.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            assert isinstance(value, torch.Tensor), f"{prefix}{key}: {type(value).__name__}"
            flat[f"{prefix}{key}"] = value
    return flat
