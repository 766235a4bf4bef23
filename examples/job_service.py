"""Training as a job of an async web service: start a job, stream its progress, cancel it.

    pip install -e ".[examples]"
    uvicorn --app-dir examples job_service:app     # or: python examples/job_service.py

    curl -X POST localhost:8000/jobs -d '{"epochs": 50}'     # -> {"id": 1, ...}
    curl -N localhost:8000/jobs/1/events                     # one JSON line per pass
    curl -X POST localhost:8000/jobs/1/stop                  # ends after the epoch in progress
    curl -X DELETE localhost:8000/jobs/1                     # every rank stops, then it answers

A job trains on two CPU ranks in the service's own event loop. The jobs run in a task
group that the app's lifespan owns, so no job outlives the service. Stopping a job lets it
finish the epoch in progress (validated and checkpointed as usual) and then return, or ends
it at once before its training began; either way it ends ``stopped``. Cancelling a job
cancels its ranks at once. Either way its ranks have closed their clique
before the request answers.

A job with ``"followers": K`` (1 to 8) trains on K + 1 ranks: the root in the service's
event loop, over TCP on 127.0.0.1 with a secret of the job's own, and K follower processes
that the service starts (this file: ``job_service.py follower --rank R ...``, the secret in
their environment) and supervises. A follower process that fails while its job runs is
started again with the same command, and the root takes it back in
(``lampdist.Recovery``): it holds the other ranks, waits for the new process and redoes the
pass in flight, so the job ends with the weights of an uninterrupted run:

    curl -X POST localhost:8000/jobs -d '{"epochs": 1000, "followers": 2}'  # -> {"id": 2, ...}
    curl -N localhost:8000/jobs/2/events &      # its passes, as they end
    curl localhost:8000/jobs/2                  # -> {..., "pids": {"1": 4242, "2": 4243}}
    kill -9 4242                                # a follower is lost, the job goes on:
        {"restarted": {"rank": 1, "returncode": -9, "restarts": 1}}
        {"recovered": {"ranks": [1], "phase": "train", "epoch": 12, "seconds": 1.7, ...}}
        {"epoch": 12, "kind": "train", "loss": 0.0021}      # the pass in flight, redone
        ...
    curl localhost:8000/jobs/2                  # -> {..., "pids": {"1": 4250, ...}, "restarts": 1}

A follower is started again at most ``Recovery.max_recoveries`` (3) times. The root's own
loss is not recovered: if the service's process dies, the job's followers end, naming rank
0. When a job ends (done, stopped, cancelled or failed), its followers get a few seconds to
exit, then SIGTERM, then SIGKILL: none outlives its job or the service. A terminal's Ctrl-C
reaches the service only, which ends its jobs in order. ``JOB_SERVICE_BATCH_SECONDS=0.05``
in the service's environment makes each batch take that long more, to watch a job at
human speed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
import attrs
import torch
from anyio.abc import Process, TaskGroup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import lampdist

Status = Literal["running", "done", "stopped", "cancelled", "failed"]

RECOVERY = lampdist.Recovery(rejoin_timeout=60, max_recoveries=3)
"""A followers job's recovery: a lost follower has 60 s to be back, at most 3 times a run."""
MAX_FOLLOWERS = 8
EXIT_GRACE = 10.0
"""Seconds a follower has to exit on its own once its job's root has ended."""
KILL_GRACE = 5.0
"""Seconds from SIGTERM to SIGKILL for a follower that did not exit."""


@attrs.define(eq=False)
class Job:
    """One training run and what it reported so far."""

    id: int
    epochs: int
    followers: int = 0
    """Follower processes the job starts; 0: both ranks train in the service's process."""
    status: Status = "running"
    error: str | None = None
    events: list[dict[str, Any]] = attrs.Factory(list)
    scope: anyio.CancelScope = attrs.Factory(anyio.CancelScope)
    stop: anyio.Event = attrs.Factory(anyio.Event)
    finished: anyio.Event = attrs.Factory(anyio.Event)
    processes: dict[int, Process] = attrs.Factory(dict)
    """Each follower rank's newest process (its ``pid`` is the one to watch, or to kill)."""
    restarts: int = 0
    """Follower processes started again after they failed, over the job."""
    _changed: anyio.Event = attrs.Factory(anyio.Event)

    def summary(self) -> dict[str, Any]:
        last = self.events[-1] if self.events else None
        return {
            "id": self.id,
            "epochs": self.epochs,
            "followers": self.followers,
            "status": self.status,
            "error": self.error,
            "pids": {rank: process.pid for rank, process in sorted(self.processes.items())},
            "restarts": self.restarts,
            "last": last,
        }

    def report(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = anyio.Event()

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        """Every event so far, then each new one, until the job ends."""
        for index in itertools.count():
            while index >= len(self.events) and self.status == "running":
                await self._changed.wait()
            if index >= len(self.events):
                return
            yield self.events[index]


def make_shard(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(256, 8, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True)
    return [(inputs[i : i + 32], targets[i : i + 32]) for i in range(0, 256, 32)]


def adam(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=0.01)


def batch_seconds() -> float:
    """How long each batch takes at least (``JOB_SERVICE_BATCH_SECONDS``, default 0)."""
    return float(os.environ.get("JOB_SERVICE_BATCH_SECONDS", "0"))


def rank_data(rank: int, pause: float = 0.0) -> lampdist.ModelWithData:
    """Rank ``rank``'s model and data; with ``pause``, each batch takes that many seconds
    more (the sleep runs on lampdist's loading thread, not in the event loop)."""
    model = lampdist.SupervisedModel(torch.nn.Linear(8, 1), torch.nn.functional.mse_loss)
    shard = make_shard(rank)

    def paced(batches: list[Any]) -> Callable[[], Iterable[Any]]:
        if not pause:
            return lambda: batches

        def source() -> Iterator[Any]:
            for batch in batches:
                time.sleep(pause)
                yield batch

        return source

    return lampdist.ModelWithData(
        model=model, train_batches=paced(shard), validation_batches=paced(shard[:2])
    )


async def train(job: Job) -> None:
    """The job's training: two CPU ranks in this process, reporting every finished pass."""

    async def on_event(event: lampdist.PassEvent | lampdist.Recovered) -> None:
        if isinstance(event, lampdist.PassEvent) and event.done:
            job.report({"epoch": event.epoch, "kind": event.kind, "loss": event.loss})

    pause = batch_seconds()
    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[rank_data(rank, pause) for rank in range(2)],
        optimizer_factory=adam,
        loop=lampdist.LoopOptions(max_epochs=job.epochs, on_event=on_event),
        stop=job.stop,  # set by the service: finish the epoch, then return
    )


class FollowerFailed(Exception):
    """A follower process kept failing: it was started again as often as the job allows."""


async def train_with_followers(job: Job) -> None:
    """The job's training: the root in this event loop over TCP, each follower a process of
    its own that the service starts, starts again when it fails while the job runs, and
    ends with the job."""
    nranks = job.followers + 1
    pause = batch_seconds()
    secret = secrets.token_hex(16)  # a job's own: only its followers can join it
    env = {**os.environ, "LAMPDIST_SECRET": secret}  # never on a command line
    root_ended = anyio.Event()  # from then on, a follower's exit is the job's end
    root_scope = anyio.CancelScope()  # cancelled when a follower keeps failing
    gave_up: list[str] = []

    async def on_event(event: lampdist.PassEvent | lampdist.Recovered) -> None:
        if isinstance(event, lampdist.Recovered):  # a lost follower is back; the pass is redone
            job.report({"recovered": attrs.asdict(event)})
        elif event.done:
            job.report({"epoch": event.epoch, "kind": event.kind, "loss": event.loss})

    def give_up(reason: str) -> None:
        gave_up.append(reason)
        root_scope.cancel()

    async def supervise(rank: int, command: list[str]) -> None:
        """Run rank ``rank``'s process; start it again when it fails while the root runs."""
        restarts = 0
        while True:
            try:
                process = await anyio.open_process(
                    command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=None,  # the followers write to the service's own output
                    stderr=None,
                    start_new_session=True,  # a terminal's Ctrl-C reaches the service only
                )
            except OSError as exc:
                give_up(f"follower rank {rank} could not be started: {exc}")
                return
            job.processes[rank] = process
            try:
                code = await process.wait()
            finally:  # the job's end (cancelled, or past its grace) ends the process too
                with anyio.CancelScope(shield=True):
                    await end_process(process)
            if code == 0 or root_ended.is_set():
                return
            if restarts == RECOVERY.max_recoveries:
                # the root fails at once when a loss is one too many; else it would wait
                with anyio.move_on_after(EXIT_GRACE):
                    await root_ended.wait()
                if not root_ended.is_set():
                    give_up(
                        f"follower rank {rank} exited with code {code} after {restarts} "
                        "restarts, as many as Recovery.max_recoveries allows"
                    )
                return
            restarts += 1
            job.restarts += 1
            job.report({"restarted": {"rank": rank, "returncode": code, "restarts": job.restarts}})

    error: Exception | None = None
    async with anyio.create_task_group() as followers:
        try:
            async with lampdist.control.tcp_root(
                "127.0.0.1", 0, nranks=nranks, secret=secret
            ) as root:
                for rank in range(1, nranks):
                    command = follower_command(rank, nranks, root.address[1], pause)
                    followers.start_soon(supervise, rank, command)
                try:
                    with root_scope:
                        await lampdist.drive_distributed_training(
                            nranks=nranks,
                            device="cpu",
                            control=root,
                            data=rank_data(0, pause),
                            optimizer_factory=adam,
                            loop=lampdist.LoopOptions(
                                max_epochs=job.epochs, on_event=on_event, recovery=RECOVERY
                            ),
                            stop=job.stop,  # as in train()
                        )
                finally:
                    root_ended.set()
        except Exception as exc:  # raised below, not wrapped in an exception group
            error = exc
        finally:
            # The followers exit by themselves after the root's STOP (or its channel's
            # end); past the grace their supervisors are cancelled, which ends them.
            followers.cancel_scope.deadline = anyio.current_time() + EXIT_GRACE
    if error is not None:
        raise error
    if gave_up:
        raise FollowerFailed(gave_up[0])


def follower_command(rank: int, nranks: int, port: int, pause: float) -> list[str]:
    """This file as a script, in this Python: a follower of the root at ``port``. The same
    command starts a lost follower again."""
    return [
        sys.executable,
        os.path.abspath(__file__),
        "follower",
        *("--rank", str(rank), "--nranks", str(nranks), "--port", str(port)),
        *("--batch-seconds", str(pause)),
    ]


async def end_process(process: Process) -> None:
    """Wait for ``process`` after SIGTERM, then SIGKILL after :data:`KILL_GRACE` s."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        with anyio.move_on_after(KILL_GRACE):
            await process.wait()
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
    await process.aclose()  # waits for it


async def follow(rank: int, nranks: int, port: int, pause: float) -> None:
    """One follower of a job: what ``job_service.py follower`` runs."""
    secret = os.environ["LAMPDIST_SECRET"]
    async with lampdist.control.tcp_follower("127.0.0.1", port, rank=rank, secret=secret) as root:
        await lampdist.follow_distributed_training(
            rank=rank,
            nranks=nranks,
            device="cpu",
            control=root,
            data=rank_data(rank, pause),
            optimizer_factory=adam,
        )


def ended_by_stop(job: Job, error: Exception) -> bool:
    """Whether ``error`` is the job's stop, not a failure: a stop that came before training
    began (the ranks joining, opening their clique, agreeing: no epoch to finish) abandons
    the run at once, and one whose epoch outlasts ``Timeouts.stop`` (30 s) abandons that
    epoch; either raises :class:`lampdist.LampdistTimeout` with ``phase='stop'``."""
    if not job.stop.is_set():
        return False
    # train()'s in-process ranks may raise it in a group, beside a follower that the stop
    # kept from joining (JoinRejected: "the run has already stopped").
    errors = error.exceptions if isinstance(error, ExceptionGroup) else (error,)
    return any(
        isinstance(each, lampdist.LampdistTimeout) and each.phase == "stop" for each in errors
    )


@attrs.define(eq=False)
class JobRunner:
    """Starts, tracks and cancels jobs; its task group holds every running job."""

    _group: TaskGroup
    jobs: dict[int, Job] = attrs.Factory(dict)

    def start(self, epochs: int, followers: int = 0) -> Job:
        job = Job(id=len(self.jobs) + 1, epochs=epochs, followers=followers)
        self.jobs[job.id] = job
        self._group.start_soon(self._run, job)
        return job

    async def _run(self, job: Job) -> None:
        try:
            with job.scope:
                await (train_with_followers(job) if job.followers else train(job))
                job.status = "stopped" if job.stop.is_set() else "done"
            if job.scope.cancelled_caught:
                job.status = "cancelled"
        except Exception as exc:  # a failed job is reported, the service goes on
            if ended_by_stop(job, exc):
                job.status = "stopped"
            else:
                job.status, job.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            if job.status == "running":  # the service itself is shutting down
                job.status = "cancelled"
            job.report({"status": job.status})
            job.finished.set()

    async def stop(self, job: Job) -> None:
        """Let ``job`` finish its epoch in progress, and wait until its ranks have stopped."""
        job.stop.set()
        with anyio.fail_after(60):
            await job.finished.wait()

    async def cancel(self, job: Job) -> None:
        """Cancel ``job`` and wait until every one of its ranks has stopped."""
        job.scope.cancel()
        with anyio.fail_after(30):
            await job.finished.wait()


@asynccontextmanager
async def open_runner() -> AsyncIterator[JobRunner]:
    """A job runner whose jobs are cancelled when the block ends."""
    async with anyio.create_task_group() as group:
        yield JobRunner(group)
        group.cancel_scope.cancel()


def runner_of(request: Request) -> JobRunner:
    runner: JobRunner = request.app.state.runner
    return runner


def job_of(request: Request) -> Job | None:
    return runner_of(request).jobs.get(int(request.path_params["id"]))


async def start_job(request: Request) -> Response:
    body = json.loads(await request.body() or b"{}")
    epochs = body.get("epochs", 10)
    if not isinstance(epochs, int) or epochs < 1:
        return JSONResponse({"error": "epochs must be an integer >= 1"}, status_code=422)
    followers = body.get("followers", 0)  # 0: the job's ranks train in this process
    if "followers" in body and (
        not isinstance(followers, int)
        or isinstance(followers, bool)
        or not 1 <= followers <= MAX_FOLLOWERS
    ):
        return JSONResponse(
            {"error": f"followers must be an integer from 1 to {MAX_FOLLOWERS}"}, status_code=422
        )
    job = runner_of(request).start(epochs, followers)
    return JSONResponse(job.summary(), status_code=201)


async def show_job(request: Request) -> Response:
    job = job_of(request)
    if job is None:
        return JSONResponse({"error": "no such job"}, status_code=404)
    return JSONResponse(job.summary())


async def stream_events(request: Request) -> Response:
    job = job_of(request)
    if job is None:
        return JSONResponse({"error": "no such job"}, status_code=404)

    async def lines() -> AsyncIterator[str]:
        async for event in job.stream():
            yield json.dumps(event) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def stop_job(request: Request) -> Response:
    job = job_of(request)
    if job is None:
        return JSONResponse({"error": "no such job"}, status_code=404)
    await runner_of(request).stop(job)
    return JSONResponse(job.summary())


async def cancel_job(request: Request) -> Response:
    job = job_of(request)
    if job is None:
        return JSONResponse({"error": "no such job"}, status_code=404)
    await runner_of(request).cancel(job)
    return JSONResponse(job.summary())


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with open_runner() as runner:
        app.state.runner = runner
        yield


app = Starlette(
    routes=[
        Route("/jobs", start_job, methods=["POST"]),
        Route("/jobs/{id:int}", show_job, methods=["GET"]),
        Route("/jobs/{id:int}", cancel_job, methods=["DELETE"]),
        Route("/jobs/{id:int}/stop", stop_job, methods=["POST"]),
        Route("/jobs/{id:int}/events", stream_events, methods=["GET"]),
    ],
    lifespan=lifespan,
)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="The example job service, or one follower.")
    commands = parser.add_subparsers(dest="command")
    follower = commands.add_parser("follower", help="a job's follower (the service starts it)")
    follower.add_argument("--rank", type=int, required=True)
    follower.add_argument("--nranks", type=int, required=True)
    follower.add_argument("--port", type=int, required=True, help="the job's root's port")
    follower.add_argument("--batch-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.command != "follower":
        import uvicorn

        uvicorn.run(app)
        return
    logging.basicConfig(level=logging.WARNING)
    try:
        anyio.run(follow, args.rank, args.nranks, args.port, args.batch_seconds)
    except lampdist.LampdistError as exc:  # its job's root ended the run, or was lost
        sys.exit(f"follower rank {args.rank}: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1:])
