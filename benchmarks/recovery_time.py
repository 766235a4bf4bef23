"""The time from a kill to training again: a follower's process SIGKILLed while the job of
``benchmarks/chaos_rank.py`` trains on 3 CPU ranks, under three launchers.

    unshare -n sh -c 'ip link set lo up && python benchmarks/recovery_time.py \\
        --repeats 5 [--modes processes,ray,torchrun] [--json PATH]'

- ``processes``: the ranks as plain processes; the script, as a supervisor, starts the
  killed rank again at once and the root takes it back in the job (``lampdist.Recovery``);
- ``ray``: the job through ``lampdist.ray.run`` on a local Ray instance: Ray starts the
  killed actor again (``max_restarts``) and it rejoins the job;
- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node 3
  --max-restarts N``: torchrun ends the survivors and starts the whole group again, which
  resumes from the newest checkpoint (written every window).

Every rank runs :func:`chaos_rank.launched` (the same model, data, windows and checkpoints;
``lampdist.train(..., launch=env)``). "Training again" is the root's first progress event
after the root's recovery event (processes, ray) or after the restarted root started
(torchrun). Each mode kills rank 1 ``--repeats`` times, each time two windows after the
previous recovery, and reports each time, the median and the maximum. Ray needs a
loopback-only network namespace (the command above, as root); the script refuses to run
the ``ray`` mode elsewhere.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _chaos_ray  # noqa: E402
import chaos_rank  # noqa: E402

NRANKS = 3
WINDOWS = 100_000  # more than any measurement takes: the job is ended by the script
SETTLE_WINDOWS = 2
DEADLINE = 120.0


def rank_args(out: Path, rank: int = 0) -> list[str]:
    return [
        "--rank", str(rank), "--nranks", str(NRANKS), "--out", str(out),
        "--checkpoint", str(out / "checkpoints"), "--epochs", str(WINDOWS),
        "--batch-sleep", "0.07", "--rejoin-timeout", "60", "--max-recoveries", "1000",
    ]  # fmt: skip


def rank_main(argv: list[str]) -> None:
    """One rank: ``--port P`` a plain process, else torchrun's (``launch.from_env()``)."""
    from lampdist import launch

    args = chaos_rank.parse(argv)
    if "--port" in argv:
        env = launch.LaunchEnv(
            rank=args.rank,
            nranks=args.nranks,
            host="127.0.0.1",
            port=args.port,
            secret=os.environ["LAMPDIST_SECRET"],
        )
    else:
        env = launch.from_env()
    anyio.run(chaos_rank.launched, args, env)


def wait_for(condition: Callable[[], Any], what: str, timeout: float = DEADLINE) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"recovery_time: no {what} within {timeout} s")
        time.sleep(0.01)


def measure(out: Path, repeats: int, kill: Callable[[int], None], restarts: bool) -> list[float]:
    """Kill rank 1 ``repeats`` times; each time, seconds from the kill to the root's first
    progress after the recovery event (``restarts``: after the restarted root started)."""
    attempt = _chaos_ray.Attempt(out)
    times: list[float] = []
    since = 0.0
    for _ in range(repeats):

        def settled(since: float = since) -> bool:
            attempt.read()
            windows = {epoch for stamp, kind, epoch, *_ in attempt.events if stamp > since}
            return len(windows) > SETTLE_WINDOWS

        wait_for(settled, "training")
        pid = attempt.pids(1)[-1][0]
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        kill(pid)

        def again(killed: float = killed) -> float | None:
            attempt.read()
            if restarts:
                marks = [stamp for _, stamp in attempt.pids(0) if stamp > killed]
            else:
                marks = [stamp for stamp, *_ in attempt.recovered if stamp > killed]
            return attempt.first_event_after(marks[0]) if marks else None

        since = wait_for(again, "training after the kill")
        times.append(round(since - killed, 3))
        print(f"  kill -> training again: {times[-1]:.2f} s", flush=True)
    return times


def run_processes(out: Path, repeats: int) -> list[float]:
    port = free_port()
    env = {**os.environ, "LAMPDIST_SECRET": secrets.token_hex(16), "OMP_NUM_THREADS": "1"}

    def start(rank: int) -> subprocess.Popen[bytes]:
        argv = [sys.executable, __file__, "--rank-main", *rank_args(out, rank), "--port", str(port)]
        log = (out / f"rank{rank}.log").open("ab")
        return subprocess.Popen(argv, env=env, stdout=log, stderr=log)

    procs = [start(0)]
    wait_for(lambda: port_open(port), "root listening")
    procs += [start(rank) for rank in range(1, NRANKS)]

    def replace(_: int) -> None:  # the supervisor: the same command again, at once
        procs[1].wait()
        procs[1] = start(1)

    try:
        return measure(out, repeats, replace, restarts=False)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def run_torchrun(out: Path, repeats: int) -> list[float]:
    env = {**os.environ, "LAMPDIST_SECRET": secrets.token_hex(16), "OMP_NUM_THREADS": "1"}
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(NRANKS), "--max-restarts", str(repeats),
        __file__, "--rank-main", *rank_args(out),
    ]  # fmt: skip
    with (out / "torchrun.log").open("ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        # under torchrun every rank reads its rank from the environment: rank_args' 0 is
        # overridden by launch.from_env() in chaos_rank.launched
        return measure(out, repeats, lambda _: None, restarts=True)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_ray(out: Path, repeats: int) -> list[float]:
    why = _chaos_ray.loopback_only()
    if why is not None:
        raise SystemExit(why)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import lampdist.ray
    import ray

    ray.init(num_cpus=NRANKS, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="rt-"))
    main = functools.partial(chaos_rank.launched, chaos_rank.parse(rank_args(out)))
    times: list[float] = []

    async def both() -> None:
        async with anyio.create_task_group() as group:
            run = functools.partial(lampdist.ray.run, main, nranks=NRANKS, max_restarts=repeats + 1)
            group.start_soon(run)
            measured = functools.partial(measure, out, repeats, lambda _: None, restarts=False)
            times.extend(await anyio.to_thread.run_sync(measured))
            group.cancel_scope.cancel()  # releases the actors

    try:
        anyio.run(both)
    finally:
        ray.shutdown()
    return times


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


MODES = {"processes": run_processes, "ray": run_ray, "torchrun": run_torchrun}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--rank-main"]:
        rank_main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="recovery_time", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES), help=", ".join(MODES))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--notes", default="")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="recovery-time-"))
    report: dict[str, Any] = {"repeats": args.repeats, "notes": args.notes, "modes": {}}
    for mode in args.modes.split(","):
        out = workdir / mode
        out.mkdir(parents=True, exist_ok=True)
        print(f"{mode}:", flush=True)
        times = MODES[mode](out, args.repeats)
        report["modes"][mode] = {
            "seconds": times,
            "p50": round(statistics.median(times), 3),
            "max": max(times),
        }
        print(f"{mode}: p50 {statistics.median(times):.2f} s, max {max(times):.2f} s", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
