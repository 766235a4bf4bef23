"""The chaos run: real processes over real sockets on 127.0.0.1, faults at random moments.

    python benchmarks/chaos.py --faults 20 --seed 1 [--json PATH] [--followers 2|3]
        [--no-recovery] [--kinds follower_kill,root_kill,...] [--workdir DIR] [--keep]
        [--batch-sleep 0.07] [--batch-compute] [--step-on root|every_rank|sharded|fsdp]
        [--notes TEXT]

    unshare -n sh -c 'ip link set lo up && python benchmarks/chaos.py --engine ray \
        --faults 100 --seed 1 [--budget SECONDS] ...'

A root and 2 or 3 followers of ``benchmarks/chaos_rank.py`` train a small CPU job in windows
of steps (``StepOptions(steps_per_epoch=...)``), checkpointing every window; their batch
source takes ``--batch-sleep`` seconds a batch, asleep or, with ``--batch-compute``, in torch
operations. First the job runs once without faults and its final weights are kept as the
reference. Then jobs are run to completion one after another while faults are injected at
random moments (the moments and targets drawn from ``--seed``), one at a time, until
``--faults`` have been injected:

- ``follower_kill``: SIGKILL of a follower;
- ``root_kill``: SIGKILL of the root;
- ``follower_stop_short`` / ``follower_stop_long``: SIGSTOP of a follower, SIGCONT after a
  delay shorter than the heartbeat deadline, or longer;
- ``conn_reset``: the follower's control connection reset (both sockets of a TCP proxy that
  this script runs between every follower and the root are closed with RST);
- ``conn_blackhole``: the proxy stops carrying that connection's bytes either way, sockets
  open: the peers must notice by their heartbeats;
- ``follower_term``: SIGTERM of a follower (the rank script stops gracefully on it: it keeps
  following until the root's STOP, for up to its ``Timeouts.stop``);
- ``root_term`` (only with ``--kinds``): SIGTERM of the root: a graceful stop, then a
  restart.

This script supervises the job as a launcher would. With recovery (the default: the rank
script passes ``LoopOptions(recovery=lampdist.Recovery(...))``), a follower that exits while
the root runs is started again with the same command line, and the root takes it back into
the job; with ``--no-recovery`` the root's run fails instead. When the root ends without
completing the run, whatever is left gets its deadline to end on its own (an error naming a
rank and phase is expected within 10 s), and the whole job is started again with
``--resume`` from the checkpoint directory. A process still there 30 s past its deadline is
killed (after SIGUSR1: the rank script's faulthandler dumps its threads into its log) and
counted as a hang. Only the control connections go through the proxies: the Gloo
connections between the ranks are direct.

Reported per kind of fault: faults, in-job recoveries, whole-job restarts, faults the run
absorbed (nothing lost), recovery and restart times (p50, max), hangs, lost checkpoints (a
checkpoint committed before a fault that is missing or unreadable after it), and whether the
final weights of every run equal the reference bitwise. Job attempts that ended without
completing the run are counted apart, with whether every process that ended ended with an
error naming a rank and a phase within 10 s. Every process whose work was done (the rank
script prints ``DONE`` once it has written its final weights) must exit 0: any other code
(a crash at exit, which a supervisor would take for a lost rank) is listed under
``finished_nonzero_exits`` with the process's last stderr lines, and that process is neither
counted as lost nor started again (a root's completes the run). ``--json PATH`` writes it
all. The exit status is 1 when there was a hang, a lost checkpoint, a run whose weights
differ or a non-zero exit after the work was done.

``--step-on fsdp`` runs the job under ``StepOptions(step_on="fsdp")``: a lost follower's
shards come back from its neighbour's replica in host memory, and each rank's final shards
are compared with the same rank's in the reference run.

``--engine ray`` runs each job through ``lampdist.ray.run`` on a local Ray instance (one
actor per rank, ``chaos_rank.launched`` as the ranks' main) instead of supervising
processes, with the faults of ``benchmarks/_chaos_ray.py`` (``actor_kill``, ``root_kill``,
``actor_stall_short``, ``actor_stall_long``, ``actor_stall_never``): Ray starts a lost
follower's actor again and a lost root's job again from its newest checkpoint. Ray's
traffic must stay on the loopback, so the whole script runs in a network namespace whose
only interface is ``lo`` (the ``unshare -n`` command above, as root); it refuses to start
Ray elsewhere. ``--budget`` stops starting new runs after that many seconds (the faults
that never struck are reported as planned but not struck). ``--notes`` goes into the JSON
as is (say there how loaded the machine was).

Logs of every process go to ``--workdir`` (a temporary directory by default, removed after a
clean result unless ``--keep``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import secrets
import selectors
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
RANK_SCRIPT = HERE / "chaos_rank.py"

KINDS = (
    "follower_kill",
    "root_kill",
    "follower_stop_short",
    "follower_stop_long",
    "conn_reset",
    "conn_blackhole",
    "follower_term",
)
OPTIONAL_KINDS = ("root_term",)
RAY_KINDS = (
    "actor_kill",
    "root_kill",
    "actor_stall_short",
    "actor_stall_long",
    "actor_stall_never",
)
"""``--engine ray``'s kinds (benchmarks/_chaos_ray.py)."""
ROOT_KINDS = ("root_kill", "root_term")
STARTUP_KINDS = ("follower_kill", "root_kill", "follower_stop_short", "follower_stop_long")
"""Kinds that may also strike before training begins (join, clique setup)."""
STARTUP_CHANCE = 0.15
NAMED = re.compile(r"rank \d+, phase '[^']+'")
"""An error that names a rank and a phase (every lampdist error's message starts so)."""
RECOVERED = re.compile(r"\brecovered rank\(s\) \[[\d, ]+\] in (\d+(?:\.\d+)?) s\b")
"""The root's log line that training goes on after an in-job recovery, with its seconds."""
LOST = re.compile(r"\blost rank\(s\) \[([\d, ]+)\] in phase '([^']+)'")
"""The root's log line that it lost followers and waits for them to rejoin."""
NAMED_WITHIN = 10.0
HANG_GRACE = 30.0
POLL = 0.02
MAX_ATTEMPTS = 8
"""Whole-job starts of one run before it counts as unfinished."""
MAX_REPLACEMENTS = 12
"""Followers started again within one start of the job."""
GRACEFUL = (0, 128 + signal.SIGTERM, 128 + signal.SIGINT)
"""The root's exit codes of a run that ended in order: completed, or stopped by a signal."""


@dataclass(frozen=True)
class Settings:
    """What every job of the chaos run shares (the rank script's options)."""

    followers: int
    recovery: bool
    epochs: int
    steps_per_window: int
    batch_sleep: float
    batch_compute: bool
    step_on: str
    heartbeat_interval: float
    heartbeat_timeout: float
    join_timeout: float
    collective_timeout: float
    stop_timeout: float
    rejoin_timeout: float
    max_recoveries: int

    @property
    def nranks(self) -> int:
        return self.followers + 1

    @property
    def end_deadline(self) -> float:
        """Seconds a rank may take to end once its run has failed around it: the longest
        deadline a fault can have to pass first, plus a process's exit."""
        return max(self.heartbeat_timeout, self.collective_timeout, self.stop_timeout) + 5.0

    def rank_args(self) -> list[str]:
        args = [
            "--nranks", str(self.nranks),
            "--epochs", str(self.epochs),
            "--steps-per-window", str(self.steps_per_window),
            "--batch-sleep", str(self.batch_sleep),
            "--step-on", self.step_on,
            "--heartbeat-interval", str(self.heartbeat_interval),
            "--heartbeat-timeout", str(self.heartbeat_timeout),
            "--join-timeout", str(self.join_timeout),
            "--collective-timeout", str(self.collective_timeout),
            "--stop-timeout", str(self.stop_timeout),
            "--rejoin-timeout", str(self.rejoin_timeout),
            "--max-recoveries", str(self.max_recoveries),
        ]  # fmt: skip
        args += ["--batch-compute"] if self.batch_compute else []
        return args if self.recovery else [*args, "--no-recovery"]


# --- processes ------------------------------------------------------------------------------


class Proc:
    """One rank process: its output lines stamped on arrival (``time.monotonic()``) and
    copied to a log file, its exit noticed by :meth:`poll`."""

    def __init__(self, argv: list[str], rank: int, log: Path, env: dict[str, str]) -> None:
        self.argv, self.rank, self.log = argv, rank, log
        self.started = time.monotonic()
        self.out: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self.ended_at: float | None = None
        self.code: int | None = None
        self.killed_by_harness = False
        self.faulted = False
        """Whether a fault signalled it (its exit code may be the fault's)."""
        self.stopped = False
        self._file = log.open("a", buffering=1)
        self._file.write(f"# {time.time():.3f} started: {' '.join(argv)}\n")
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # the harness's signals reach this process only
        )
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines, tag), daemon=True)
            for stream, lines, tag in (
                (self.popen.stdout, self.out, "out"),
                (self.popen.stderr, self.err, "err"),
            )
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[str] | None, lines: list[tuple[float, str]], tag: str) -> None:
        assert stream is not None
        for line in stream:
            stamp = time.monotonic()
            lines.append((stamp, line.rstrip("\n")))
            with contextlib.suppress(ValueError):  # closed at the end
                self._file.write(f"{tag} {stamp:.3f} {line}")

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.poll() is None

    def poll(self) -> int | None:
        if self.code is None:
            code = self.popen.poll()
            if code is not None:
                self.code, self.ended_at = code, time.monotonic()
        return self.code

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL (a stopped process too) and reap."""
        if self.alive():
            self.killed_by_harness = True
            self.signal(signal.SIGKILL)
        self.popen.wait()
        self.poll()

    def close(self) -> None:
        self.kill()
        for reader in self._readers:
            reader.join(timeout=5)
        self._file.close()

    def finished(self) -> bool:
        """Whether it said ``DONE``: its work was done, so it must exit 0. Call it once the
        process has exited: it waits for its output to be read to the end first."""
        for reader in self._readers:
            reader.join(timeout=2)
        return any(line == "DONE" for _, line in self.out)

    def last_error(self) -> str:
        """The last stderr line that names a rank and phase, else the last line."""
        for _, line in reversed(self.err[-40:]):
            if NAMED.search(line) and "Traceback" not in line:
                return line
        return self.err[-1][1] if self.err else ""


# --- the TCP proxy --------------------------------------------------------------------------


class _Pair:
    """A proxied connection: the follower's socket and the root's, with each one's pending
    output."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.socks = (client, upstream)
        self.pending = (bytearray(), bytearray())
        self.blackholed = False
        self.open = [True, True]


class Proxy:
    """A TCP proxy between one follower rank and the root's control port, on a thread of its
    own, that can drop its connections: ``reset`` closes both sockets with RST,
    ``blackhole`` stops carrying bytes either way while the sockets stay open (each side
    is closed once its own end closes)."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._upstream: int | None = None
        self._listening = False
        self._pairs: list[_Pair] = []
        self._requests: list[str] = []
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def set_upstream(self, port: int | None) -> None:
        with self._lock:
            self._requests.append(f"upstream {port}")

    def drop(self, how: str) -> None:
        with self._lock:
            self._requests.append(how)

    def connections(self) -> int:
        """Connections carried normally now."""
        return sum(1 for pair in list(self._pairs) if not pair.blackholed and all(pair.open))

    def close(self) -> None:
        self._closing = True
        self._thread.join(timeout=5)
        for pair in self._pairs:
            self._close_pair(pair, reset=True)
        self._listener.close()
        self._selector.close()

    def _serve(self) -> None:
        while not self._closing:
            with self._lock:
                requests, self._requests = self._requests, []
            for request in requests:
                self._apply(request)
            for key, events in self._selector.select(0.05):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    pair, side = key.data
                    self._pump(pair, side, events)

    def _apply(self, request: str) -> None:
        if request.startswith("upstream "):
            value = request.split()[1]
            self._upstream = None if value == "None" else int(value)
            if self._upstream is not None and not self._listening:
                self._selector.register(self._listener, selectors.EVENT_READ, None)
            elif self._upstream is None and self._listening:
                self._selector.unregister(self._listener)
            self._listening = self._upstream is not None
        elif request == "reset":
            for pair in list(self._pairs):
                self._close_pair(pair, reset=True)
        elif request == "blackhole":
            for pair in self._pairs:
                pair.blackholed = True
                for buffer in pair.pending:
                    buffer.clear()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self._upstream or 0), timeout=2)
        except OSError:
            _reset(client)
            return
        pair = _Pair(client, upstream)
        for side, sock in enumerate(pair.socks):
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, (pair, side))
        self._pairs.append(pair)

    def _pump(self, pair: _Pair, side: int, events: int) -> None:
        if not pair.open[side]:  # closed earlier in this round of events
            return
        sock, other = pair.socks[side], 1 - side
        if events & selectors.EVENT_READ:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":  # this end closed
                if pair.blackholed:  # the other end must find out by itself
                    self._close_side(pair, side)
                else:
                    self._close_pair(pair, reset=False)
                return
            if data and not pair.blackholed and pair.open[other]:
                pair.pending[other].extend(data)
                self._want_write(pair, other, True)
        if events & selectors.EVENT_WRITE and pair.open[side]:
            try:
                sent = sock.send(pair.pending[side])
            except BlockingIOError:
                sent = 0
            except OSError:
                self._close_pair(pair, reset=True)
                return
            del pair.pending[side][:sent]
            if not pair.pending[side]:
                self._want_write(pair, side, False)

    def _want_write(self, pair: _Pair, side: int, want: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(pair.socks[side], events, (pair, side))

    def _close_side(self, pair: _Pair, side: int) -> None:
        if pair.open[side]:
            pair.open[side] = False
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(pair.socks[side])
            pair.socks[side].close()
        if not any(pair.open) and pair in self._pairs:
            self._pairs.remove(pair)

    def _close_pair(self, pair: _Pair, *, reset: bool) -> None:
        for side in (0, 1):
            if pair.open[side]:
                if reset:
                    _set_linger_zero(pair.socks[side])
                else:  # pass on what was read before the close
                    with contextlib.suppress(OSError):
                        pair.socks[side].setblocking(True)
                        pair.socks[side].settimeout(0.2)
                        pair.socks[side].sendall(pair.pending[side])
                self._close_side(pair, side)


def _set_linger_zero(sock: socket.socket) -> None:
    """Make ``close`` send RST."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _reset(sock: socket.socket) -> None:
    _set_linger_zero(sock)
    sock.close()


# --- faults and their records ---------------------------------------------------------------


@dataclass
class Fault:
    """One fault: what is drawn from the seed, then what happened."""

    index: int
    kind: str
    rank: int
    startup: bool
    gap: int
    """Strike in the window this many windows after the one in progress when eligible."""
    offset: float
    """Into that window, as a fraction of a window's duration (startup: seconds after the
    followers were started)."""
    hold: float
    """SIGSTOP: seconds until SIGCONT."""
    run: int = -1
    attempt: int = -1
    injected_at: float | None = None
    window: int | None = None
    """The window in progress at the fault (None: before training)."""
    continued_at: float | None = None
    lost: list[int] = field(default_factory=list)
    """Followers that exited with an error after the fault (before the root ended)."""
    detected: float | None = None
    """Seconds from the fault to the root's line that it lost the follower (recovery)."""
    detected_in: str | None = None
    """The phase the root says it lost the follower in."""
    outcome: str | None = None
    """recovered (in the job), restarted (the whole job), absorbed (nothing lost), hang,
    unfinished (the run never completed)."""
    seconds: float | None = None
    """recovered: fault to the root's line that training goes on; restarted: fault to the
    restarted job's first progress; absorbed: fault to the next progress."""
    seconds_from: str | None = None
    library_seconds: float | None = None
    checkpoints_before: list[str] = field(default_factory=list)
    lost_checkpoints: list[str] = field(default_factory=list)
    note: str = ""

    def describe(self) -> str:
        target = "root" if self.kind in ROOT_KINDS else f"rank {self.rank}"
        where = "before training" if self.window is None else f"window {self.window}"
        return f"#{self.index} {self.kind} ({target}, {where})"


def plan_faults(rng: random.Random, count: int, kinds: list[str], followers: int) -> list[Fault]:
    """``count`` faults drawn from ``rng``: the kinds cycle through shuffled rounds, so
    that every kind comes once before any comes twice."""
    order: list[str] = []
    while len(order) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    faults = []
    for index, kind in enumerate(order[:count]):
        startup = rng.random() < STARTUP_CHANCE
        rank = rng.randint(1, followers)
        gap = rng.randint(1, 3)
        offset = rng.random()
        hold = rng.random()
        faults.append(
            Fault(
                index=index,
                kind=kind,
                rank=0 if kind in ROOT_KINDS else rank,
                startup=startup and kind in STARTUP_KINDS,
                gap=gap,
                offset=offset,
                hold=hold,
            )
        )
    return faults


# --- checkpoints ----------------------------------------------------------------------------

CHECKPOINT_NAME = re.compile(r"epoch-\d{6}(\.\d+)?")


def committed(directory: Path) -> list[str]:
    """The committed checkpoints in ``directory`` (scratch entries are named otherwise)."""
    try:
        return sorted(
            entry.name
            for entry in os.scandir(directory)
            if CHECKPOINT_NAME.fullmatch(entry.name) and entry.is_dir()
        )
    except FileNotFoundError:
        return []


def readable(directory: Path, name: str) -> bool:
    """Whether checkpoint ``name`` of ``directory`` loads (alone in a copy, so that
    ``load_latest`` cannot fall back on another one)."""
    from lampdist import checkpoint

    with tempfile.TemporaryDirectory(prefix="chaos-check-") as scratch:
        try:
            shutil.copytree(directory / name, Path(scratch) / name)
            return checkpoint.load_latest(scratch) is not None
        except Exception:
            return False


# --- one run --------------------------------------------------------------------------------


@dataclass
class AttemptEnd:
    """How one start of the whole job ended."""

    run: int
    attempt: int
    root_code: int | None
    completed: bool
    cause: str
    """failed, hang, stopped by a signal, or the root ended before listening."""
    reason: str
    """What ended it: the root killed (before any checkpoint), recoveries exhausted, a
    follower lost without recovery, a hang, or the root's error type."""
    checkpoints_at_fault: int | None
    fault: int | None
    named_within_10s: bool | None
    ends: list[dict[str, Any]]


class Job:
    """Every process of one start of the whole job (with the followers' replacements)."""

    def __init__(self, harness: Harness, out: Path, checkpoints: Path, resume: bool) -> None:
        self.harness, self.out = harness, out
        out.mkdir(parents=True, exist_ok=True)
        settings = harness.settings
        common = [*settings.rank_args(), "--out", str(out)]
        root_args = ["--checkpoint", str(checkpoints)]
        if resume:
            root_args += ["--resume", str(checkpoints)]
        self.checkpoints = checkpoints
        self.argv: dict[int, list[str]] = {
            0: [sys.executable, str(RANK_SCRIPT), "--rank", "0", *common, *root_args]
        }
        self.incarnations: dict[int, list[Proc]] = {0: []}
        self.incarnations[0].append(self._spawn(0))
        self.port: int | None = None
        self.events: list[tuple[float, str, int, int, bool]] = []
        self._read_out = 0
        self._read_err = 0
        self.recovered_lines: list[tuple[float, float | None, str]] = []
        self.lost_lines: list[tuple[float, list[int], str]] = []
        """The root's lines that it lost followers: when, which ranks, in what phase."""

    @property
    def root(self) -> Proc:
        return self.incarnations[0][-1]

    def current(self, rank: int) -> Proc:
        return self.incarnations[rank][-1]

    def procs(self) -> Iterator[Proc]:
        for procs in self.incarnations.values():
            yield from procs

    def _spawn(self, rank: int) -> Proc:
        count = len(self.incarnations.get(rank, []))
        log = self.out / f"rank{rank}-{count}.log"
        return Proc(self.argv[rank], rank, log, self.harness.env)

    def start_followers(self) -> bool:
        """Wait for the root's port, point the proxies at it, start the followers; False
        when the root ended first."""
        deadline = time.monotonic() + 60
        while self.port is None:
            for _, line in self.root.out:
                if line.startswith("PORT "):
                    self.port = int(line.split()[1])
            if self.port is None:
                if not self.root.alive() or time.monotonic() > deadline:
                    return False
                time.sleep(POLL)
        settings = self.harness.settings
        for rank in range(1, settings.nranks):
            proxy = self.harness.proxies[rank]
            proxy.set_upstream(self.port)
            self.argv[rank] = [
                sys.executable,
                str(RANK_SCRIPT),
                "--rank",
                str(rank),
                "--port",
                str(proxy.port),
                *settings.rank_args(),
                "--out",
                str(self.out),
            ]
            self.incarnations[rank] = []
            self.incarnations[rank].append(self._spawn(rank))
        return True

    def replace(self, rank: int) -> Proc:
        """Start rank ``rank`` again with the same command line."""
        proc = self._spawn(rank)
        self.incarnations[rank].append(proc)
        return proc

    def read(self) -> None:
        """Take in the root's new progress events and recovery lines."""
        root = self.incarnations[0][0]
        while self._read_out < len(root.out):
            stamp, line = root.out[self._read_out]
            self._read_out += 1
            parts = line.split()
            if len(parts) == 5 and parts[0] == "EVENT":
                self.events.append((stamp, parts[1], int(parts[2]), int(parts[3]), parts[4] == "1"))
        while self._read_err < len(root.err):
            stamp, line = root.err[self._read_err]
            self._read_err += 1
            if "chaos-rank" in line:
                continue
            match = RECOVERED.search(line)
            if match:
                self.recovered_lines.append((stamp, float(match[1]), line))
                self.harness.library_says = True
            lost = LOST.search(line)
            if lost:
                ranks = [int(rank) for rank in lost[1].split(",")]
                self.lost_lines.append((stamp, ranks, lost[2]))

    def window(self) -> int | None:
        return self.events[-1][2] if self.events else None

    def first_event_after(self, moment: float) -> float | None:
        for stamp, *_ in self.events:
            if stamp > moment:
                return stamp
        return None

    def close(self) -> None:
        for proc in self.procs():
            proc.close()


class Harness:
    """The chaos run: the reference job, then runs with faults, and the report."""

    def __init__(self, args: argparse.Namespace, settings: Settings, workdir: Path) -> None:
        self.args, self.settings, self.workdir = args, settings, workdir
        self.env = {
            **os.environ,
            "LAMPDIST_SECRET": secrets.token_hex(16),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
        }
        self.proxies = {rank: Proxy() for rank in range(1, settings.nranks)}
        self.rng = random.Random(args.seed)
        self.faults: list[Fault] = []
        self.attempt_ends: list[AttemptEnd] = []
        self.runs: list[dict[str, Any]] = []
        self.unexpected: list[str] = []
        self.finished_nonzero: list[dict[str, Any]] = []
        """Processes that said ``DONE`` (their work was done) and exited non-zero."""
        self.hangs: list[str] = []
        self.reference: dict[int, dict[str, Any]] | None = None
        """Each rank's final weights in the uninterrupted run (under fsdp its own shards)."""
        self.reference_seconds = 0.0
        self.window_seconds = 0.3
        self.library_says = False
        """Whether the root has logged a recovered line in this chaos run: then only that
        line settles a recovery."""

    def log(self, message: str) -> None:
        print(f"[chaos {time.monotonic() - START:7.2f}] {message}", flush=True)

    def close(self) -> None:
        for proxy in self.proxies.values():
            proxy.close()

    # -- the reference ------------------------------------------------------------------

    def run_reference(self) -> None:
        directory = self.workdir / "reference"
        started = time.monotonic()
        result = self.run_job(directory, [], run=-1)
        self.reference_seconds = time.monotonic() - started
        if not result["completed"] or result["attempts"] != 1:
            raise SystemExit(f"the uninterrupted reference run failed: see {directory}")
        weights = self.load_weights(Path(result["out"]))
        if self.settings.step_on == "fsdp":  # each rank's own shards
            if len(weights) != self.settings.nranks:
                raise SystemExit(f"the reference run left no shards of some rank: {directory}")
            self.reference = weights
        else:
            for rank, state in weights.items():
                if not equal(state, weights[0]):
                    raise SystemExit(f"the reference run's rank {rank} differs from its root")
            self.reference = dict.fromkeys(range(self.settings.nranks), weights[0])
        starts = [stamp for stamp, kind, _, step, _ in result["events"] if kind == "train"]
        windows = sorted({epoch for _, kind, epoch, _, _ in result["events"] if kind == "train"})
        if len(windows) > 1:
            self.window_seconds = (starts[-1] - starts[0]) / (len(windows) - 1)
        self.log(
            f"reference: {self.reference_seconds:.1f} s, "
            f"{self.window_seconds:.2f} s per window, {len(windows)} windows"
        )

    def load_weights(self, out: Path) -> dict[int, dict[str, Any]]:
        import torch

        found = {}
        for rank in range(self.settings.nranks):
            path = out / f"rank{rank}.pt"
            if path.exists():
                found[rank] = torch.load(path, weights_only=True)
        return found

    # -- runs ---------------------------------------------------------------------------

    def run_all(self) -> None:
        planned = plan_faults(self.rng, self.args.faults, self.args.kinds, self.settings.followers)
        self.faults = planned
        pending = list(planned)
        run = 0
        idle_runs = 0
        while pending and run < 3 * len(planned) + 3:
            take = min(len(pending), self.rng.randint(1, self.args.faults_per_run))
            batch, pending = pending[:take], pending[take:]
            result = self.run_job(self.workdir / f"run-{run:02d}", batch, run=run)
            unfired = [fault for fault in batch if fault.injected_at is None]
            pending = unfired + pending
            idle_runs = idle_runs + 1 if len(unfired) == len(batch) else 0
            self.finish_run(run, result, batch)
            run += 1
            if idle_runs >= 3:
                self.log("three runs in a row without a fault striking: giving up on the rest")
                break

    def finish_run(self, run: int, result: dict[str, Any], batch: list[Fault]) -> None:
        directory = Path(result["checkpoints"])
        for fault in batch:
            if fault.injected_at is None:
                continue
            for name in fault.checkpoints_before:
                if not (directory / name).is_dir() or not readable(directory, name):
                    fault.lost_checkpoints.append(name)
        equal_weights: bool | None = None
        mismatched: list[int] = []
        missing: list[int] = []
        if result["completed"] and self.reference is not None:
            # Every rank whose last process ended cleanly wrote its weights; a follower lost
            # as the run ended has none (the root's are the run's).
            weights = self.load_weights(Path(result["out"]))
            missing = [rank for rank in range(self.settings.nranks) if rank not in weights]
            mismatched = [
                rank for rank, state in weights.items() if not equal(state, self.reference[rank])
            ]
            equal_weights = not mismatched and 0 in weights
        record = {
            "run": run,
            "completed": result["completed"],
            "attempts": result["attempts"],
            "faults": [fault.index for fault in batch if fault.injected_at is not None],
            "bitwise_equal": equal_weights,
            "ranks_differing": mismatched,
            "ranks_without_weights": missing,
            "seconds": round(result["seconds"], 2),
        }
        self.runs.append(record)
        self.log(
            f"run {run}: {'completed' if result['completed'] else 'UNFINISHED'} after "
            f"{result['attempts']} start(s), {record['seconds']} s; weights "
            f"{'equal' if equal_weights else 'DIFFER' if equal_weights is False else 'n/a'}"
            + (f" on ranks {mismatched}" if mismatched else "")
            + (f"; no weights from ranks {missing}" if missing else "")
        )

    def run_job(self, directory: Path, batch: list[Fault], *, run: int) -> dict[str, Any]:
        """Train one job to completion, restarting it whole when it fails, while the faults
        of ``batch`` strike one at a time."""
        checkpoints = directory / "checkpoints"
        started = time.monotonic()
        queue = list(batch)
        restarted: list[Fault] = []  # faults whose restart time the next start measures
        events: list[Any] = []
        completed, attempt = False, 0
        out = directory
        for attempt in range(MAX_ATTEMPTS):
            out = directory / f"attempt-{attempt}"
            job = Job(self, out, checkpoints, resume=attempt > 0)
            try:
                completed = self.supervise(job, queue, restarted, run=run, attempt=attempt)
                events = job.events
            finally:
                job.close()
            if completed:
                break
        for fault in batch:
            if fault.injected_at is not None and fault.outcome is None:
                fault.outcome = "restarted" if completed else "unfinished"
        for fault in restarted:
            if fault.outcome == "restarted" and fault.seconds is None:
                fault.note += " no progress after the restart;"
        return {
            "completed": completed,
            "attempts": attempt + 1,
            "out": str(out),
            "checkpoints": str(checkpoints),
            "events": events,
            "seconds": time.monotonic() - started,
        }

    def supervise(
        self, job: Job, queue: list[Fault], restarted: list[Fault], *, run: int, attempt: int
    ) -> bool:
        """Watch one start of the job to its end, injecting the queue's faults one at a time
        and starting lost followers again (with recovery); whether the run completed."""
        settings = self.settings
        label = f"run {run} start {attempt}"
        if not job.start_followers():
            return self.end_attempt(job, run, attempt, None, "the root ended before listening")
        begun = time.monotonic()
        self.log(f"{label}: root and {settings.followers} followers started")
        deadline = begun + 3 * self.reference_seconds + settings.join_timeout + 10
        active: Fault | None = None
        eligible: tuple[float, int | None] | None = None  # since when, the window then
        strike_at: float | None = None
        replacements = 0
        root_ended_at: float | None = None
        lost_at: float | None = None  # a follower lost for good: the root must end
        seen_exit: set[int] = set()
        while True:
            time.sleep(POLL)
            now = time.monotonic()
            job.read()
            if job.events and restarted:  # a restart's time: its fault to the first progress
                for fault in restarted:
                    if fault.seconds is None and fault.injected_at is not None:
                        fault.seconds = job.events[0][0] - fault.injected_at
                        fault.seconds_from = "the restarted job's first progress"
                restarted.clear()
            if active is not None and active.continued_at is not None:
                for proc in job.procs():
                    if proc.stopped and now >= active.continued_at:
                        proc.signal(signal.SIGCONT)
                        proc.stopped = False
                        self.log(f"{label}: SIGCONT to rank {proc.rank}")
            for proc in list(job.procs()):
                if id(proc) in seen_exit or proc.alive():
                    continue
                seen_exit.add(id(proc))
                said = "" if proc.code == 0 else f": {proc.last_error()[:240]}"
                done = (
                    proc.code != 0
                    and not (proc.killed_by_harness or proc.faulted)
                    and proc.finished()
                )
                if done:  # a supervisor sees a crash of a rank whose work was done
                    last = proc.err[-1][1] if proc.err else ""
                    said = f" AFTER ITS WORK WAS DONE: {last[:240]}"
                    self.finished_nonzero.append(self.finished_exit(proc, run, attempt))
                self.log(f"{label}: rank {proc.rank} exited {proc.code}{said}")
                if proc.rank == 0:
                    root_ended_at = proc.ended_at
                    continue
                if proc.code == 0 or done:
                    continue  # the root's STOP ended it: not lost, not started again
                if root_ended_at is not None:
                    pass  # the root's end ended it
                elif active is not None:
                    active.lost.append(proc.rank)
                else:
                    self.unexpected.append(f"{label}: rank {proc.rank} exited {proc.code}")
                if job.root.alive() and proc is job.current(proc.rank):
                    if settings.recovery and replacements < MAX_REPLACEMENTS:
                        replacements += 1
                        job.replace(proc.rank)
                        deadline += settings.rejoin_timeout
                        self.log(f"{label}: rank {proc.rank} started again")
                    elif lost_at is None:
                        lost_at = proc.ended_at
            survivors = [proc for proc in job.procs() if proc.alive()]
            if root_ended_at is not None:  # the end of this start
                if not survivors:
                    return self.end_attempt(job, run, attempt, active, "", restarted)
                limit = root_ended_at + settings.end_deadline
                if active is not None and active.continued_at is not None:
                    limit = max(limit, active.continued_at + settings.end_deadline)
                if now > limit + HANG_GRACE:
                    self.hang(label, active, survivors, "after the root ended")
                    return self.end_attempt(job, run, attempt, active, "hang", restarted)
                continue
            if lost_at is not None and now > lost_at + settings.end_deadline + HANG_GRACE:
                self.hang(label, active, survivors, "after a follower was lost for good")
                return self.end_attempt(job, run, attempt, active, "hang", restarted)
            if now > deadline + HANG_GRACE:
                self.hang(label, active, survivors, "past the run's deadline")
                return self.end_attempt(job, run, attempt, active, "hang", restarted)
            if active is not None and self.resolve(job, active, now):
                took = "" if active.seconds is None else f" after {active.seconds:.2f} s"
                self.log(f"{label}: {active.describe()}: {active.outcome}{took}")
                active, eligible, strike_at = None, None, None
            if active is not None or not queue or not self.ready(job, queue[0]):
                continue
            fault = queue[0]
            if eligible is None:
                eligible = (now, job.window())
            if strike_at is None:
                strike_at = self.strike_time(job, fault, begun, *eligible)
            if strike_at is not None and now >= strike_at:
                queue.pop(0)
                self.inject(job, fault, run, attempt, label)
                active, strike_at = fault, None
                deadline += settings.rejoin_timeout + settings.end_deadline + 5

    def ready(self, job: Job, fault: Fault) -> bool:
        """Whether every rank is up (and, for a connection fault, connected)."""
        if not all(job.current(rank).alive() for rank in job.incarnations):
            return False
        if fault.kind.startswith("conn_"):
            return self.proxies[fault.rank].connections() > 0
        return True

    def strike_time(
        self, job: Job, fault: Fault, begun: float, since: float, window: int | None
    ) -> float | None:
        """When ``fault`` strikes, once known: ``offset`` into the window ``gap`` windows
        after the one in progress when it became the next fault (before training: the
        first window counts as 0); a startup fault ``offset`` x 2.5 s after the start when
        it is the next fault before any progress of this start (else as the others)."""
        if fault.startup and window is None:  # no progress yet in this start of the job
            return max(begun + 2.5 * fault.offset, since)
        target = (window if window is not None else -1) + fault.gap
        for stamp, kind, epoch, _, _ in job.events:
            if kind == "train" and epoch >= target and stamp > since:
                return stamp + fault.offset * self.window_seconds
        return None

    def inject(self, job: Job, fault: Fault, run: int, attempt: int, label: str) -> None:
        fault.run, fault.attempt = run, attempt
        fault.checkpoints_before = committed(job.checkpoints)
        fault.window = job.window()
        target = job.current(fault.rank)
        settings = self.settings
        fault.injected_at = time.monotonic()
        target.faulted = not fault.kind.startswith("conn_")
        if fault.kind in ("follower_kill", "root_kill"):
            target.signal(signal.SIGKILL)
        elif fault.kind in ("follower_term", "root_term"):
            target.signal(signal.SIGTERM)
        elif fault.kind.startswith("follower_stop"):
            if fault.kind.endswith("short"):
                hold = settings.heartbeat_timeout * (0.15 + 0.45 * fault.hold)
            else:
                hold = settings.heartbeat_timeout + 1.0 + 2.0 * fault.hold
            target.signal(signal.SIGSTOP)
            target.stopped = True
            fault.continued_at = fault.injected_at + hold
        elif fault.kind == "conn_reset":
            self.proxies[fault.rank].drop("reset")
        elif fault.kind == "conn_blackhole":
            self.proxies[fault.rank].drop("blackhole")
        else:
            raise ValueError(fault.kind)
        hold_text = (
            ""
            if fault.continued_at is None
            else f", SIGCONT in {fault.continued_at - fault.injected_at:.2f} s"
        )
        self.log(f"{label}: inject {fault.describe()}{hold_text}")

    def resolve(self, job: Job, fault: Fault, now: float) -> bool:
        """Settle the active fault's outcome within the job, once it has one: recovered
        (the root's line), or absorbed (nothing lost, training went on). A fault that ends
        the job is settled by :meth:`end_attempt`."""
        assert fault.injected_at is not None
        after = fault.injected_at
        for stamp, _, phase in job.lost_lines:
            if stamp > after and fault.detected is None:
                fault.detected, fault.detected_in = stamp - after, phase
        for stamp, seconds, _ in job.recovered_lines:
            if stamp > after:
                fault.outcome, fault.seconds = "recovered", stamp - after
                fault.library_seconds = seconds
                fault.seconds_from = "the root's recovered line"
                return True
        if fault.continued_at is not None and now < fault.continued_at:
            return False
        if fault.lost:
            if not self.settings.recovery or job.recovered_lines or self.library_says:
                return False  # the job ends (no recovery), or the library will say
            # A library that logs no recovered line: the first progress after the
            # replacement started, once it is half a second old.
            started = [p.started for p in job.incarnations[fault.lost[-1]] if p.started > after]
            progress = job.first_event_after(max(started)) if started else None
            if progress is not None and now - progress > 0.5:
                fault.outcome, fault.seconds = "recovered", progress - after
                fault.seconds_from = "the first progress after the replacement started"
                return True
            return False
        settled = max(after, fault.continued_at or after)
        wait = self.settings.heartbeat_timeout + 1.5
        if fault.kind == "follower_term":
            wait += self.settings.stop_timeout
        if now > settled + wait and job.first_event_after(settled) is not None:
            fault.outcome = "absorbed"
            progress = job.first_event_after(after)
            fault.seconds = None if progress is None else progress - after
            fault.seconds_from = "the next progress"
            return True
        return False

    def finished_exit(self, proc: Proc, run: int, attempt: int) -> dict[str, Any]:
        """The record of a process that exited non-zero after its work was done."""
        job = "reference" if run < 0 else f"run {run} start {attempt}"
        return {
            "job": job,
            "rank": proc.rank,
            "code": proc.code,
            "log": str(proc.log),
            "stderr": [line for _, line in proc.err[-12:]],
        }

    def hang(self, label: str, fault: Fault | None, survivors: list[Proc], when: str) -> None:
        ranks = sorted({proc.rank for proc in survivors})
        self.log(f"{label}: HANG {when}: ranks {ranks}: their stacks in their logs, killed")
        self.hangs.append(f"{label}: ranks {ranks} {when}")
        for proc in survivors:
            proc.signal(signal.SIGCONT)
            proc.signal(signal.SIGUSR1)  # the rank script's faulthandler dumps every thread
        time.sleep(1.0)
        for proc in survivors:
            proc.kill()
        if fault is not None:
            fault.outcome = "hang"
            fault.note += f" ranks {ranks} hung {when};"

    def end_attempt(
        self,
        job: Job,
        run: int,
        attempt: int,
        fault: Fault | None,
        cause: str,
        restarted: list[Fault] | None = None,
    ) -> bool:
        """Record how this start ended; whether it completed the run (the root's exit 0)."""
        root = job.root
        # A root that exited non-zero after its work was done completed the run (the exit is
        # listed in finished_nonzero_exits).
        if not cause and (root.code == 0 or root.finished()):
            if fault is not None and fault.outcome is None:
                fault.outcome = "absorbed"
                if fault.lost:
                    fault.note += f" ranks {fault.lost} lost as the run ended;"
            return True
        graceful = root.code in GRACEFUL and not cause
        if fault is not None and fault.outcome in (None, "recovered", "absorbed"):
            fault.outcome = "restarted"
            if restarted is not None:
                restarted.append(fault)
        ends: list[dict[str, Any]] = []
        named: bool | None = None
        if not graceful:
            start = fault.injected_at if fault is not None else None
            if start is None:  # no fault: from the first failure
                start = min(
                    (p.ended_at for p in job.procs() if p.ended_at is not None and p.code),
                    default=None,
                )
            named = True
            for proc in job.procs():
                if proc.killed_by_harness or proc.code == -signal.SIGKILL:
                    continue  # the fault itself, or a hang (counted as such)
                if start is not None and proc.ended_at is not None and proc.ended_at < start:
                    continue  # ended before this failure (a follower replaced earlier)
                after = None if proc.ended_at is None or start is None else proc.ended_at - start
                line = proc.last_error()
                ok = (
                    after is not None
                    and after <= NAMED_WITHIN
                    and (proc.code == 0 or bool(NAMED.search(line)))
                )
                named = named and ok
                ends.append(
                    {
                        "rank": proc.rank,
                        "code": proc.code,
                        "seconds": None if after is None else round(after, 2),
                        "named": bool(NAMED.search(line)),
                        "line": line[-300:],
                    }
                )
        self.attempt_ends.append(
            AttemptEnd(
                run=run,
                attempt=attempt,
                root_code=root.code,
                completed=False,
                cause=cause or ("stopped by a signal" if graceful else "failed"),
                reason=self.reason(root, fault, cause, graceful),
                checkpoints_at_fault=None if fault is None else len(fault.checkpoints_before),
                fault=fault.index if fault is not None else None,
                named_within_10s=named,
                ends=ends,
            )
        )
        return False

    def reason(self, root: Proc, fault: Fault | None, cause: str, graceful: bool) -> str:
        """What ended a start of the job that did not complete the run."""
        line = root.last_error()
        if cause:
            return cause
        if graceful:
            return "the root stopped gracefully"
        if root.code == -signal.SIGKILL:
            if fault is not None and not fault.checkpoints_before:
                return "the root killed before any checkpoint"
            return "the root killed"
        if "max_recoveries" in line:
            return "recoveries exhausted"
        if not self.settings.recovery and fault is not None and fault.kind not in ROOT_KINDS:
            return "a follower lost without recovery"
        error = re.search(r"chaos-rank: (\w+):", line)
        return f"the root's {error[1]}" if error else f"the root exited {root.code}"

    # -- the report ----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        struck = [fault for fault in self.faults if fault.injected_at is not None]
        failed = [end for end in self.attempt_ends if end.cause != "stopped by a signal"]
        return {
            **totals(struck, self.args.kinds, self.runs, planned=len(self.faults)),
            "hangs": len(self.hangs),
            "failed_attempts": {
                "count": len(failed),
                "named_within_10s": sum(1 for end in failed if end.named_within_10s),
                "by_reason": {
                    reason: sum(1 for end in failed if end.reason == reason)
                    for reason in sorted({end.reason for end in failed})
                },
                "details": [asdict(end) for end in failed],
            },
            "graceful_stops": len(self.attempt_ends) - len(failed),
            "hang_details": self.hangs,
            "unexpected_exits": self.unexpected,
            "finished_nonzero_exits": self.finished_nonzero,
            "fault_log": [fault_record(fault) for fault in struck],
            "config": {
                "seed": self.args.seed,
                **asdict(self.settings),
                "kinds": self.args.kinds,
                "faults_per_run": self.args.faults_per_run,
            },
            "notes": self.args.notes,
            "reference_seconds": round(self.reference_seconds, 2),
            "window_seconds": round(self.window_seconds, 3),
            "wall_seconds": round(time.monotonic() - START, 1),
        }


def totals(
    struck: list[Fault], kinds: list[str], runs: list[dict[str, Any]], *, planned: int
) -> dict[str, Any]:
    """A report's totals over the faults that struck and the runs (``--engine ray``'s too):
    recoveries, restarts and their times, overall and per kind, and whether every finished
    run ended bitwise equal to the reference."""
    total = summary(struck)
    finished = [run for run in runs if run["completed"]]
    return {
        "faults": len(struck),
        "faults_planned": planned,
        **{
            key: total[key]
            for key in (
                "recoveries",
                "restarts",
                "absorbed",
                "lost_checkpoints",
                "recovery_seconds",
                "restart_seconds",
                "library_recovery_seconds",
            )
        },
        "bitwise_equal": bool(finished) and all(run["bitwise_equal"] is True for run in finished),
        "per_kind": {kind: summary([f for f in struck if f.kind == kind]) for kind in kinds},
        "runs": runs,
        "unfinished_runs": len(runs) - len(finished),
    }


def equal(state: dict[str, Any], reference: dict[str, Any]) -> bool:
    import torch

    return state.keys() == reference.keys() and all(
        torch.equal(state[name], reference[name]) for name in state
    )


def rounded(values: list[float]) -> list[float]:
    return [round(value, 3) for value in values]


def summary(faults: list[Fault]) -> dict[str, Any]:
    recovered = [f for f in faults if f.outcome == "recovered"]
    restarted = [f for f in faults if f.outcome == "restarted"]
    recovery = rounded([f.seconds for f in recovered if f.seconds is not None])
    restart = rounded([f.seconds for f in restarted if f.seconds is not None])
    stall = rounded(
        [f.seconds for f in faults if f.outcome == "absorbed" and f.seconds is not None]
    )
    return {
        "faults": len(faults),
        "recoveries": len(recovered),
        "restarts": len(restarted),
        "absorbed": sum(1 for f in faults if f.outcome == "absorbed"),
        "hangs": sum(1 for f in faults if f.outcome == "hang"),
        "unfinished": sum(1 for f in faults if f.outcome == "unfinished"),
        "lost_checkpoints": sum(len(f.lost_checkpoints) for f in faults),
        "recovery_seconds": recovery,
        "recovery_p50": percentile(recovery),
        "recovery_max": max(recovery, default=None),
        "library_recovery_seconds": [
            f.library_seconds for f in recovered if f.library_seconds is not None
        ],
        "restart_seconds": restart,
        "restart_p50": percentile(restart),
        "restart_max": max(restart, default=None),
        "stall_seconds": stall,
    }


def percentile(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def fault_record(fault: Fault) -> dict[str, Any]:
    record = asdict(fault)
    for key in ("injected_at", "continued_at"):
        if record[key] is not None:
            record[key] = round(record[key] - START, 3)
    for key in ("seconds", "library_seconds", "detected", "offset", "hold"):
        if record[key] is not None:
            record[key] = round(record[key], 3)
    record["note"] = record["note"].strip()
    return record


def print_table(report: dict[str, Any]) -> None:
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    header = (
        f"{'kind':<20} {'faults':>6} {'recov':>5} {'restart':>7} {'absorb':>6} {'hang':>4} "
        f"{'lost ckpt':>9} {'recov p50/max s':>16} {'restart p50/max s':>18}"
    )
    print(header)
    rows = [*report["per_kind"].items(), ("all", summary_row(report))]
    for kind, row in rows:
        print(
            f"{kind:<20} {row['faults']:>6} {row['recoveries']:>5} {row['restarts']:>7} "
            f"{row['absorbed']:>6} {row['hangs']:>4} {row['lost_checkpoints']:>9} "
            f"{fmt(row['recovery_p50']) + ' / ' + fmt(row['recovery_max']):>16} "
            f"{fmt(row['restart_p50']) + ' / ' + fmt(row['restart_max']):>18}"
        )
    if report.get("engine") == "ray":
        print(
            f"bitwise equal: {report['bitwise_equal']}; hangs: {report['hangs']}; "
            f"unfinished runs: {report['unfinished_runs']}; jobs failed for good: "
            f"{len(report['failed_jobs'])}; processes left behind: "
            f"{len(report['leftover_processes'])}; wall {report['wall_seconds']} s"
        )
        return
    failed = report["failed_attempts"]
    print(
        f"bitwise equal: {report['bitwise_equal']}; hangs: {report['hangs']}; "
        f"unfinished runs: {report['unfinished_runs']}; "
        f"non-zero exits after the work was done: {len(report['finished_nonzero_exits'])}; "
        f"failed job starts: {failed['count']} "
        f"({failed['named_within_10s']} ended naming rank and phase within 10 s); "
        f"wall {report['wall_seconds']} s"
    )


def summary_row(report: dict[str, Any]) -> dict[str, Any]:
    rows = list(report["per_kind"].values())
    recovery, restart = report["recovery_seconds"], report["restart_seconds"]
    return {
        "faults": report["faults"],
        "recoveries": report["recoveries"],
        "restarts": report["restarts"],
        "absorbed": report["absorbed"],
        "hangs": sum(row["hangs"] for row in rows),
        "lost_checkpoints": report["lost_checkpoints"],
        "recovery_p50": percentile(recovery),
        "recovery_max": max(recovery, default=None),
        "restart_p50": percentile(restart),
        "restart_max": max(restart, default=None),
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--faults", type=int, required=True, help="faults to inject in all")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--followers", type=int, choices=[2, 3], default=2)
    parser.add_argument("--no-recovery", action="store_true", help="restart the job whole")
    parser.add_argument(
        "--engine",
        default="processes",
        choices=["processes", "ray"],
        help="ray: the job through lampdist.ray.run (benchmarks/_chaos_ray.py)",
    )
    parser.add_argument(
        "--kinds",
        type=lambda text: text.split(","),
        default=None,
        help=f"comma-separated, of {', '.join(KINDS + OPTIONAL_KINDS)} (with --engine ray: "
        f"of {', '.join(RAY_KINDS)}); all but root_term by default",
    )
    parser.add_argument(
        "--budget", type=float, default=float("inf"), help="ray: seconds, then no new run"
    )
    parser.add_argument("--faults-per-run", type=int, default=3, help="at most, per run")
    parser.add_argument("--windows", type=int, default=10, help="windows (epochs) per run")
    parser.add_argument("--steps-per-window", type=int, default=4)
    parser.add_argument("--batch-sleep", type=float, default=0.07)
    parser.add_argument(
        "--batch-compute", action="store_true", help="spend --batch-sleep in torch operations"
    )
    parser.add_argument(
        "--step-on", default="root", choices=["root", "every_rank", "sharded", "fsdp"]
    )
    parser.add_argument("--heartbeat-interval", type=float, default=0.25)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--stop-timeout", type=float, default=1.0, help="Timeouts.stop")
    parser.add_argument("--rejoin-timeout", type=float, default=20.0)
    parser.add_argument("--max-recoveries", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="logs and checkpoints")
    parser.add_argument("--keep", action="store_true", help="keep the workdir after success")
    parser.add_argument("--notes", default="", help="a line for the JSON (the machine's load)")
    args = parser.parse_args(argv)
    known = RAY_KINDS if args.engine == "ray" else KINDS + OPTIONAL_KINDS
    if args.kinds is None:
        args.kinds = list(RAY_KINDS if args.engine == "ray" else KINDS)
    unknown = [kind for kind in args.kinds if kind not in known]
    if unknown:
        parser.error(f"unknown kinds {unknown}")
    if args.faults < 0:
        parser.error("--faults must be >= 0")
    return args


START = time.monotonic()


def main(argv: list[str]) -> int:
    args = parse(argv)
    settings = Settings(
        followers=args.followers,
        recovery=not args.no_recovery,
        epochs=args.windows,
        steps_per_window=args.steps_per_window,
        batch_sleep=args.batch_sleep,
        batch_compute=args.batch_compute,
        step_on=args.step_on,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        join_timeout=20.0,
        collective_timeout=10.0,
        stop_timeout=args.stop_timeout,
        rejoin_timeout=args.rejoin_timeout,
        max_recoveries=args.max_recoveries,
    )
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lampdist-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.engine == "ray":
        import _chaos_ray

        report = _chaos_ray.run(args, settings, workdir, sys.modules[__name__])
        return finish(args, report, workdir)
    harness = Harness(args, settings, workdir)
    harness.log(
        f"{args.faults} faults, seed {args.seed}, {args.followers} followers, "
        f"{'recovery' if settings.recovery else 'no recovery'}; logs in {workdir}"
    )
    try:
        harness.run_reference()
        harness.run_all()
    finally:
        harness.close()
    return finish(args, harness.report(), workdir)


def finish(args: argparse.Namespace, report: dict[str, Any], workdir: Path) -> int:
    """Write and print the report; the exit status."""
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    clean = (
        report["hangs"] == 0
        and report["lost_checkpoints"] == 0
        and report["bitwise_equal"]
        and not report["finished_nonzero_exits"]
        and not report.get("leftover_processes")
    )
    if clean and not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs: {workdir}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
