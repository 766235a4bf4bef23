"""Start the processes of one configuration, wait for them under a deadline, read the results.

Each configuration runs in fresh processes (one per rank, ``python benchmarks/_loops.py``), so
no process group, allocator cache or thread outlives it and peak memory is its own. A failed
rank stops the others at once; a run past its deadline is killed. Every process started here
is killed and reaped before :func:`launch` returns or raises.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from _loops import SECRET_ENV, Kind, RankResult, RunSpec

__all__ = ["BenchmarkError", "Config", "Settings", "launch"]

HERE = Path(__file__).resolve().parent
LOOPS = HERE / "_loops.py"
SOURCE = HERE.parent / "src"
SOURCE_KEY = "source"  # a variant key of the launcher's own: the lampdist source tree to run
POLL_INTERVAL = 0.05
LOG_TAIL = 4000
PORT_ATTEMPTS = 3


class BenchmarkError(RuntimeError):
    """A configuration's processes failed or ran past their deadline."""


@attrs.frozen(kw_only=True)
class Config:
    """One configuration of the comparison: a name, what it runs, and its variant's keywords."""

    name: str
    kind: Kind
    kwargs: dict[str, Any] = attrs.field(factory=dict)

    @property
    def source(self) -> Path:
        """The lampdist source tree this configuration measures: the variant key
        ``source:PATH`` (another checkout's ``src``, to compare two versions in one run), or
        this checkout's ``src``."""
        return Path(self.kwargs.get(SOURCE_KEY, SOURCE)).resolve()

    def rank_kwargs(self, rank: int) -> dict[str, Any]:
        """The keyword arguments rank ``rank``'s entry point receives."""
        return {key: value for key, value in self.kwargs.items() if key != SOURCE_KEY}


@attrs.frozen(kw_only=True)
class Settings:
    """What every configuration of a run shares."""

    device_type: str
    model: str
    nranks: int
    steps: int
    warmup: int
    threads: int
    timeout: float


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _environment(port: int, source: Path) -> dict[str, str]:
    """The parent's environment (NCCL settings included) plus the rendezvous and the secret;
    ``source`` (the checkout's ``src`` unless a variant names another lampdist source tree)
    goes first on PYTHONPATH so the benchmark measures that lampdist."""
    env = dict(os.environ)
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(port)
    env[SECRET_ENV] = secrets.token_hex(16)
    if (source / "lampdist").is_dir():
        paths = [str(source), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-LOG_TAIL:].strip() or "(no output)"


@attrs.define(eq=False)
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    log: Path
    result: Path


def _check(config: Config, ranks: list[_Rank]) -> bool:
    """Whether every rank has exited; raises for the first that failed."""
    for rank in ranks:
        code = rank.process.poll()
        if code not in (None, 0):
            raise BenchmarkError(
                f"{config.name}: rank {rank.rank} exited with status {code}; its output:\n"
                f"{_tail(rank.log)}"
            )
    return all(rank.process.poll() is not None for rank in ranks)


def _wait(config: Config, ranks: list[_Rank], deadline: float, done: Callable[[], bool]) -> None:
    """Poll until ``done()``; raises when a rank fails or at the deadline."""
    while not done():
        if time.monotonic() > deadline:
            logs = "\n".join(f"rank {r.rank}:\n{_tail(r.log)}" for r in ranks)
            raise BenchmarkError(f"{config.name}: no result within the deadline; output:\n{logs}")
        time.sleep(POLL_INTERVAL)


def _all_exited(config: Config, ranks: list[_Rank]) -> Callable[[], bool]:
    return lambda: _check(config, ranks)


def _listening(config: Config, root: _Rank, ready: Path) -> Callable[[], bool]:
    def done() -> bool:
        if ready.exists():
            return True
        if _check(config, [root]):
            raise BenchmarkError(
                f"{config.name}: the root exited before it listened; its output:\n{_tail(root.log)}"
            )
        return False

    return done


def launch(config: Config, settings: Settings, directory: Path) -> list[RankResult]:
    """Run ``config`` once in fresh processes and return each rank's result, rank 0 first.

    The rendezvous port is one that was free a moment before the ranks start; when another
    process took it in between (a rank fails with "address already in use"), the run starts
    again on a new port, at most ``PORT_ATTEMPTS`` times, each in its own directory.

    Raises :class:`BenchmarkError` (with the failed rank's output) when a rank fails or the
    run takes longer than ``settings.timeout`` seconds.
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        where = directory if attempt == 1 else directory.with_name(f"{directory.name}-{attempt}")
        try:
            return _launch_once(config, settings, where)
        except BenchmarkError as error:
            if attempt == PORT_ATTEMPTS or not _port_was_taken(str(error)):
                raise
    raise AssertionError("unreachable")


def _port_was_taken(output: str) -> bool:
    """Whether a rank's output says its rendezvous port was in use when it bound it."""
    return "eaddrinuse" in output.lower() or "address already in use" in output.lower()


def _launch_once(config: Config, settings: Settings, directory: Path) -> list[RankResult]:
    """One attempt of :func:`launch` in ``directory`` on a fresh port."""
    nranks = 1 if config.kind == "single" else settings.nranks
    directory.mkdir(parents=True)
    port = free_port()
    env = _environment(port, config.source)
    ready = directory / "ready"
    deadline = time.monotonic() + settings.timeout
    ranks: list[_Rank] = []
    try:
        for rank in range(nranks):
            if config.kind == "lampdist" and rank == 1:
                _wait(config, ranks, deadline, _listening(config, ranks[0], ready))
            spec = RunSpec(
                config=config.name,
                kind=config.kind,
                model=settings.model,
                device_type="cuda" if settings.device_type == "cuda" else "cpu",
                rank=rank,
                nranks=nranks,
                steps=settings.steps,
                warmup=settings.warmup,
                threads=settings.threads,
                port=port,
                ready_file=str(ready),
                result_file=str(directory / f"rank{rank}.json"),
                kwargs=config.rank_kwargs(rank),
            )
            spec_file = directory / f"rank{rank}.spec.json"
            spec_file.write_text(json.dumps(attrs.asdict(spec)))
            log = directory / f"rank{rank}.log"
            with log.open("wb") as output:
                process = subprocess.Popen(
                    [sys.executable, str(LOOPS), str(spec_file)],
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            ranks.append(_Rank(rank=rank, process=process, log=log, result=Path(spec.result_file)))
        _wait(config, ranks, deadline, _all_exited(config, ranks))
    finally:
        for started in ranks:
            if started.process.poll() is None:
                started.process.kill()
        for started in ranks:
            started.process.wait()
    return [RankResult(**json.loads(started.result.read_text())) for started in ranks]
