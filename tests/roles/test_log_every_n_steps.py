"""``LoopOptions(log_every_n_steps=N)``: an event every N steps of a training pass with the
exact mean loss of those steps over every rank; ``LoopOptions(peak_flops=...)`` for MFU."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterable
from pathlib import Path

import anyio
import anyio.to_thread
import attrs
import pytest
import torch

import lampdist
from lampdist import trackers
from lampdist.trackers._base import event_scalars

from .reference import Batch, make_model, make_shards, mse

SIZES = [[5, 7, 3, 9, 2, 4, 6], [6, 6, 1, 4, 3, 5, 2]]
"""Two ranks, seven uneven batches each: a pass of seven steps."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def step_losses(initial: torch.nn.Module, shards: list[list[Batch]]) -> list[tuple[float, int]]:
    """One process on the concatenation of both ranks' batches of each step: each step's
    mean loss and its examples."""
    module = copy.deepcopy(initial)
    optimizer = sgd(module.parameters())
    found = []
    for batches in zip(*shards, strict=True):
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        loss = mse(module(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        optimizer.step()
        found.append((loss.item(), len(y)))
    return found


async def train(
    shards: list[list[Batch]],
    initial: torch.nn.Module,
    loop: lampdist.LoopOptions,
    tracker: trackers.Tracker | None = None,
) -> list[lampdist.PassEvent]:
    """Every event of the local loop on ``len(shards)`` ranks (given to ``tracker`` too)."""
    events: list[lampdist.PassEvent] = []

    async def keep(event: lampdist.PassEvent | lampdist.Recovered) -> None:
        assert isinstance(event, lampdist.PassEvent)
        events.append(event)
        if tracker is not None:
            await tracker(event)

    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(
                        copy.deepcopy(initial), mse, flops_per_example=1000.0
                    ),
                    train_batches=lambda shard=shard: shard,
                )
                for shard in shards
            ],
            optimizer_factory=sgd,
            loop=attrs.evolve(loop, on_event=keep),
        )
    return events


async def test_every_two_steps_of_seven_an_event_with_the_exact_mean_of_those_steps() -> None:
    shards = make_shards(SIZES, seed=1)
    initial = make_model(seed=0)
    events = await train(shards, initial, lampdist.LoopOptions(max_epochs=1, log_every_n_steps=2))
    windows = [e for e in events if e.window_steps is not None]
    assert [e.step for e in windows] == [2, 4, 6]  # no event for the seventh step alone
    assert all(e.window_steps == 2 and e.kind == "train" and not e.done for e in windows)
    reference = step_losses(initial, shards)
    for event in windows:
        steps = reference[event.step - 2 : event.step]
        examples = sum(n for _, n in steps)
        assert event.examples == examples
        assert event.loss == pytest.approx(sum(loss * n for loss, n in steps) / examples, rel=1e-12)
    # The running events go on as before, and the pass's last is its mean.
    last = events[-1]
    assert last.done and last.window_steps is None and last.step == 7
    total = sum(n for _, n in reference)
    assert last.loss == pytest.approx(sum(loss * n for loss, n in reference) / total, rel=1e-12)


async def test_without_the_option_no_window_events() -> None:
    events = await train(make_shards(SIZES), make_model(), lampdist.LoopOptions(max_epochs=1))
    assert all(e.window_steps is None for e in events)


async def test_the_trackers_record_the_window_events(tmp_path: Path) -> None:
    loop = lampdist.LoopOptions(max_epochs=1, log_every_n_steps=3)
    async with trackers.JsonLinesTracker(tmp_path / "events.jsonl") as tracker:
        events = await train(make_shards(SIZES), make_model(), loop, tracker)
    rows = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    windows = [r for r in rows if r.get("window_steps") is not None]
    assert [(r["step"], r["window_steps"]) for r in windows] == [(3, 3), (6, 3)]
    assert [r["loss"] for r in windows] == [e.loss for e in events if e.window_steps]
    window = next(e for e in events if e.window_steps)
    assert event_scalars(window) == {"train/window_loss": window.loss}
    assert "train/window_loss" not in event_scalars(events[-1])


async def test_the_peak_flops_option_wins_over_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LAMPDIST_PEAK_FLOPS", "5e9")
    shards = make_shards(SIZES, seed=1)
    given = await train(shards, make_model(), lampdist.LoopOptions(max_epochs=1, peak_flops=2e9))
    assert {e.peak_flops for e in given} == {2e9 * 2}  # the clique's: one device's times 2
    last = given[-1]
    assert last.mfu == pytest.approx(1000.0 * last.examples_per_second / 4e9)
    from_env = await train(shards, make_model(), lampdist.LoopOptions(max_epochs=1))
    assert {e.peak_flops for e in from_env} == {5e9 * 2}
    monkeypatch.delenv("LAMPDIST_PEAK_FLOPS")
    none = await train(shards, make_model(), lampdist.LoopOptions(max_epochs=1))
    assert {e.peak_flops for e in none} == {None}  # a CPU has no known peak


def test_bad_values_are_refused() -> None:
    with pytest.raises(lampdist.ConfigError, match="log_every_n_steps"):
        lampdist.LoopOptions(max_epochs=1, log_every_n_steps=0)
    with pytest.raises(lampdist.ConfigError, match="peak_flops"):
        lampdist.LoopOptions(max_epochs=1, peak_flops=-1.0)


async def test_window_events_are_never_coalesced() -> None:
    """A slow ``on_event`` holds the loop while the pass runs on: every window's event still
    comes, in order (the running events in between are coalesced)."""
    events: list[lampdist.PassEvent] = []

    async def slow(event: lampdist.PassEvent | lampdist.Recovered) -> None:
        assert isinstance(event, lampdist.PassEvent)
        if not events:
            await anyio.to_thread.run_sync(time.sleep, 0.3)  # the loop waits, the pass does not
        events.append(event)

    shards = make_shards(SIZES, seed=1)
    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(make_model(), mse),
                    train_batches=lambda shard=shard: shard,
                )
                for shard in shards
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=1, log_every_n_steps=1, on_event=slow),
        )
    assert [e.step for e in events if e.window_steps] == [1, 2, 3, 4, 5, 6, 7]
    assert events[-1].done
