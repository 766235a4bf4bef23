"""A rank's compute calls: results, errors, anyio.from_thread, and cancellation with on_cancel."""

from __future__ import annotations

import threading

import anyio
import anyio.from_thread
import pytest

from lampdist.epoch._compute import Compute


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_call_returns_its_value_or_raises_its_error() -> None:
    compute = Compute()
    assert await compute.run(sum, [1, 2, 3]) == 6
    assert await compute.run(sum, [1, 2], on_cancel=lambda: None) == 3
    with pytest.raises(ValueError, match="boom"):
        await compute.run(int, "boom")
    with pytest.raises(ValueError, match="bang"):
        await compute.run(int, "bang", on_cancel=lambda: None)


async def test_model_code_may_reach_the_event_loop() -> None:
    event = anyio.Event()

    def forward() -> int:
        anyio.from_thread.run_sync(event.set)
        return 1

    assert await Compute().run(forward, on_cancel=lambda: None) == 1
    assert event.is_set()


async def test_cancelling_a_waiting_call_runs_on_cancel_and_waits_for_the_call() -> None:
    release = threading.Event()
    steps: list[str] = []

    def wait_for_peers() -> None:
        assert release.wait(10), "on_cancel did not run"
        steps.append("call ended")

    def on_cancel() -> None:
        steps.append("on_cancel")
        release.set()

    async def step() -> None:
        await Compute().run(wait_for_peers, on_cancel=on_cancel)

    with anyio.fail_after(5), anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(step)
            await anyio.sleep(0.1)
            scope.cancel()
    assert scope.cancelled_caught
    assert steps == ["on_cancel", "call ended"]
