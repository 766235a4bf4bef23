"""Progress from the compute thread to on_event: the first and last events always arrive,
the rest are coalesced, and the publisher never waits for the event loop."""

from __future__ import annotations

import threading

import anyio
import pytest

from lampdist import PassEvent
from lampdist._epoch import Progress
from lampdist._epoch._progress import ProgressFields


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def event(step: int, *, done: bool = False) -> PassEvent:
    return PassEvent(
        epoch=0,
        kind="train",
        pass_index=0,
        step=step,
        batches=step,
        total_batches=None,
        examples=4 * step,
        loss=1.0,
        seconds=0.0,
        done=done,
    )


async def test_the_first_and_last_events_arrive_and_the_rest_coalesce() -> None:
    progress = Progress()
    seen: list[PassEvent] = []

    async def on_event(e: PassEvent) -> None:
        seen.append(e)

    def publish() -> None:
        for step in range(1, 1001):
            progress.publish(event(step, done=step == 1000))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(progress.deliver, on_event)
            await anyio.to_thread.run_sync(publish)
    assert seen[0].step == 1
    assert seen[-1].step == 1000 and seen[-1].done
    assert [e.step for e in seen] == sorted({e.step for e in seen})
    assert len(seen) < 100  # 1000 events in well under the 50 ms interval each
    assert progress.delivered == len(seen)


async def test_a_blocking_on_event_does_not_hold_up_the_publisher() -> None:
    """While on_event blocks the event loop's thread, the compute thread publishes on."""
    progress = Progress()
    blocked, published = threading.Event(), threading.Event()
    seen: list[int] = []

    async def on_event(e: PassEvent) -> None:
        seen.append(e.step)
        if e.step == 1:
            blocked.set()
            # Blocks the loop on purpose until every later event has been published.
            assert published.wait(10), "publish() waited for the event loop"

    waited: list[bool] = []  # what the thread saw, asserted by the test (not in the thread)
    failures: list[BaseException] = []

    def publish() -> None:
        try:
            progress.publish(event(1))
            waited.append(blocked.wait(10))
            for step in range(2, 501):
                progress.publish(event(step, done=step == 500))
        except BaseException as exc:
            failures.append(exc)
            progress.publish(event(500, done=True))  # let the loop end
        finally:
            published.set()

    thread = threading.Thread(target=publish)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(progress.deliver, on_event)
            thread.start()
    thread.join()
    assert failures == [] and waited == [True], "on_event never received the first event"
    assert seen == [1, 500]  # the first, then the newest once the loop was free again


async def test_a_step_published_as_numbers_arrives_as_its_event() -> None:
    """``publish_step`` keeps a step's numbers; the loop builds the event it delivers, each
    number in its own field, the pass's shared fields from ``ProgressFields``."""
    progress = Progress()
    seen: list[PassEvent] = []

    async def on_event(e: PassEvent) -> None:
        seen.append(e)

    fields = ProgressFields(epoch=3, kind="train", pass_index=7, total_batches=40)

    def publish() -> None:
        progress.publish_step(fields, 2, 5, 64, 0.25, 1.5)
        progress.publish(fields.event(9, 40, 512, 0.125, 4.0, done=True))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(progress.deliver, on_event)
            await anyio.to_thread.run_sync(publish)
    assert seen[0] == PassEvent(
        epoch=3,
        kind="train",
        pass_index=7,
        step=2,
        batches=5,
        total_batches=40,
        examples=64,
        loss=0.25,
        seconds=1.5,
        done=False,
    )
    assert seen[-1].step == 9 and seen[-1].done
