"""The fault matrix in one process: ranks as tasks over the in-process control channel.

A follower "killed" here is a follower whose task is cancelled: its channel closes without
STOP and its clique posts an abort notice, as a dying process's would. The stop feature of
``drive_distributed_training`` (``stop``, ``Timeouts.stop``) is tested here too.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import attrs
import pytest
import torch

import lampdist
from lampdist import checkpoint, control

from ..roles.reference import mse
from . import _training
from . import rank as rank_script

DEADLINE = 10.0
COLLECTIVE_TIMEOUT = 4.0
"""In one process a rank leaving the clique after a failure can wait up to the collective
timeout for a Gloo collective stuck on a peer whose sockets are not closed yet (about one run
in ten of the root-cancel test; docs/reliability.md, Limits): keep it below DEADLINE."""

VANISHED_PAUSE = 1.0
"""How long a vanished rank's compute thread is held (see :meth:`Run.vanish`)."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@attrs.define(eq=False)
class Run:
    """Ranks of one in-process run, each in a cancel scope of its own, and how each ended."""

    nranks: int
    checkpoints: Path
    # The event loop, for the hooks that run in the losses (on the ranks' compute threads).
    token: anyio.lowlevel.EventLoopToken = attrs.field(factory=anyio.lowlevel.current_token)
    loop_thread: threading.Thread = attrs.field(factory=threading.current_thread)
    scopes: list[anyio.CancelScope] = attrs.field(init=False)
    errors: dict[int, BaseException] = attrs.field(factory=dict)
    results: dict[int, Any] = attrs.field(factory=dict)
    ended: dict[int, float] = attrs.field(factory=dict)
    fault_at: float | None = None
    phase: dict[int, str] = attrs.field(factory=dict)
    epoch: dict[int, int] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self.scopes = [anyio.CancelScope() for _ in range(self.nranks)]

    def fault(self) -> None:
        self.fault_at = time.monotonic()

    def on_loop(self, function: Callable[[], object]) -> None:
        """Call ``function`` on the event loop, from any thread."""
        if threading.current_thread() is self.loop_thread:
            function()
        else:
            anyio.from_thread.run_sync(function, token=self.token)

    def vanish(self, rank: int) -> None:
        """Cancel ``rank``'s task, from any thread.

        Called on the rank's compute thread, it then holds that thread for a while: a process
        that vanished computes nothing more, and without the pause the thread could finish
        the pass, its last collective included, before the cancellation lands (about one run
        in five of a validation pass, whose only collective is at its end)."""
        self.fault()
        self.on_loop(self.scopes[rank].cancel)
        if threading.current_thread() is not self.loop_thread:
            time.sleep(VANISHED_PAUSE)

    def took(self, rank: int) -> float:
        assert self.fault_at is not None
        return self.ended[rank] - self.fault_at


Hook = Callable[[Run, int, str, int, int], None]
"""``(run, rank, phase, epoch, batch)``: called in each loss (a rank's compute thread)."""


async def run_ranks(
    run: Run,
    *,
    hook: Hook | None = None,
    stop: anyio.Event | None = None,
    stop_timeout: float | None = 30.0,
    collective_timeout: float = COLLECTIVE_TIMEOUT,
    on_event: lampdist.OnPassEvent | None = None,
    checkpoint_wrapper: Callable[[lampdist.CheckpointState], lampdist.CheckpointState]
    | None = None,
    epochs: int = _training.EPOCHS,
) -> None:
    """Train ``run.nranks`` ranks to the end or until they fail; never raises for a rank."""
    root, followers = control.local_channels(run.nranks, join_timeout=10.0)
    save: lampdist.CheckpointState = checkpoint.to_directory(run.checkpoints)
    if checkpoint_wrapper is not None:
        save = checkpoint_wrapper(save)

    async def one(rank: int) -> None:
        entry = _training.entries(run.nranks)[rank]
        count = {"train": 0, "valid": 0}

        def source(phase: str, batches: Any) -> Any:
            def make() -> Any:
                run.phase[rank] = phase
                if phase == "train":
                    run.epoch[rank] = count["train"]
                count[phase] += 1
                return batches()

            return make

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            if hook is not None:
                hook(run, rank, run.phase[rank], run.epoch[rank], 0)
            return mse(output, target)

        assert entry.validation_batches is not None
        data = lampdist.ModelWithData(
            model=lampdist.SupervisedModel(entry.model.module, loss),
            train_batches=source("train", entry.train_batches),
            validation_batches=source("valid", entry.validation_batches),
        )
        timeouts = lampdist.Timeouts(collective=collective_timeout, stop=stop_timeout)
        try:
            with run.scopes[rank]:
                if rank == 0:
                    async with root:
                        run.results[0] = await lampdist.drive_distributed_training(
                            nranks=run.nranks,
                            device="cpu",
                            control=root,
                            data=data,
                            optimizer_factory=rank_script.sgd,
                            loop=lampdist.LoopOptions(
                                max_epochs=epochs, checkpoint_state=save, on_event=on_event
                            ),
                            timeouts=timeouts,
                            stop=stop,
                        )
                else:
                    async with followers[rank - 1] as channel:
                        await lampdist.follow_distributed_training(
                            rank=rank,
                            nranks=run.nranks,
                            device="cpu",
                            control=channel,
                            data=data,
                            timeouts=timeouts,
                        )
                        run.results[rank] = "stopped"
        except Exception as exc:
            run.errors[rank] = exc
        finally:
            run.ended[rank] = time.monotonic()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            for rank in range(run.nranks):
                group.start_soon(one, rank)


def leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def expect(run: Run, rank: int, kind: Any, pattern: str) -> None:
    error = leaf(run.errors[rank])
    assert isinstance(error, kind), repr(error)
    assert pattern in str(error), str(error)
    print(f"\nRELIABILITY-LOCAL | rank {rank} | {run.took(rank):.2f} s | {error}")
    assert run.took(rank) < DEADLINE


async def resumes_exactly(run: Run, expected_epoch: int) -> None:
    assert _training.latest_epoch(run.checkpoints) == expected_epoch
    resumed = await _training.train_in_process(run.nranks, resume_from=run.checkpoints)
    _training.assert_same_weights(resumed, await _training.reference(run.nranks))


# -- a follower that vanishes ---------------------------------------------------------------


@pytest.mark.parametrize("phase", ["train", "valid"])
async def test_a_follower_vanishing_mid_pass_stops_everyone(tmp_path: Path, phase: str) -> None:
    def hook(run: Run, rank: int, current: str, epoch: int, batch: int) -> None:
        if rank == 1 and current == phase and epoch == 1 and run.fault_at is None:
            run.vanish(1)

    run = Run(3, tmp_path)
    await run_ranks(run, hook=hook)
    assert run.scopes[1].cancelled_caught
    expect(run, 0, lampdist.PeerDisconnected, f"rank 1, phase '{phase}'")
    expect(run, 2, lampdist.RankFailed, f"rank 1, phase '{phase}'")
    await resumes_exactly(run, 1)


async def test_a_follower_vanishing_in_the_roots_checkpoint(tmp_path: Path) -> None:
    run = Run(3, tmp_path)

    def wrapper(save: lampdist.CheckpointState) -> lampdist.CheckpointState:
        async def slow(state: lampdist.TrainingState, lr_state: Any) -> None:
            if state.loop_state.epoch == 2:  # epoch 1's checkpoint
                run.vanish(1)
                await anyio.sleep(5)  # a long write: the failure arrives in the middle
            await save(state, lr_state)

        return slow

    await run_ranks(run, checkpoint_wrapper=wrapper)
    expect(run, 0, lampdist.PeerDisconnected, "rank 1, phase 'checkpoint'")
    expect(run, 2, lampdist.RankFailed, "the root stopped in phase 'checkpoint'")
    await resumes_exactly(run, 1)


async def test_a_follower_stalling_in_a_step_times_the_root_out(tmp_path: Path) -> None:
    def hook(run: Run, rank: int, current: str, epoch: int, batch: int) -> None:
        if rank == 2 and current == "train" and epoch == 1 and run.fault_at is None:
            run.fault()
            time.sleep(3)  # past collective_timeout: a stalled step

    run = Run(3, tmp_path)
    await run_ranks(run, hook=hook, collective_timeout=1.0)
    # The root's collective times out, or rank 1's (the same deadline) first, which the
    # root then hears of: either way a timeout, not rank 2 by name (it is alive).
    expect(run, 0, lampdist.CliqueError | lampdist.CliqueTimeout, "collective_timeout=1.0 s")
    expect(run, 1, lampdist.RankFailed, "collective_timeout=1.0 s")
    await resumes_exactly(run, 1)


async def test_cancelling_the_root_tells_the_followers(tmp_path: Path) -> None:
    run = Run(3, tmp_path)

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.epoch == 1 and event.step == 1:
            run.vanish(0)

    await run_ranks(run, on_event=on_event)
    assert run.scopes[0].cancelled_caught
    for rank in (1, 2):
        expect(run, rank, lampdist.RankFailed, "the root stopped in phase 'train': cancelled")
    await resumes_exactly(run, 1)


async def test_cancelling_the_root_while_its_step_waits_for_a_stalled_follower(
    tmp_path: Path,
) -> None:
    """The root's step waits for the gradient exchange inside a worker-thread call; cancelling
    the root aborts its clique so that the call stops waiting, long before the follower's
    stall or the collective timeout would end it."""

    def hook(run: Run, rank: int, current: str, epoch: int, batch: int) -> None:
        if rank == 2 and current == "train" and epoch == 1 and run.fault_at is None:
            time.sleep(0.5)  # the root reaches the exchange first
            run.vanish(0)
            stalled = time.monotonic()
            while 0 not in run.ended and time.monotonic() - stalled < 20:
                time.sleep(0.05)  # alive and silent until the root has ended

    run = Run(3, tmp_path)
    await run_ranks(run, hook=hook, collective_timeout=30.0)
    assert run.scopes[0].cancelled_caught
    print(f"\nRELIABILITY-LOCAL | rank 0 | {run.took(0):.2f} s | cancelled in a step")
    assert run.took(0) < DEADLINE  # the stall lasts until rank 0 ends; the timeout is 30 s
    for rank in (1, 2):
        expect(run, rank, lampdist.RankFailed, "cancelled")


async def test_an_exception_in_a_followers_loss_keeps_the_checkpoints(tmp_path: Path) -> None:
    def hook(run: Run, rank: int, current: str, epoch: int, batch: int) -> None:
        if rank == 1 and current == "valid" and epoch == 1:
            run.fault()
            raise ZeroDivisionError("boom")

    run = Run(2, tmp_path)
    await run_ranks(run, hook=hook)
    expect(run, 1, lampdist.TrainingError, "rank 1, phase 'valid'")
    expect(run, 0, lampdist.RankFailed, "rank 1, phase 'valid'")
    await resumes_exactly(run, 1)


# -- the graceful stop ------------------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_stop_finishes_the_epoch_checkpoints_and_stops_the_followers(
    tmp_path: Path,
) -> None:
    stop = anyio.Event()
    run = Run(3, tmp_path)

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.epoch == 1 and event.step == 1:
            run.fault()
            stop.set()

    await run_ranks(run, stop=stop, on_event=on_event, epochs=5)
    assert not run.errors
    state = run.results[0]
    assert isinstance(state, lampdist.LoopState)
    assert state.epoch == 2
    assert [p.epoch for p in state.learning_curve] == [0, 1]
    assert all(math.isfinite(p.training_loss) for p in state.learning_curve)
    assert run.results[1] == run.results[2] == "stopped"
    assert max(run.took(rank) for rank in range(3)) < DEADLINE
    await resumes_exactly(run, 2)


async def test_stop_before_training_abandons_the_run_at_once(tmp_path: Path) -> None:
    """Nothing to drain before the first pass: the root does not wait out Timeouts.stop for
    followers that may never come (under torchrun, the reason it was signalled); it ends at
    once, and the follower, still joining, learns that the root has gone."""
    stop = anyio.Event()
    stop.set()
    run = Run(2, tmp_path)
    with anyio.fail_after(60):  # far below stop_timeout: it did not wait
        await run_ranks(run, stop=stop, stop_timeout=3600.0)
    root_error = leaf(run.errors[0])
    assert isinstance(root_error, lampdist.LampdistTimeout), run.errors
    assert (root_error.rank, root_error.phase) == (0, "stop")
    assert "before training began" in root_error.message
    assert isinstance(leaf(run.errors[1]), lampdist.ControlError | lampdist.RankFailed)
    assert run.epoch == {}  # no pass began
    assert _training.latest_epoch(tmp_path) is None


async def test_an_epoch_that_outlasts_stop_timeout_is_abandoned(tmp_path: Path) -> None:
    stop = anyio.Event()

    def hook(run: Run, rank: int, current: str, epoch: int, batch: int) -> None:
        if rank == 1 and current == "train" and epoch == 1 and run.fault_at is None:
            run.fault()
            run.on_loop(stop.set)
            time.sleep(3)  # the epoch cannot end within stop_timeout

    run = Run(2, tmp_path)
    await run_ranks(run, hook=hook, stop=stop, stop_timeout=0.5)
    expect(run, 0, lampdist.LampdistTimeout, "Timeouts.stop=0.5 s")
    error = leaf(run.errors[0])
    assert isinstance(error, lampdist.LampdistError)
    assert error.phase == "stop"
    expect(run, 1, lampdist.RankFailed, "the root stopped in phase 'train': LampdistTimeout")
    await resumes_exactly(run, 1)


@pytest.mark.parametrize("stop_timeout", [-1.0, math.nan])
def test_a_bad_stop_timeout_is_a_config_error(stop_timeout: float) -> None:
    with pytest.raises(lampdist.ConfigError, match=r"Timeouts\.stop must be >= 0"):
        lampdist.Timeouts(stop=stop_timeout)
