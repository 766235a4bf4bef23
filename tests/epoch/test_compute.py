"""A rank's compute calls: results, errors, one thread per session, anyio.from_thread, and
cancellation with and without on_cancel."""

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
    async with compute.session():
        assert await compute.run(sum, [1, 2, 3]) == 6
        assert await compute.run(sum, [1, 2], on_cancel=lambda: None) == 3
        with pytest.raises(ValueError, match="boom"):
            await compute.run(int, "boom")
        with pytest.raises(ValueError, match="bang"):
            await compute.run(int, "bang", on_cancel=lambda: None)
        assert await compute.run(sum, [4]) == 4  # an error does not end the session


async def test_a_session_runs_every_call_on_one_thread_off_the_loop() -> None:
    compute = Compute()
    async with compute.session():
        idents = {await compute.run(threading.get_ident) for _ in range(20)}
    assert len(idents) == 1
    assert threading.get_ident() not in idents
    with pytest.raises(RuntimeError, match="session"):  # closed with its block
        await compute.run(sum, [1])
    async with compute.session():  # a new session after the last one closed
        assert await compute.run(sum, [1]) == 1


async def test_run_needs_a_session_and_sessions_do_not_nest() -> None:
    compute = Compute()
    with pytest.raises(RuntimeError, match="session"):
        await compute.run(sum, [1])
    async with compute.session():
        with pytest.raises(RuntimeError, match="already open"):
            async with compute.session():
                pass
        assert await compute.run(sum, [2]) == 2


async def test_model_code_may_reach_the_event_loop() -> None:
    event = anyio.Event()

    def forward() -> int:
        anyio.from_thread.run_sync(event.set)
        return 1

    compute = Compute()
    async with compute.session():
        assert await compute.run(forward, on_cancel=lambda: None) == 1
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

    compute = Compute()

    async def step() -> None:
        async with compute.session():
            await compute.run(wait_for_peers, on_cancel=on_cancel)

    with anyio.fail_after(5), anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(step)
            await anyio.sleep(0.1)
            scope.cancel()
    assert scope.cancelled_caught
    assert steps == ["on_cancel", "call ended"]


async def test_cancelling_without_on_cancel_lets_the_call_finish_first() -> None:
    steps: list[str] = []

    def slow() -> None:
        threading.Event().wait(0.3)
        steps.append("call ended")

    compute = Compute()
    with anyio.fail_after(5), anyio.move_on_after(0.05) as scope:
        async with compute.session():
            await compute.run(slow)
            steps.append("not reached")
    assert scope.cancelled_caught
    assert steps == ["call ended"]


async def test_an_already_cancelled_caller_does_not_start_the_call() -> None:
    ran: list[int] = []
    compute = Compute()
    async with compute.session():
        with anyio.CancelScope() as scope:
            scope.cancel()
            await compute.run(ran.append, 1)
    assert scope.cancelled_caught
    assert ran == []
