"""A collective that times out names where every rank is: its step, its last collectives."""

from __future__ import annotations

import re
import signal
import threading

import anyio
import anyio.to_thread
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lampdist
from lampdist.clique import Clique, serve_rendezvous
from lampdist.clique._trail import ANSWER_WAIT, account, size

from ._helpers import open_rank, run_ranks, spawn_worker


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _steps(clique: Clique, count: int) -> None:
    """``count`` steps of epoch 1, each noted, then a broadcast and an all_reduce."""
    for step in range(count):
        clique.at_step(1, "train", step)
        await clique.broadcast([torch.zeros(1000)])  # 3.9 KiB
        await clique.all_reduce([torch.ones(4)])  # 16 B


async def _all_reduce(clique: Clique, *, from_thread: bool) -> None:
    """An all_reduce waited for on the event loop, or from a thread (a rank's compute thread)."""
    if from_thread:
        pending = clique.start_all_reduce([torch.ones(4)])
        await anyio.to_thread.run_sync(pending.wait_blocking, None)
    else:
        await clique.all_reduce([torch.ones(4)])


async def test_a_timeout_names_the_stalled_rank_its_step_and_its_last_collective() -> None:
    # Three ranks take three steps (0..2, collectives #1..#6). Ranks 0 and 2 note step 3 and
    # enter all_reduce #7 (rank 0 from a compute thread, rank 2 on the event loop); rank 1
    # stalls in step 2 outside any collective, in a blocking call of its own. Both waiting
    # ranks must name rank 1's step and its last collective, #6, and their own #7.
    both_raised = anyio.Event()
    raised: list[int] = []
    stall = threading.Event()

    async def body(clique: Clique) -> str:
        await _steps(clique, 3)
        if clique.rank == 1:  # still at step 2, say in its optimizer's step
            await anyio.to_thread.run_sync(stall.wait)  # stuck in Python, not in the clique
            with pytest.raises(lampdist.CollectiveFailed):
                await clique.all_reduce([torch.ones(4)])  # the others have left
            return ""
        clique.at_step(1, "train", 3)
        with pytest.raises(lampdist.CliqueTimeout) as caught:
            await _all_reduce(clique, from_thread=clique.rank == 0)
        raised.append(clique.rank)
        if len(raised) == 2:
            both_raised.set()
            stall.set()
        await both_raised.wait()  # neither leaves (and aborts the clique) before both raised
        assert (caught.value.rank, caught.value.phase) == (clique.rank, "all_reduce")
        return str(caught.value)

    with anyio.fail_after(60):
        messages = await run_ranks(3, body, collective_timeout=2.0)
    for rank in (0, 2):
        message = messages[rank]
        prefix = f"rank {rank}, phase 'all_reduce': all_reduce #7 (16 B) did not complete "
        assert message.startswith(prefix + "within collective_timeout=2.0 s"), message
        assert re.search(
            r"rank 1 at epoch 1 train step 2 \(for [\d.]+ s\): not in a collective for "
            r"[\d.]+ s, since all_reduce #6 \(16 B\) ended \(before: broadcast #5 \(3\.9 KiB\), "
            r"all_reduce #4 \(16 B\), broadcast #3 \(3\.9 KiB\)\)",
            message,
        ), message
        # Each waiting rank in all_reduce #7, or past it when its own deadline came first
        assert re.search(
            rf"rank {rank} at epoch 1 train step 3 \(for [\d.]+ s\): waiting [\d.]+ s in "
            r"all_reduce #7 \(16 B\) \(before: all_reduce #6 \(16 B\), broadcast #5",
            message,
        ), message
        other = 2 - rank
        assert re.search(
            rf"rank {other} at epoch 1 train step 3 \(for [\d.]+ s\): (waiting [\d.]+ s in "
            r"all_reduce #7 \(16 B\)|all_reduce #7 \(16 B\) failed [\d.]+ s ago, after "
            r"[\d.]+ s) \(before: all_reduce #6 \(16 B\), broadcast #5",
            message,
        ), message
        assert message.endswith("Rank 1 has not started all_reduce #7 (16 B): look there first.")
        assert "did not answer" not in message


async def test_a_rank_that_cannot_answer_is_named_so() -> None:
    # Rank 1, in a process of its own, is stopped (SIGSTOP): alive to its peers' liveness
    # sockets, so only the collective's deadline ends rank 0's all_reduce, and deaf to the
    # request for its trail. Rank 0 must say so after its bounded wait for the answer.
    with anyio.fail_after(60):
        async with (
            serve_rendezvous(nranks=2) as clique_id,
            spawn_worker(clique_id, 1, "idle", collective_timeout=2.0) as stopped,
        ):
            async with open_rank(clique_id, 0, "cpu", collective_timeout=2.0) as clique:
                assert await stopped.line() == "ready"
                stopped.process.send_signal(signal.SIGSTOP)
                try:
                    clique.at_step(0, "valid", 5)
                    # the limit: the collective's, the wait for answers, and slack for the store
                    limit = 2.0 + ANSWER_WAIT + 10.0
                    with (
                        anyio.fail_after(limit),
                        pytest.raises(lampdist.CliqueTimeout) as caught,
                    ):
                        await clique.all_reduce([torch.ones(4)])
                finally:
                    stopped.process.send_signal(signal.SIGKILL)
            assert await stopped.process.wait() == -signal.SIGKILL
    message = str(caught.value)
    assert message.startswith("rank 0, phase 'all_reduce': all_reduce #1 (16 B) did not"), message
    assert re.search(
        # its own collective: still waiting, or already failed when its record was taken
        r"rank 0 at epoch 0 valid step 5 \(for [\d.]+ s\): (waiting [\d.]+ s in all_reduce #1 "
        r"\(16 B\)|all_reduce #1 \(16 B\) failed [\d.]+ s ago, after [\d.]+ s); "
        rf"rank 1 did not answer within {ANSWER_WAIT:g} s\.",
        message,
    ), message


_TRAILS = st.dictionaries(
    st.integers(0, 7),
    st.fixed_dictionaries(
        {
            "step": st.none()
            | st.tuples(
                st.integers(0, 9), st.just("train"), st.integers(0, 99), st.floats(0, 9)
            ).map(list),
            "collectives": st.lists(
                st.tuples(
                    st.integers(1, 99),
                    st.sampled_from(["all_reduce", "broadcast"]),
                    st.integers(0, 1 << 40),
                    st.floats(0, 9),
                    st.none() | st.floats(0, 9),
                    st.booleans(),
                ).map(list),
                max_size=4,
            ),
        }
    ),
)


@given(_TRAILS, st.integers(0, 7))
def test_the_account_names_every_rank_once(trails: dict[int, dict[str, object]], rank: int) -> None:
    text = account(trails, rank, 8, ANSWER_WAIT)
    for peer in range(8):
        assert len(re.findall(rf"(?:^|; |: )rank {peer}\b", text)) == 1, text
        assert (f"rank {peer} did not answer" in text) == (peer not in trails), text


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (4 << 20, "4.0 MiB"),
        (3 << 40, "3072.0 GiB"),
    ],
)
def test_sizes_read_in_binary_units(nbytes: int, text: str) -> None:
    assert size(nbytes) == text
