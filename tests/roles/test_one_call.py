"""One call on every rank: the same ``lampdist.train`` call on every rank returns the root's
final LoopState everywhere (carried by the STOP), ``loop`` may be left out on followers, and
lampdist's trackers record on the root only."""

from __future__ import annotations

import json
import math
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path

import anyio
import pytest
import torch

import lampdist
from lampdist import trackers
from lampdist._launched_rank import launched_rank
from lampdist.control import Command, CommandKind
from lampdist.control._wire import CommandMessage, decode_payload, encode_frame
from lampdist.launch import LaunchEnv


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shard(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(24, 3, generator=generator)
    return [(inputs[i : i + 8], inputs[i : i + 8].sum(1, keepdim=True)) for i in (0, 8, 16)]


def sgd(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1)


async def train_on_two_ranks(
    loop_of: dict[int, lampdist.LoopOptions | None], tracker_path: Path | None = None
) -> dict[int, lampdist.LoopState]:
    """The same call to ``lampdist.train`` on ranks 0 and 1 of one run over TCP, but for
    ``loop_of[rank]``; with ``tracker_path``, both ranks give the same JSON-lines tracker
    (told their rank: the tasks share one environment)."""
    port = free_port()
    results: dict[int, lampdist.LoopState] = {}
    records = tracker_path or Path(tempfile.mkdtemp()) / "unused.jsonl"  # not in the checkout

    async def rank(r: int) -> None:
        loop = loop_of[r]
        async with trackers.JsonLinesTracker(records, rank=r) as tracker:
            if tracker_path is not None and loop is not None:
                loop = lampdist.LoopOptions(
                    max_epochs=loop.max_epochs, on_event=tracker, log_every_n_steps=2
                )
            await tracker.log_hyperparameters({"lr": 0.1})
            results[r] = await lampdist.train(
                data=lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(
                        torch.nn.Linear(3, 1), torch.nn.functional.mse_loss
                    ),
                    train_batches=lambda: shard(r),
                    validation_batches=lambda: shard(10 + r),
                ),
                launch=LaunchEnv(rank=r, nranks=2, port=port, secret="test"),
                optimizer_factory=sgd,
                stop_on_signals=False,
                loop=loop,
                timeouts=lampdist.Timeouts(join=20),
            )
            await tracker.log_summary(results[r])

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(rank, 1)
            group.start_soon(rank, 0)
    return results


async def test_every_rank_returns_the_roots_final_state(tmp_path: Path) -> None:
    loop = lampdist.LoopOptions(max_epochs=3)
    path = tmp_path / "events.jsonl"
    results = await train_on_two_ranks({0: loop, 1: loop}, path)
    assert results[0].epoch == 3 and len(results[0].learning_curve) == 3
    assert results[1] == results[0]
    # One run in the tracker: the root's; the follower's tracker opened and wrote nothing.
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [r["record"] for r in records]
    assert kinds.count("hyperparameters") == 1 and kinds.count("summary") == 1
    ends = [r for r in records if r["record"] == "event" and r["done"] and r["kind"] == "train"]
    assert [r["epoch"] for r in ends] == [0, 1, 2]
    assert [r["step"] for r in records if r.get("window_steps")] == [2, 2, 2]


async def test_a_follower_needs_no_loop() -> None:
    results = await train_on_two_ranks({0: lampdist.LoopOptions(max_epochs=2), 1: None})
    assert results[1] == results[0] and results[0].epoch == 2


async def test_a_root_without_a_loop_is_told_to_pass_one() -> None:
    with anyio.fail_after(20), pytest.raises(lampdist.ConfigError) as caught:
        await lampdist.train(
            data=lampdist.ModelWithData(
                model=lampdist.SupervisedModel(torch.nn.Linear(3, 1), torch.nn.functional.mse_loss),
                train_batches=lambda: shard(0),
            ),
            launch=LaunchEnv(rank=0, nranks=2, port=free_port(), secret="test"),
            optimizer_factory=sgd,
            stop_on_signals=False,
        )
    error = caught.value
    assert "loop=LoopOptions" in str(error) and error.rank == 0, error


async def test_a_follower_tracker_opens_and_writes_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "csv"
    async with trackers.fan_out(
        trackers.CsvTracker(directory, rank=1), trackers.TensorBoardTracker(directory, rank=3)
    ) as tracker:
        await tracker.log_hyperparameters({"lr": 0.1})
        await tracker(
            lampdist.PassEvent(
                epoch=0,
                kind="train",
                pass_index=0,
                step=1,
                batches=1,
                total_batches=1,
                examples=4,
                loss=0.5,
                seconds=0.1,
                done=True,
            )
        )
        await tracker.log_summary(lampdist.LoopState(epoch=1))
    assert not directory.exists()
    async with trackers.CsvTracker(directory, rank=1) as again:
        await again.log_summary(lampdist.LoopState())
        with pytest.raises(lampdist.ConfigError, match="called twice"):  # still checked
            await again.log_summary(lampdist.LoopState())


async def test_a_tracker_reads_its_rank_from_the_launchers_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    async with trackers.CsvTracker(tmp_path / "follower"):
        pass
    assert not (tmp_path / "follower").exists()
    monkeypatch.setenv("RANK", "0")
    async with trackers.CsvTracker(tmp_path / "root"):
        pass
    assert (tmp_path / "root" / "events.csv").exists()


def test_the_launched_rank_follows_from_env() -> None:
    assert launched_rank({}) == 0
    assert launched_rank({"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "1"}) == 3
    assert launched_rank({"SLURM_PROCID": "2", "SLURM_NTASKS": "3"}) == 2
    with pytest.raises(lampdist.ConfigError, match="RANK"):
        launched_rank({"RANK": "x", "WORLD_SIZE": "2"})


def _curve(epochs: int) -> tuple[lampdist.CurvePoint, ...]:
    return tuple(
        lampdist.CurvePoint(
            epoch=e,
            training_loss=1.0 / (e + 1),
            validation_loss=math.nan if e == 0 else math.inf,
            smoothed_validation_loss=-math.inf if e == 0 else None,
            metrics={"training_accuracy": 0.5, "validation_confusion": (1.0, math.nan)},
        )
        for e in range(epochs)
    )


def _same(a: lampdist.LoopState, b: lampdist.LoopState) -> bool:
    """Equal, NaN equal to NaN (through their JSON spelling)."""
    from lampdist._state_json import loop_state_to_json

    return repr(loop_state_to_json(a)) == repr(loop_state_to_json(b))


def test_the_stop_carries_the_state_over_the_wire_non_finite_values_included() -> None:
    state = lampdist.LoopState(
        epoch=3, last_validation_loss=math.inf, min_validation_loss=0.25, min_validation_epoch=1,
        learning_curve=_curve(3),
        early_stopping=lampdist.EarlyStoppingState(best=math.nan, wait=2),
    )  # fmt: skip
    stop = Command(kind=CommandKind.STOP, epoch=3, pass_index=6, state=state)
    message = decode_payload(encode_frame(CommandMessage(seq=9, command=stop))[4:])
    assert isinstance(message, CommandMessage)
    got = message.command.state
    assert got is not None and _same(got, state)
    assert math.isnan(got.learning_curve[0].validation_loss or 0.0)
    assert got.learning_curve[1].validation_loss == math.inf


def test_a_state_too_long_for_a_frame_keeps_its_newest_epochs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = lampdist.LoopState(epoch=2000, learning_curve=_curve(2000))
    stop = Command(kind=CommandKind.STOP, epoch=2000, pass_index=4000, state=state)
    limit = 16 * 1024
    frame = encode_frame(CommandMessage(seq=1, command=stop), limit)
    assert len(frame) - 4 <= limit
    message = decode_payload(frame[4:])
    assert isinstance(message, CommandMessage) and message.command.state is not None
    curve = message.command.state.learning_curve
    assert 0 < len(curve) < 2000
    assert [p.epoch for p in curve] == list(range(2000 - len(curve), 2000))  # the newest
    assert message.command.state.epoch == 2000
    assert "max_frame_bytes" in caplog.text


def test_only_an_orderly_stop_carries_a_state() -> None:
    for kind, error in ((CommandKind.TRAIN, None), (CommandKind.STOP, "boom")):
        with pytest.raises(lampdist.ConfigError, match="LoopState"):
            Command(kind=kind, epoch=0, pass_index=0, error=error, state=lampdist.LoopState())
