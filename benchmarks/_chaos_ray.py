"""The Ray side of the chaos run (``benchmarks/chaos.py --engine ray``): the job of
``benchmarks/chaos_rank.py`` (its :func:`chaos_rank.launched`, the rank's main as an async
function of a LaunchEnv) run through :func:`lampdist.ray.run` on a local Ray instance, one
actor per rank, while faults strike the actors' processes:

- ``actor_kill``: SIGKILL of a follower's actor process: Ray starts the actor again
  (``max_restarts``) and it rejoins the run in flight (``lampdist.Recovery``);
- ``root_kill``: SIGKILL of the root actor's process: the attempt ends and the job starts
  again from the newest checkpoint (``max_failures``);
- ``actor_stall_short`` / ``actor_stall_long``: SIGSTOP of a follower's process, SIGCONT
  after a delay shorter than the heartbeat deadline (5 s, the control channel's default
  under a launcher), or longer;
- ``actor_stall_never``: SIGSTOP and no SIGCONT: the root misses its heartbeats, ends the
  process, and Ray starts the actor again.

Each start of a rank appends its process id to ``pids-<r>.txt`` and the root appends its
progress events and recoveries, stamped with ``time.time()``, to ``events.txt`` in the run's
directory: the harness reads both to strike and to time. Ray must be confined to the
loopback: run the whole chaos script in a network namespace whose only interface is ``lo``
(``unshare -n sh -c 'ip link set lo up && python benchmarks/chaos.py --engine ray ...'``,
as root); :func:`run` refuses otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

HERE = Path(__file__).resolve().parent
HEARTBEAT_TIMEOUT = 5.0
"""The control channel's default heartbeat deadline, which ranks under a launcher get."""
MAX_RESTARTS = 12
MAX_FAILURES = 7
POLL = 0.02
HANG_GRACE = 30.0


def loopback_only() -> str | None:
    """Why this process is not in a loopback-only network namespace (None: it is)."""
    names = sorted(name for _, name in socket.if_nameindex())
    if names != ["lo"]:
        return (
            f"chaos.py --engine ray runs Ray on the loopback only, but this network namespace "
            f"has the interfaces {names}: run it as "
            "unshare -n sh -c 'ip link set lo up && python benchmarks/chaos.py --engine ray ...'"
        )
    return None


@dataclass
class Attempt:
    """What one run's files say so far."""

    out: Path
    events: list[tuple[float, str, int, int, bool]] = field(default_factory=list)
    recovered: list[tuple[float, str, float]] = field(default_factory=list)
    _read: int = 0

    def read(self) -> None:
        path = self.out / "events.txt"
        try:
            with path.open() as file:
                file.seek(self._read)
                text = file.read()
        except FileNotFoundError:
            return
        complete = text[: text.rfind("\n") + 1]
        self._read += len(complete.encode())
        for line in complete.splitlines():
            parts = line.split()
            if len(parts) == 6 and parts[1] == "EVENT":
                stamp, _, kind, epoch, step, done = parts
                self.events.append((float(stamp), kind, int(epoch), int(step), done == "1"))
            elif len(parts) == 4 and parts[1] == "RECOVERED":
                self.recovered.append((float(parts[0]), parts[2], float(parts[3])))

    def pids(self, rank: int) -> list[tuple[int, float]]:
        try:
            lines = (self.out / f"pids-{rank}.txt").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [(int(pid), float(stamp)) for pid, stamp in (line.split() for line in lines)]

    def window(self) -> int | None:
        return self.events[-1][2] if self.events else None

    def first_event_after(self, moment: float) -> float | None:
        return next((stamp for stamp, *_ in self.events if stamp > moment), None)


def running(pid: int) -> bool:
    """Whether ``pid`` runs (not ended, not a zombie, not stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X", "T", "t")


class RayHarness:
    """The chaos run on Ray: the reference job, then jobs with faults, and the report
    (``chaos``, the chaos.py module, lends its records, checks and summaries)."""

    def __init__(self, args: argparse.Namespace, settings: Any, workdir: Path, chaos: Any):
        self.args, self.settings, self.workdir, self.chaos = args, settings, workdir, chaos
        self.faults: list[Any] = []
        self.runs: list[dict[str, Any]] = []
        self.hangs: list[str] = []
        self.leftovers: list[str] = []
        self.failed: list[dict[str, Any]] = []
        self.reference: list[dict[str, Any]] | None = None
        self.reference_seconds = 0.0
        self.window_seconds = 0.3
        self.stopped: list[int] = []
        """Processes stopped by a fault and not continued yet."""

    def log(self, message: str) -> None:
        print(f"[chaos-ray {time.monotonic() - self.chaos.START:7.2f}] {message}", flush=True)

    def rank_args(self, out: Path) -> argparse.Namespace:
        import chaos_rank

        argv = ["--rank", "0", "--out", str(out), "--checkpoint", str(out / "checkpoints")]
        return chaos_rank.parse([*argv, *self.settings.rank_args()])

    async def run_job(self, out: Path, batch: list[Any], run: int) -> dict[str, Any]:
        """One job through lampdist.ray.run while ``batch`` strikes, one fault at a time."""
        import chaos_rank
        import lampdist.ray

        main = functools.partial(chaos_rank.launched, self.rank_args(out))
        attempt = Attempt(out)
        result: dict[str, Any] = {"completed": False, "error": None, "weights": None}
        started = time.monotonic()
        deadline = 3 * self.reference_seconds + 60 + len(batch) * 45

        async def job() -> None:
            try:
                result["weights"] = await lampdist.ray.run(
                    main,
                    nranks=self.settings.nranks,
                    max_restarts=MAX_RESTARTS,
                    max_failures=MAX_FAILURES,
                    join_timeout=self.settings.join_timeout,
                )
                result["completed"] = True
            except Exception as exc:  # the job failed for good
                result["error"] = f"{type(exc).__name__}: {exc}"[:600]
            finally:
                group.cancel_scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(job)
            with anyio.move_on_after(deadline + HANG_GRACE) as watch:
                await self.strike(attempt, list(batch), run)
                await anyio.sleep_forever()
            if watch.cancelled_caught:
                self.hangs.append(f"run {run}: not done within {deadline + HANG_GRACE:.0f} s")
                self.log(f"run {run}: HANG: cancelled after {deadline + HANG_GRACE:.0f} s")
                group.cancel_scope.cancel()
        self.settle(attempt, batch, result)
        self.check_ended(attempt, run)
        return {**result, "seconds": time.monotonic() - started, "events": attempt.events}

    async def strike(self, attempt: Attempt, queue: list[Any], run: int) -> None:
        """Inject the queue's faults one at a time, each once the previous one has settled."""
        while queue:
            fault = queue[0]
            since, window = time.time(), None
            while True:
                await anyio.sleep(POLL)
                attempt.read()
                if window is None and attempt.events:
                    window = attempt.window()
                when = self.strike_time(attempt, fault, since, window)
                if when is not None and time.time() >= when and self.ready(attempt):
                    break
            queue.pop(0)
            self.inject(attempt, fault, run)
            while not self.resolve(attempt, fault):
                await anyio.sleep(POLL)
                attempt.read()
            took = "" if fault.seconds is None else f" after {fault.seconds:.2f} s"
            self.log(f"run {run}: {fault.describe()}: {fault.outcome}{took}")

    def strike_time(
        self, attempt: Attempt, fault: Any, since: float, window: int | None
    ) -> float | None:
        target = (window if window is not None else -1) + fault.gap
        for stamp, kind, epoch, _, _ in attempt.events:
            if kind == "train" and epoch >= target and stamp > since:
                return stamp + fault.offset * self.window_seconds
        return None

    def ready(self, attempt: Attempt) -> bool:
        """Every rank's newest process runs, started after the root's newest."""
        pids = [attempt.pids(rank) for rank in range(self.settings.nranks)]
        if not all(pids):
            return False
        root_start = pids[0][-1][1]
        return all(running(p[-1][0]) and p[-1][1] >= root_start for p in pids)

    def inject(self, attempt: Attempt, fault: Any, run: int) -> None:
        fault.run, fault.attempt = run, len(attempt.pids(0)) - 1
        fault.checkpoints_before = self.chaos.committed(attempt.out / "checkpoints")
        fault.window = attempt.window()
        pid = attempt.pids(fault.rank)[-1][0]
        fault.injected_at = time.time()
        if fault.kind.endswith("kill"):
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            self.stopped.append(pid)
            if fault.kind == "actor_stall_short":
                fault.continued_at = fault.injected_at + HEARTBEAT_TIMEOUT * (
                    0.15 + 0.45 * fault.hold
                )
            elif fault.kind == "actor_stall_long":
                fault.continued_at = fault.injected_at + HEARTBEAT_TIMEOUT + 1 + 2 * fault.hold
        fault.note += f" pid {pid};"
        self.log(f"run {run}: inject {fault.describe()} (pid {pid})")

    def resolve(self, attempt: Attempt, fault: Any) -> bool:
        """Settle the fault: recovered (the root's recovery event), restarted (a new root
        process: the next attempt's first progress), absorbed (progress, nothing lost)."""
        now, after = time.time(), fault.injected_at
        if fault.continued_at is not None and now >= fault.continued_at and self.stopped:
            self.continue_stopped()
        for stamp, ranks, seconds in attempt.recovered:
            if stamp > after:
                fault.outcome, fault.seconds = "recovered", stamp - after
                fault.library_seconds, fault.seconds_from = seconds, "the root's recovery event"
                fault.lost = [int(rank) for rank in ranks.split(",")]
                return True
        roots = [stamp for _, stamp in attempt.pids(0) if stamp > after]
        if roots:
            progress = attempt.first_event_after(roots[0])
            if progress is not None:
                fault.outcome, fault.seconds = "restarted", progress - after
                fault.seconds_from = "the restarted job's first progress"
            return progress is not None
        settled = fault.continued_at or after
        if fault.kind == "actor_stall_short" and now > settled + HEARTBEAT_TIMEOUT + 1.5:
            progress = attempt.first_event_after(settled)
            if progress is not None:
                fault.outcome, fault.seconds = "absorbed", progress - after
                fault.seconds_from = "the next progress"
                return True
        return False

    def continue_stopped(self) -> None:
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()

    def settle(self, attempt: Attempt, batch: list[Any], result: dict[str, Any]) -> None:
        """After the job: the faults it ended before they settled, and its checkpoints."""
        self.continue_stopped()
        attempt.read()
        for fault in batch:
            if fault.injected_at is None:
                continue
            if fault.outcome is None:
                fault.outcome = "absorbed" if result["completed"] else "unfinished"
                fault.note += " the run ended first;"
            for name in fault.checkpoints_before:
                directory = attempt.out / "checkpoints"
                if not (directory / name).is_dir() or not self.chaos.readable(directory, name):
                    fault.lost_checkpoints.append(name)

    def check_ended(self, attempt: Attempt, run: int) -> None:
        """Every process that ran a rank of the job has ended within 30 s of its end."""
        pids = [pid for rank in range(self.settings.nranks) for pid, _ in attempt.pids(rank)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            alive = [pid for pid in pids if Path(f"/proc/{pid}").exists() and _not_zombie(pid)]
            if not alive:
                return
            time.sleep(0.2)
        self.leftovers.append(f"run {run}: processes {alive} still there 30 s after the job")
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # -- the runs ------------------------------------------------------------------------

    async def run_reference(self) -> None:
        out = self.workdir / "reference"
        started = time.monotonic()
        result = await self.run_job(out, [], run=-1)
        self.reference_seconds = time.monotonic() - started
        if not result["completed"]:
            raise SystemExit(f"the uninterrupted reference run failed: {result['error']}")
        self.reference = result["weights"]
        starts = [stamp for stamp, kind, *_ in result["events"] if kind == "train"]
        windows = sorted({epoch for _, kind, epoch, _, _ in result["events"] if kind == "train"})
        if len(windows) > 1:
            self.window_seconds = (starts[-1] - starts[0]) / (len(windows) - 1)
        self.log(
            f"reference: {self.reference_seconds:.1f} s, "
            f"{self.window_seconds:.2f} s per window, {len(windows)} windows"
        )

    async def run_all(self, until: float) -> None:
        """Runs of one to ``--faults-per-run`` faults until every fault has struck or the
        ``--budget`` seconds are spent."""
        rng = self.chaos.random.Random(self.args.seed)
        kinds = self.args.kinds
        self.faults = self.chaos.plan_faults(rng, self.args.faults, kinds, self.settings.followers)
        pending, run = list(self.faults), 0
        while pending and run < 3 * len(self.faults) + 3 and time.monotonic() < until:
            take = min(len(pending), rng.randint(1, self.args.faults_per_run))
            batch, pending = pending[:take], pending[take:]
            result = await self.run_job(self.workdir / f"run-{run:03d}", batch, run)
            pending = [fault for fault in batch if fault.injected_at is None] + pending
            self.finish_run(run, result, batch)
            run += 1
        if pending:
            self.log(f"{len(pending)} faults never struck (the budget was spent)")

    def finish_run(self, run: int, result: dict[str, Any], batch: list[Any]) -> None:
        equal: bool | None = None
        differing: list[int] = []
        if result["completed"] and self.reference is not None:
            differing = [
                rank
                for rank, weights in enumerate(result["weights"])
                if not self.chaos.equal(weights, self.reference[rank])
            ]
            equal = not differing
        if result["error"] is not None:
            self.failed.append({"run": run, "error": result["error"]})
        record = {
            "run": run,
            "completed": result["completed"],
            "faults": [fault.index for fault in batch if fault.injected_at is not None],
            "bitwise_equal": equal,
            "ranks_differing": differing,
            "error": result["error"],
            "seconds": round(result["seconds"], 2),
        }
        self.runs.append(record)
        said = "equal" if equal else "DIFFER" if equal is False else "n/a"
        self.log(
            f"run {run}: {'completed' if result['completed'] else 'UNFINISHED'}, "
            f"{record['seconds']} s; weights {said}"
            + (f"; {result['error']}" if result["error"] else "")
        )

    def report(self, wall: float) -> dict[str, Any]:
        chaos = self.chaos
        struck = [fault for fault in self.faults if fault.injected_at is not None]
        for fault in struck:  # times relative to the chaos run's start, as chaos.py's
            fault.injected_at = fault.injected_at - time.time() + time.monotonic()
            if fault.continued_at is not None:
                fault.continued_at = fault.continued_at - time.time() + time.monotonic()
        return {
            "engine": "ray",
            **chaos.totals(struck, self.args.kinds, self.runs, planned=len(self.faults)),
            "hangs": len(self.hangs),
            "failed_jobs": self.failed,
            "hang_details": self.hangs,
            "leftover_processes": self.leftovers,
            "finished_nonzero_exits": [],
            "fault_log": [chaos.fault_record(fault) for fault in struck],
            "config": {
                "seed": self.args.seed,
                **chaos.asdict(self.settings),
                "kinds": self.args.kinds,
                "faults_per_run": self.args.faults_per_run,
                "max_restarts": MAX_RESTARTS,
                "max_failures": MAX_FAILURES,
                "heartbeat_timeout_under_ray": HEARTBEAT_TIMEOUT,
            },
            "notes": self.args.notes,
            "reference_seconds": round(self.reference_seconds, 2),
            "window_seconds": round(self.window_seconds, 3),
            "wall_seconds": round(wall, 1),
        }


def _not_zombie(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def run(args: argparse.Namespace, settings: Any, workdir: Path, chaos: Any) -> dict[str, Any]:
    """The chaos run on a local Ray instance of ``nranks`` CPUs; its report (chaos.py's,
    with ``engine: ray`` and the processes left behind)."""
    why = loopback_only()
    if why is not None:
        raise SystemExit(why)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local instance, in its namespace
    os.environ["OMP_NUM_THREADS"] = "1"
    import ray

    harness = RayHarness(args, settings, workdir, chaos)
    started = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="chaos-ray-")
    ray.init(
        num_cpus=settings.nranks, include_dashboard=False, log_to_driver=True, _temp_dir=scratch
    )
    try:
        anyio.run(harness.run_reference)
        anyio.run(harness.run_all, started + args.budget)
    finally:
        ray.shutdown()
    return harness.report(time.monotonic() - started)
