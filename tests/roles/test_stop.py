"""``stop`` from every entry point: the local loop's, a follower's own, and ``lampdist.train``'s
(in tests/test_launch.py and tests/cli/test_demo.py)."""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch

import lampdist
from lampdist import checkpoint, control
from lampdist._roles._failures import most_telling
from lampdist.clique import in_process

from .test_local_failures import entries, sgd


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_the_local_loop_finishes_the_epoch_checkpoints_and_stops(
    tmp_path: Path, asynchronous: bool
) -> None:
    """An asynchronous checkpoint's write is waited for: the stopped run returns with it
    committed."""
    stop = anyio.Event()

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.epoch == 1:
            stop.set()

    streams = entries(3)
    with anyio.fail_after(30):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=streams,
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(
                max_epochs=50,
                on_event=on_event,
                checkpoint_state=checkpoint.to_directory(tmp_path, asynchronous=asynchronous),
            ),
            stop=stop,
        )
    assert state.epoch == 2  # epoch 1 ran whole, and no other started
    assert [point.epoch for point in state.learning_curve] == [0, 1]
    resumed = checkpoint.load_latest(tmp_path)
    assert resumed is not None and resumed.epoch == 2
    weights = [dict(entry.model.module.state_dict()) for entry in streams]
    for other in weights[1:]:
        assert all(torch.equal(other[k], v) for k, v in weights[0].items())


async def _root_and_follower(
    *,
    follower_stop: anyio.Event,
    root_stop: anyio.Event | None = None,
    max_epochs: int,
    timeouts: lampdist.Timeouts,
    slow_root: bool = False,
    stop_follower_in_training: bool = False,
) -> dict[int, Any]:
    """A root and one follower in this process; what each returned or raised.
    ``stop_follower_in_training`` sets ``follower_stop`` once the follower's first pass has
    begun (as Ctrl-C reaching every process of a job that trains)."""
    streams = entries(2)
    if stop_follower_in_training:
        batches = streams[1].train_batches

        def stop_then_batches() -> Any:
            follower_stop.set()
            return batches()  # type: ignore[call-arg]  # the fixture's source takes no context

        streams[1] = attrs.evolve(streams[1], train_batches=stop_then_batches)
    if slow_root:

        def slow(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)
            return torch.nn.functional.mse_loss(output, target)

        streams[0] = lampdist.ModelWithData(
            model=lampdist.SupervisedModel(streams[0].model.module, slow),
            train_batches=streams[0].train_batches,
        )
        streams[1] = lampdist.ModelWithData(
            model=streams[1].model, train_batches=streams[1].train_batches
        )
    cliques = in_process(["cpu", "cpu"])
    root, (follower,) = control.local_channels(2)
    outcome: dict[int, Any] = {}

    async def run_root() -> None:
        try:
            async with root:
                outcome[0] = await lampdist.drive_distributed_training(
                    nranks=2,
                    device="cpu",
                    control=root,
                    data=streams[0],
                    optimizer_factory=sgd,
                    loop=lampdist.LoopOptions(max_epochs=max_epochs),
                    timeouts=timeouts,
                    stop=root_stop,
                    cliques=cliques,
                )
        except Exception as exc:
            outcome[0] = exc

    async def run_follower() -> None:
        try:
            async with follower:
                await lampdist.follow_distributed_training(
                    rank=1,
                    nranks=2,
                    device="cpu",
                    control=follower,
                    data=streams[1],
                    timeouts=timeouts,
                    stop=follower_stop,
                    cliques=cliques,
                )
                outcome[1] = "returned"
        except Exception as exc:
            outcome[1] = exc

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(run_root)
            group.start_soon(run_follower)
    return outcome


async def test_the_local_loop_stopped_while_its_ranks_join_raises_the_roots_stop_alone() -> None:
    """Followers that tried to join after the root stopped were refused ("the run has already
    stopped"): a consequence of the stop, never raised beside it. Which ranks got to join
    first is a scheduling race (about one run in four had a follower refused), so the stop
    comes after 0 to 9 of the loop's steps through the event loop, ten times each."""

    async def stopped_after(steps: int) -> None:
        stop = anyio.Event()

        async def set_stop() -> None:
            for _ in range(steps):
                await anyio.lowlevel.checkpoint()
            stop.set()

        async with anyio.create_task_group() as group:
            group.start_soon(set_stop)
            await lampdist.local_data_parallel_training_loop(
                models_with_data_streams=entries(3),
                optimizer_factory=sgd,
                loop=lampdist.LoopOptions(max_epochs=3),
                stop=stop,
            )

    for steps in [*range(10)] * 10:
        with anyio.fail_after(30), pytest.raises(ExceptionGroup) as raised:
            await stopped_after(steps)
        assert len(raised.value.exceptions) == 1, raised.value.exceptions  # the setter returned
        error = raised.value.exceptions[0]
        assert isinstance(error, lampdist.LampdistTimeout), (steps, error)
        assert (error.rank, error.phase) == (0, "stop")
        assert "before training began" in error.message


async def test_a_refused_join_beside_the_roots_error_is_not_the_news() -> None:
    root = lampdist.LampdistTimeout("stop was requested in phase 'join'", rank=0, phase="stop")
    refused = [
        lampdist.JoinRejected("the run has already stopped", rank=r, phase="join") for r in (1, 2)
    ]
    assert most_telling(ExceptionGroup("local", [root, *refused])) is root
    assert most_telling(ExceptionGroup("local", refused)) is refused[0]  # nothing else to tell


async def test_a_follower_asked_to_stop_follows_until_the_roots_stop() -> None:
    follower_stop = anyio.Event()
    outcome = await _root_and_follower(
        follower_stop=follower_stop,
        max_epochs=3,
        timeouts=lampdist.Timeouts(stop=20.0),
        stop_follower_in_training=True,
    )
    assert follower_stop.is_set()
    assert isinstance(outcome[0], lampdist.LoopState) and outcome[0].epoch == 3
    assert outcome[1] == "returned"


async def test_a_follower_asked_to_stop_before_training_stops_at_once() -> None:
    """Nothing to drain before the first pass: no waiting out Timeouts.stop (a launcher's
    SIGKILL would come first). The root, never asked to stop, learns it and names rank 1."""
    follower_stop = anyio.Event()
    follower_stop.set()  # while the follower joins
    outcome = await _root_and_follower(
        follower_stop=follower_stop, max_epochs=3, timeouts=lampdist.Timeouts(stop=600.0)
    )
    error = outcome[1]
    assert isinstance(error, lampdist.LampdistTimeout), error
    assert (error.rank, error.phase) == (1, "stop")
    assert "before training began" in error.message
    assert isinstance(outcome[0], lampdist.LampdistError) and "rank 1" in str(outcome[0])


async def test_a_follower_whose_root_does_not_stop_in_time_abandons_the_run() -> None:
    follower_stop = anyio.Event()
    outcome = await _root_and_follower(
        follower_stop=follower_stop,
        max_epochs=10_000,  # the root never stops on its own within the test
        timeouts=lampdist.Timeouts(stop=0.5),
        slow_root=True,
        stop_follower_in_training=True,
    )
    error = outcome[1]
    assert isinstance(error, lampdist.LampdistTimeout), error
    assert (error.rank, error.phase) == (1, "stop")
    # and the root learns it, naming the follower
    assert isinstance(outcome[0], lampdist.LampdistError), outcome[0]
    assert "rank 1" in str(outcome[0])


async def test_cancelling_the_local_loop_is_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A service cancelling a job (or a server shutting down) is an orderly end: nothing for
    the user to act on, so nothing at WARNING."""
    started = anyio.Event()

    async def on_event(event: lampdist.PassEvent) -> None:
        started.set()

    caplog.set_level(logging.INFO, logger="lampdist")
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(
                partial(
                    lampdist.local_data_parallel_training_loop,
                    models_with_data_streams=entries(3),
                    optimizer_factory=sgd,
                    loop=lampdist.LoopOptions(max_epochs=10_000, on_event=on_event),
                )
            )
            await started.wait()
            group.cancel_scope.cancel()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, [r.getMessage() for r in warnings]
