"""Exit codes of finished runs: every process of a 2-rank run that completed must exit 0.

    python benchmarks/exit_codes.py --runs 100 [--variants plain,recovered,ddp,...]
        [--budget 500] [--json PATH] [--workdir DIR] [--keep] [--source SRC] [--cores]

Runs ``--runs`` short 2-rank jobs of each variant, one job at a time (every rank a process
on 127.0.0.1, a tiny CPU model), the variants interleaved, and records every process's exit
code, with the stderr of each that exited non-zero:

- ``plain``: a root and a follower of ``benchmarks/chaos_rank.py`` (with recovery), 3
  windows of 3 steps, a batch source that sleeps 10 ms a batch, no fault;
- ``recovered``: the same, with the follower SIGKILLed once the root trains its second
  window and started again with the same command line; the root takes it back and the run
  completes (the killed process's -9 is the fault, not counted);
- ``plain-compute``, ``recovered-compute``: the same with a batch source that spends
  ``--compute-seconds`` (40 ms) a batch in torch operations (``chaos_rank.py
  --batch-compute``), as one that prepares its batches with torch does;
- ``ddp``: the DDP baseline of ``benchmarks/throughput.py`` (``_loops.py``, kind ``ddp``,
  model ``small``, 6 steps);
- ``ddp-min``: a minimal DDP script over torch's default Gloo group that ends with
  ``dist.barrier()`` and ``destroy_process_group()`` while DDP still holds the group (torch
  alone, no lampdist: the reference for torch's own exit race).

A job is finished when the root printed ``DONE`` once its run completed (the lampdist
variants; a ``recovered`` job also needs the root's line that it recovered the follower) or
when every rank printed its last line (``ddp``, ``ddp-min``), whatever its exit code. Every
process of a finished job that took part in its end (the root, the follower that saw the
STOP) must then exit 0: any other code is counted as a non-zero exit of a finished run, with
its stderr. The children run with
``PYTHONFAULTHANDLER=1`` (unless ``--no-faulthandler``): a SIGABRT prints the Python stack of
every thread into that stderr; with ``--cores`` they may dump core into their job's
directory (``gdb python core``).

Prints the counts as JSON and writes them (with every non-zero exit's stderr) to ``--json``,
by default ``benchmarks/results/exit-codes-<date>.json``. ``--budget`` seconds (default 500)
bound one invocation: no job starts after it, and the report says how many ran. ``--source``
runs another lampdist source tree (a checkout's ``src``). The exit status is 1 when a
finished run had a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RANK_SCRIPT = HERE / "chaos_rank.py"
LOOPS = HERE / "_loops.py"
RESULTS = HERE / "results"
VARIANTS = ("plain", "recovered", "plain-compute", "recovered-compute", "ddp", "ddp-min")
JOB_TIMEOUT = 90.0
STDERR_TAIL = 6000
CHAOS_ARGS = [
    "--nranks", "2",
    "--epochs", "3",
    "--steps-per-window", "3",
    "--heartbeat-interval", "0.25",
    "--heartbeat-timeout", "2.0",
    "--rejoin-timeout", "30",
    "--stop-timeout", "2.0",
]  # fmt: skip
BATCH_SLEEP = 0.01
"""Seconds a batch takes in the source, asleep (``--compute-seconds``: in torch operations,
for the ``-compute`` variants)."""
KILL_WINDOW = 1
"""The recovered variant kills the follower once the root reports training in this window."""

DDP_MIN = """\
import os, sys
import torch
import torch.distributed as dist
from torch import nn

rank, nranks = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=nranks)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
generator = torch.Generator().manual_seed(rank)
for _ in range(6):
    inputs = torch.randn(16, 8, generator=generator)
    loss = model(inputs).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.barrier()
dist.destroy_process_group()
print("DONE", flush=True)
"""


@dataclass
class Exit:
    """One process of a job and how it ended."""

    rank: int
    role: str
    """root, follower, killed (the recovered variant's fault), replacement."""
    code: int | None
    seconds: float
    stderr: str = ""


@dataclass
class Job:
    """One job of one variant."""

    variant: str
    index: int
    finished: bool
    seconds: float
    exits: list[Exit] = field(default_factory=list)
    note: str = ""

    def counted(self) -> list[Exit]:
        """The processes whose exit code must be 0 in a finished job."""
        return [each for each in self.exits if each.role != "killed"]

    def nonzero(self) -> list[Exit]:
        return [each for each in self.counted() if each.code != 0] if self.finished else []


class Process:
    """A child process with its stdout lines collected by a thread and stderr in a file."""

    cores = False
    """Whether children may dump core, into their job's directory (``--cores``)."""

    def __init__(
        self, argv: list[str], rank: int, role: str, env: dict[str, str], log: Path
    ) -> None:
        self.rank, self.role, self.log = rank, role, log
        self.started = time.monotonic()
        self.lines: list[str] = []
        self._err = log.open("wb")
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=env,
            text=True,
            start_new_session=True,
            cwd=log.parent if self.cores else None,
            preexec_fn=_allow_cores if self.cores else None,  # noqa: PLW1509  # sets a limit only
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, deadline: float) -> int | None:
        try:
            return self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def end(self) -> Exit:
        """Kill it if it is still running, reap it, and say how it ended."""
        code = self.popen.poll()
        if code is None:
            self.popen.kill()
            self.popen.wait()
        self._reader.join(timeout=5)
        self._err.close()
        seconds = time.monotonic() - self.started
        stderr = ""
        if code != 0:
            stderr = self.log.read_text(errors="replace")[-STDERR_TAIL:]
        return Exit(
            rank=self.rank, role=self.role, code=code, seconds=round(seconds, 2), stderr=stderr
        )


def _allow_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def environment(faulthandler: bool, source: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "LAMPDIST_SECRET": secrets.token_hex(16),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "LAMPDIST_CHAOS_LOG": "WARNING",
    }
    if faulthandler:
        env["PYTHONFAULTHANDLER"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), env.get("PYTHONPATH", "")]))
    return env


class _Unfinished(Exception):
    """The job cannot finish (said why)."""


def _await_line(proc: Process, prefix: str, deadline: float, why: str) -> str:
    """The first line of ``proc``'s stdout that starts with ``prefix``, once it came; raises
    :class:`_Unfinished` (saying ``why``) when the process ended or the deadline passed."""
    while True:
        found = next((line for line in proc.lines if line.startswith(prefix)), None)
        if found is not None:
            return found
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise _Unfinished(why)
        time.sleep(0.005)


def run_lampdist(
    variant: str, index: int, directory: Path, env: dict[str, str], compute_seconds: float
) -> Job:
    """A root and a follower of the chaos rank script; ``recovered`` kills the follower in
    window :data:`KILL_WINDOW` and starts it again."""
    directory.mkdir(parents=True)
    started = time.monotonic()
    deadline = started + JOB_TIMEOUT
    out = directory / "out"
    compute = variant.endswith("-compute")
    source = ["--batch-sleep", str(compute_seconds if compute else BATCH_SLEEP)]
    source += ["--batch-compute"] if compute else []
    common = [sys.executable, str(RANK_SCRIPT), *CHAOS_ARGS, *source, "--out", str(out)]
    root = Process(
        [*common, "--rank", "0", "--checkpoint", str(directory / "checkpoints")],
        0,
        "root",
        env,
        directory / "rank0.err",
    )
    procs = [root]
    note = ""
    try:
        port = _await_line(root, "PORT ", deadline, "the root ended before it listened").split()[1]
        follower_argv = [*common, "--rank", "1", "--port", port]
        follower = Process(follower_argv, 1, "follower", env, directory / "rank1-0.err")
        procs.append(follower)
        if variant.startswith("recovered"):
            mark = f"EVENT train {KILL_WINDOW} "
            _await_line(root, mark, deadline, "the run ended before the fault")
            time.sleep(random.uniform(0.0, 0.05))
            follower.role = "killed"
            follower.popen.send_signal(signal.SIGKILL)
            follower.popen.wait()
            procs.append(Process(follower_argv, 1, "replacement", env, directory / "rank1-1.err"))
        for proc in procs:
            if proc.wait(deadline) is None:
                note = "past the job's deadline: killed"
    except _Unfinished as exc:
        note = str(exc)
    exits = [proc.end() for proc in procs]
    recovered = "recovered rank(s)" in root.log.read_text(errors="replace")
    if variant.startswith("recovered") and not recovered and not note:
        note = "the root did not say that it recovered the follower"
    finished = "DONE" in root.lines and not note
    return Job(variant, index, finished, round(time.monotonic() - started, 2), exits, note)


def run_ddp(variant: str, index: int, directory: Path, env: dict[str, str]) -> Job:
    """Two ranks of the throughput benchmark's DDP baseline, or of the minimal DDP script."""
    directory.mkdir(parents=True)
    started = time.monotonic()
    deadline = started + JOB_TIMEOUT
    port = free_port()
    env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = []
    for rank in range(2):
        if variant == "ddp":
            spec = {
                "config": "ddp",
                "kind": "ddp",
                "model": "small",
                "device_type": "cpu",
                "rank": rank,
                "nranks": 2,
                "steps": 6,
                "warmup": 1,
                "threads": 1,
                "port": port,
                "ready_file": str(directory / "ready"),
                "result_file": str(directory / f"rank{rank}.json"),
                "kwargs": {},
            }
            spec_file = directory / f"rank{rank}.spec.json"
            spec_file.write_text(json.dumps(spec))
            argv = [sys.executable, str(LOOPS), str(spec_file)]
        else:
            script = directory / "ddp_min.py"
            script.write_text(DDP_MIN)
            argv = [sys.executable, str(script), str(rank), "2"]
        role = "root" if rank == 0 else "follower"
        procs.append(Process(argv, rank, role, env, directory / f"rank{rank}.err"))
    note = ""
    for proc in procs:
        if proc.wait(deadline) is None:
            note = "past the job's deadline: killed"
    exits = [proc.end() for proc in procs]
    if variant == "ddp":
        done = all((directory / f"rank{rank}.json").exists() for rank in range(2))
    else:
        done = all("DONE" in proc.lines for proc in procs)
    return Job(variant, index, done and not note, round(time.monotonic() - started, 2), exits, note)


def summarize(jobs: list[Job], variants: list[str]) -> dict[str, Any]:
    per_variant: dict[str, Any] = {}
    for variant in variants:
        mine = [job for job in jobs if job.variant == variant]
        finished = [job for job in mine if job.finished]
        counted = [each for job in finished for each in job.counted()]
        nonzero = [each for job in finished for each in job.nonzero()]
        per_variant[variant] = {
            "jobs": len(mine),
            "finished": len(finished),
            "unfinished": len(mine) - len(finished),
            "processes": len(counted),
            "nonzero_exits": len(nonzero),
            "jobs_with_nonzero_exit": sum(1 for job in finished if job.nonzero()),
            "codes": dict(Counter(str(each.code) for each in counted)),
            "nonzero_by_role": dict(Counter(each.role for each in nonzero)),
            "seconds_per_job": round(sum(job.seconds for job in mine) / len(mine), 2)
            if mine
            else None,
        }
    finished = [job for job in jobs if job.finished]
    return {
        "finished_runs": len(finished),
        "nonzero_exits": sum(len(job.nonzero()) for job in finished),
        "per_variant": per_variant,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="exit_codes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20, help="jobs per variant")
    parser.add_argument(
        "--variants",
        type=lambda text: text.split(","),
        default=["plain", "recovered", "ddp"],
        help=f"comma-separated, of {', '.join(VARIANTS)}",
    )
    parser.add_argument("--budget", type=float, default=500.0, help="seconds: no job starts after")
    parser.add_argument("--seed", type=int, default=0, help="the recovered variant's kill moments")
    parser.add_argument(
        "--compute-seconds",
        type=float,
        default=0.04,
        help="seconds a batch takes in torch operations in the -compute variants",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--label", default="", help="a note kept in the report")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the workdir after a clean result")
    parser.add_argument(
        "--source",
        type=Path,
        default=HERE.parent / "src",
        help="the lampdist source tree the ranks import (default: this checkout's src)",
    )
    parser.add_argument("--no-faulthandler", action="store_true")
    parser.add_argument(
        "--cores", action="store_true", help="let the children dump core (in their job's dir)"
    )
    args = parser.parse_args(argv)
    unknown = [variant for variant in args.variants if variant not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    random.seed(args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lampdist-exit-codes-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = environment(not args.no_faulthandler, args.source.resolve())
    Process.cores = args.cores
    began = time.monotonic()
    jobs: list[Job] = []
    stopped_early = False
    for index in range(args.runs):
        for variant in args.variants:
            if time.monotonic() - began > args.budget:
                stopped_early = True
                break
            directory = workdir / f"{variant}-{index:04d}"
            if variant.startswith("ddp"):
                job = run_ddp(variant, index, directory, env)
            else:
                job = run_lampdist(variant, index, directory, env, args.compute_seconds)
            jobs.append(job)
            bad = job.nonzero()
            if bad or not job.finished:
                said = ", ".join(f"rank {each.rank} ({each.role}) {each.code}" for each in bad)
                state = "finished" if job.finished else f"UNFINISHED ({job.note})"
                print(f"{variant} #{index}: {state}; non-zero: {said or 'none'}", flush=True)
            elif not args.keep:
                shutil.rmtree(directory, ignore_errors=True)
        if stopped_early:
            break
    report = {
        "date": date.today().isoformat(),
        "label": args.label,
        "command": " ".join(["python", "benchmarks/exit_codes.py", *argv]),
        "runs_asked": args.runs,
        "stopped_by_budget": stopped_early,
        "wall_seconds": round(time.monotonic() - began, 1),
        **summarize(jobs, args.variants),
        "nonzero_details": [
            {"variant": job.variant, "job": job.index, **asdict(each)}
            for job in jobs
            for each in job.nonzero()
        ],
        "unfinished_details": [
            {
                "variant": job.variant,
                "job": job.index,
                "note": job.note,
                "exits": [
                    {k: v for k, v in asdict(each).items() if k != "stderr"} for each in job.exits
                ],
            }
            for job in jobs
            if not job.finished
        ],
    }
    path = args.json or RESULTS / f"exit-codes-{report['date']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    summary = {key: report[key] for key in ("finished_runs", "nonzero_exits", "per_variant")}
    print(json.dumps(summary, indent=2))
    print(f"report: {path}; logs: {workdir}")
    clean = report["nonzero_exits"] == 0
    if clean and not args.keep and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
