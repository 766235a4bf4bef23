"""The clique's last step of teardown: dropping the process group within a deadline.

On 2 H200 an NCCL process group whose collective had timed out never finished its destructor
(CUDA_MODULE_LOADING=EAGER: its watchdog thread never joined), which held the clique's exit,
and the error it carried, forever. That destructor cannot run here, so an object whose
destructor blocks until released stands in for it; the ordinary path runs in every clique
test (Gloo), including the one that counts leaked threads.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable

import pytest

from lampdist.clique._group_teardown import drop_within


class _Stuck:
    """An object whose destructor waits until ``release`` is set (at most 30 s)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def __del__(self) -> None:
        self.release.wait(30)


class _Plain:
    pass


def _drop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lampdist-clique-drop-")]


def _wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_a_group_that_goes_at_once_is_dropped_and_its_thread_ends() -> None:
    group = _Plain()
    gone = weakref.ref(group)
    last: list[object] = [group, [_Plain()]]
    del group
    assert drop_within(last, 10.0, lock=None, rank=0)
    assert gone() is None
    assert last == []
    assert _drop_threads() == []


def test_a_destructor_that_never_returns_is_left_behind_with_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()
    last: list[object] = [_Stuck(release)]
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="lampdist.clique._group_teardown"):
        assert not drop_within(last, 0.2, lock=None, rank=3)
    assert time.monotonic() - started < 5.0
    assert "rank 3: clique teardown: the process group was not destroyed" in caplog.text
    assert len(_drop_threads()) == 1
    release.set()
    assert _wait_until(lambda: not _drop_threads())
    gc.collect()


def test_the_teardown_lock_is_waited_for_within_the_same_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lock = threading.Lock()
    group = _Plain()
    gone = weakref.ref(group)
    last: list[object] = [group]
    del group
    with lock:  # another rank's teardown holds it
        with caplog.at_level(logging.ERROR, logger="lampdist.clique._group_teardown"):
            assert not drop_within(last, 0.2, lock=lock, rank=1)
        assert gone() is not None
    assert "rank 1: clique teardown" in caplog.text
    assert _wait_until(lambda: gone() is None and not _drop_threads())
