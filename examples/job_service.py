"""Training as a job of an async web service: start a job, stream its progress, cancel it.

    pip install -e ".[examples]"
    uvicorn --app-dir examples job_service:app     # or: python examples/job_service.py

    curl -X POST localhost:8000/jobs -d '{"epochs": 50}'     # -> {"id": 1, ...}
    curl -N localhost:8000/jobs/1/events                     # one JSON line per pass
    curl -X POST localhost:8000/jobs/1/stop                  # ends after the epoch in progress
    curl -X DELETE localhost:8000/jobs/1                     # every rank stops, then it answers

Each job trains on two CPU ranks in the service's own event loop. The jobs run in a task
group that the app's lifespan owns, so no job outlives the service. Stopping a job lets it
finish the epoch in progress (validated and checkpointed as usual) and then return;
cancelling a job cancels its ranks at once. Either way its ranks have closed their clique
before the request answers.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
import attrs
import torch
from anyio.abc import TaskGroup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import lampdist

Status = Literal["running", "done", "stopped", "cancelled", "failed"]


@attrs.define(eq=False)
class Job:
    """One training run and what it reported so far."""

    id: int
    epochs: int
    status: Status = "running"
    error: str | None = None
    events: list[dict[str, Any]] = attrs.Factory(list)
    scope: anyio.CancelScope = attrs.Factory(anyio.CancelScope)
    stop: anyio.Event = attrs.Factory(anyio.Event)
    finished: anyio.Event = attrs.Factory(anyio.Event)
    _changed: anyio.Event = attrs.Factory(anyio.Event)

    def summary(self) -> dict[str, Any]:
        last = self.events[-1] if self.events else None
        return {
            "id": self.id,
            "epochs": self.epochs,
            "status": self.status,
            "error": self.error,
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


async def train(job: Job) -> None:
    """The job's training: two CPU ranks in this process, reporting every finished pass."""

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.done:
            job.report({"epoch": event.epoch, "kind": event.kind, "loss": event.loss})

    ranks = []
    for rank in range(2):
        model = lampdist.SupervisedModel(torch.nn.Linear(8, 1), torch.nn.functional.mse_loss)
        shard = make_shard(rank)
        ranks.append(
            lampdist.ModelWithData(
                model=model,
                train_batches=lambda shard=shard: shard,
                validation_batches=lambda shard=shard: shard[:2],
            )
        )
    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=ranks,
        optimizer_factory=adam,
        loop=lampdist.LoopOptions(max_epochs=job.epochs, on_event=on_event),
        stop=job.stop,  # set by the service: finish the epoch, then return
    )


@attrs.define(eq=False)
class JobRunner:
    """Starts, tracks and cancels jobs; its task group holds every running job."""

    _group: TaskGroup
    jobs: dict[int, Job] = attrs.Factory(dict)

    def start(self, epochs: int) -> Job:
        job = Job(id=len(self.jobs) + 1, epochs=epochs)
        self.jobs[job.id] = job
        self._group.start_soon(self._run, job)
        return job

    async def _run(self, job: Job) -> None:
        try:
            with job.scope:
                await train(job)
                job.status = "stopped" if job.stop.is_set() else "done"
            if job.scope.cancelled_caught:
                job.status = "cancelled"
        except Exception as exc:  # a failed job is reported, the service goes on
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
    job = runner_of(request).start(epochs)
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

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app)
