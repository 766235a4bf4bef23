"""Each rank's compute runs on one thread of its own, stopped when the run ends on any path."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import anyio
import pytest
import torch

import lampdist
from lampdist.epoch._compute import ComputeThread

from ..roles.reference import make_shards, mse

CPU = torch.device("cpu")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def compute_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lampdist-compute")]


class Recorder(torch.nn.Module):
    """Records the thread of every forward pass; raises in forward once ``fail_after`` ran."""

    def __init__(self, seen: set[int], fail_after: int | None = None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1).double()
        self.seen = seen
        self.fail_after = fail_after
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add(threading.get_ident())
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("model broke")
        return self.linear(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("step_on", ["root", "every_rank"])
async def test_forward_backward_and_step_of_a_rank_share_one_thread(
    step_on: lampdist.epoch.StepOn,
) -> None:
    shards = make_shards([[4, 4, 4], [4, 4, 4]], seed=3)
    forwards: list[set[int]] = [set(), set()]
    steps: list[set[int]] = []  # per optimizer, in the order they were built

    def optimizer_factory(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.1)
        mine: set[int] = set()
        steps.append(mine)
        optimizer.register_step_pre_hook(lambda *_: mine.add(threading.get_ident()))
        return optimizer

    modules = [Recorder(seen) for seen in forwards]
    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                (lampdist.SupervisedModel(m, mse), lambda s=s: list(s), lambda s=s: list(s))
                for m, s in zip(modules, shards, strict=True)
            ],
            optimizer_factory=optimizer_factory,
            max_epochs=2,
            step_on=step_on,
        )
    assert all(len(seen) == 1 for seen in forwards)  # training and validation, both epochs
    assert forwards[0] != forwards[1]  # a thread per rank
    stepped = [threads for threads in steps if threads]
    assert len(stepped) == (2 if step_on == "every_rank" else 1)
    assert all(threads in forwards for threads in stepped)  # each on its own rank's thread
    if step_on == "root":
        assert stepped == [forwards[0]]
    assert threading.get_ident() not in forwards[0] | forwards[1]  # never the event loop
    assert compute_threads() == []


async def test_the_compute_threads_stop_when_a_rank_fails() -> None:
    shards = make_shards([[4, 4, 4], [4, 4, 4]], seed=3)
    modules = [Recorder(set()), Recorder(set(), fail_after=2)]
    with anyio.fail_after(60), pytest.raises(lampdist.TrainingError, match="model broke"):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                (lampdist.SupervisedModel(m, mse), lambda s=s: list(s), None)
                for m, s in zip(modules, shards, strict=True)
            ],
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            max_epochs=2,
        )
    assert compute_threads() == []


async def test_a_started_call_runs_to_its_end_when_its_caller_is_cancelled() -> None:
    compute = ComputeThread("lampdist-compute-test", CPU)
    started = threading.Event()
    returned: list[str] = []

    def slow() -> str:
        started.set()
        time.sleep(0.3)
        return "done"

    try:
        with anyio.fail_after(10), anyio.CancelScope() as scope:

            async def cancel_once_started() -> None:
                await anyio.to_thread.run_sync(started.wait, 5)
                scope.cancel()

            async with anyio.create_task_group() as group:
                group.start_soon(cancel_once_started)
                returned.append(await compute.run(slow))
                await anyio.sleep(5)  # the cancellation lands here
        assert scope.cancelled_caught
        assert returned == ["done"]
        with pytest.raises(ValueError, match="boom"):
            await compute.run(int, "boom")
        assert await compute.run(sum, [1, 2, 3]) == 6
    finally:
        compute.close()
    assert compute_threads() == []
