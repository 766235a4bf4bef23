"""The graceful stop's rules, without a run: what a stop before training takes as its own."""

from __future__ import annotations

import anyio
import pytest

import lampdist
from lampdist._roles._failures import PhaseTracker
from lampdist._roles._stopping import Stopping

pytestmark = pytest.mark.anyio


async def _abandoned_at_once(*, failure_first: bool) -> Stopping:
    stop = anyio.Event()
    stop.set()
    tracker = PhaseTracker("clique setup")
    if failure_first:
        tracker.cause = lampdist.RankFailed("the model raised", rank=1, phase="train")
    stopping = Stopping(stop, 600.0, rank=0)
    with anyio.fail_after(5):
        await stopping.enforce(tracker)  # before training: returns at once
    assert stopping.scope.cancel_called
    return stopping


async def test_a_stop_before_training_takes_what_its_peers_did_meanwhile_as_its_own() -> None:
    """Under torchrun every rank is signalled: a follower's report of its own abandoned stop,
    or the clique it broke, is the stop, not a failure of the run."""
    stopping = await _abandoned_at_once(failure_first=False)
    peer = lampdist.RankFailed("LampdistTimeout: stop ...", rank=1, phase="stop")
    assert stopping.ended_it(peer)
    assert stopping.ended_it(lampdist.CollectiveFailed("peer gone", rank=0, phase="reduce"))
    own = stopping.timeout_error()
    assert not stopping.ended_it(own)  # it is already the stop's error
    assert "before training began" in own.message


async def test_a_failure_known_before_the_stop_stays_the_news() -> None:
    stopping = await _abandoned_at_once(failure_first=True)
    assert not stopping.ended_it(lampdist.RankFailed("the model raised", rank=1, phase="train"))


async def test_a_stop_during_training_takes_nothing_as_its_own() -> None:
    stop = anyio.Event()
    stop.set()
    stopping = Stopping(stop, 0.01, rank=0)
    await stopping.enforce(PhaseTracker("train"))  # waits its timeout, then abandons
    assert stopping.abandoned is not None and not stopping.at_once
    assert not stopping.ended_it(lampdist.RankFailed("x", rank=1, phase="train"))
