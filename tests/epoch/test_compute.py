"""A rank's compute thread: results, errors, one thread for every job, the event loop reached
with a token, cancellation with and without on_cancel, and the end of the thread."""

from __future__ import annotations

import threading
from functools import partial

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import torch

from lampdist import StepOptions, SupervisedModel
from lampdist._epoch import StepKernel, create_design, open_compute_thread
from lampdist.clique import in_process


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def compute_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lampdist-compute-")]


async def test_a_job_returns_its_value_or_raises_its_error() -> None:
    async with open_compute_thread(0) as compute:
        assert await compute.run(sum, [1, 2, 3]) == 6
        assert await compute.run(sum, [1, 2], on_cancel=lambda: None) == 3
        with pytest.raises(ValueError, match="boom"):
            await compute.run(int, "boom")
        assert await compute.run(sum, [4]) == 4  # an error does not end the thread


async def test_every_job_runs_on_one_named_thread_that_ends_with_the_block() -> None:
    async with open_compute_thread(7) as compute:
        threads = {await compute.run(threading.current_thread) for _ in range(20)}
        (thread,) = threads
        assert thread is not threading.current_thread()
        assert thread.name == "lampdist-compute-7"
    assert not thread.is_alive()
    assert compute_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        await compute.run(sum, [1])


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_model_code_reaches_the_event_loop_with_a_token() -> None:
    event = anyio.Event()
    token = anyio.lowlevel.current_token()

    def forward() -> int:
        anyio.from_thread.run_sync(event.set, token=token)
        return 1

    async with open_compute_thread(0) as compute:
        assert await compute.run(forward) == 1
    assert event.is_set()


async def test_the_compute_thread_has_the_openers_intra_op_threads() -> None:
    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        async with open_compute_thread(0) as compute:
            assert compute.intra_op_threads == 2
            assert await compute.run(torch.get_num_threads) == 2
    finally:
        torch.set_num_threads(original)


async def test_cancelling_a_waiting_job_runs_on_cancel_and_waits_for_the_job() -> None:
    release = threading.Event()
    steps: list[str] = []

    def wait_for_peers() -> None:
        assert release.wait(10), "on_cancel did not run"
        steps.append("job ended")

    def on_cancel() -> None:
        steps.append("on_cancel")
        release.set()

    async with open_compute_thread(0) as compute:
        with anyio.fail_after(5), anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(partial(compute.run, wait_for_peers, on_cancel=on_cancel))
                await anyio.sleep(0.1)
                scope.cancel()
        assert scope.cancelled_caught
        assert steps == ["on_cancel", "job ended"]
        assert await compute.run(sum, [1]) == 1  # the thread serves the next job


async def test_cancelling_without_on_cancel_lets_the_job_finish_first() -> None:
    steps: list[str] = []

    def slow() -> None:
        threading.Event().wait(0.3)
        steps.append("job ended")

    async with open_compute_thread(0) as compute:
        with anyio.fail_after(5), anyio.move_on_after(0.05) as scope:
            await compute.run(slow)
            steps.append("not reached")
    assert scope.cancelled_caught
    assert steps == ["job ended"]


async def test_an_already_cancelled_caller_does_not_start_the_job() -> None:
    ran: list[int] = []
    async with open_compute_thread(0) as compute:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await compute.run(ran.append, 1)
        assert scope.cancelled_caught
        assert await compute.run(len, ran) == 0


async def test_a_device_the_thread_cannot_use_fails_every_job_with_its_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    errors: list[Exception] = []
    async with open_compute_thread(0, torch.device("cuda", 0)) as compute:
        for values in ([1], [2]):
            try:
                await compute.run(sum, values)
            except Exception as exc:  # torch's own error for CUDA on a build without it
                errors.append(exc)
    assert len(errors) == 2
    assert errors[0] is errors[1]  # the thread's setup error, for every job


async def test_the_step_kernel_refuses_to_run_on_the_event_loop() -> None:
    module = torch.nn.Linear(2, 1)
    model = SupervisedModel(module, torch.nn.functional.mse_loss)
    async with in_process(["cpu"]).hub.open(0) as clique:
        kernel = StepKernel(
            rank=0,
            clique=clique,
            model=model,
            design=create_design(
                rank=0,
                nranks=1,
                module=module,
                device=torch.device("cpu"),
                options=StepOptions(),
                optimizer_factory=lambda parameters: torch.optim.SGD(parameters, lr=0.1),
            ),
        )
        with pytest.raises(RuntimeError, match="compute thread, not on an event loop"):
            kernel.sync_parameters()
        async with open_compute_thread(0) as compute:
            await compute.run(kernel.sync_parameters)  # where it belongs
