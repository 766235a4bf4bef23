"""Training in steps: epochs as windows of N steps over endless streams, per-step learning
rates, checkpoints on wall time, and a resume in the middle of the data that ends bitwise
where an uninterrupted run ends."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import pytest
import torch

import lampdist
from lampdist import checkpoint, schedules

from .reference import Batch, make_model, make_shards, mse


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _cycle(batches: list[Batch]) -> Iterator[Batch]:
    return itertools.chain.from_iterable(itertools.repeat(batches))


def reference_in_steps(
    initial: torch.nn.Module,
    shards: list[list[Batch]],
    *,
    steps: int,
    accumulate: int = 1,
    factor: Callable[[int], float] = lambda step: 1.0,
) -> torch.nn.Module:
    """One process: at each step, the concatenation of every rank's next ``accumulate``
    batches, each rank's batches read over and over; the learning rate of step ``s`` times
    ``factor(s)`` through a plain ``LambdaLR``."""
    module = copy.deepcopy(initial)
    optimizer = sgd(module.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    streams = [_cycle(shard) for shard in shards]
    for _ in range(steps):
        window = [next(stream) for stream in streams for _ in range(accumulate)]
        window = [batch for batch in window if len(batch[1]) > 0]
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        optimizer.zero_grad()
        mse(module(x), y).backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        optimizer.step()
        scheduler.step()
    return module


async def _train(
    shards: list[list[Batch]],
    initial: torch.nn.Module,
    step: lampdist.StepOptions,
    *,
    epochs: int,
    loop: dict[str, Any] | None = None,
    resume: lampdist.Resumed | None = None,
    sources: list[Any] | None = None,
) -> tuple[list[torch.nn.Module], lampdist.LoopState]:
    modules = [copy.deepcopy(initial)] + [
        make_model(seed=10 + rank) for rank in range(1, len(shards))
    ]
    with anyio.fail_after(60):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse),
                    train_batches=sources[rank] if sources else (lambda s=shard: list(s)),
                )
                for rank, (module, shard) in enumerate(zip(modules, shards, strict=True))
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=epochs, **(loop or {})),
            step=step,
            resume=resume,
        )
    return modules, state


def _assert_close(modules: list[torch.nn.Module], want: torch.nn.Module) -> None:
    for module in modules:
        for (name, got), expected in zip(
            module.state_dict().items(), want.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-9, msg=name)


@pytest.mark.parametrize("step_on", ["root", "every_rank", "sharded"])
@pytest.mark.parametrize("accumulate", [1, 2])
async def test_epochs_of_n_steps_read_each_rank_data_as_an_endless_stream(
    step_on: lampdist._options.StepOn, accumulate: int
) -> None:
    """Three ranks with 5, 2 and 3 batches (one empty), windows of 4 steps: every rank reads
    its data over and over, across the epochs, like one process on the concatenation."""
    shards = make_shards([[5, 7, 3, 9, 2], [6, 0], [4, 8, 5]], seed=1)
    initial = make_model()
    expected = reference_in_steps(initial, shards, steps=12, accumulate=accumulate)
    step = lampdist.StepOptions(
        steps_per_epoch=4, accumulate_gradient_over_n_batches=accumulate, step_on=step_on
    )
    modules, state = await _train(shards, initial, step, epochs=3)
    assert len(state.learning_curve) == 3
    _assert_close(modules, expected)


@pytest.mark.parametrize("step_on", ["root", "sharded"])
async def test_a_per_step_schedule_acts_on_every_step_like_lambda_lr(
    step_on: lampdist._options.StepOn,
) -> None:
    shards = make_shards([[5, 7, 3], [6, 6]], seed=2)
    initial = make_model()
    per_step = schedules.warmup_cosine_steps(3, 12, final_factor=0.1)
    expected = reference_in_steps(initial, shards, steps=12, factor=per_step.factor)
    constant = reference_in_steps(initial, shards, steps=12)
    weight = expected.state_dict()["0.weight"]
    assert not torch.allclose(weight, constant.state_dict()["0.weight"], atol=1e-4)  # it acts
    step = lampdist.StepOptions(steps_per_epoch=4, learning_rate_per_step=per_step, step_on=step_on)
    modules, _ = await _train(shards, initial, step, epochs=3)
    _assert_close(modules, expected)


def test_step_schedules_warm_up_then_decay() -> None:
    cosine = schedules.warmup_cosine_steps(4, 14, final_factor=0.2)
    assert [cosine.factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine.factor(9) == pytest.approx(0.6)  # halfway down the cosine
    assert cosine.factor(14) == cosine.factor(100) == 0.2
    linear = schedules.warmup_linear_steps(0, 10)
    assert [linear.factor(s) for s in (0, 5, 10, 11)] == [1.0, 0.5, 0.0, 0.0]
    with pytest.raises(lampdist.ConfigError, match="total_steps"):
        schedules.warmup_cosine_steps(5, 5)


def test_a_per_step_schedule_needs_windows_of_steps() -> None:
    with pytest.raises(lampdist.ConfigError, match="needs steps_per_epoch"):
        lampdist.StepOptions(learning_rate_per_step=schedules.warmup_linear_steps(1, 5))
    with pytest.raises(lampdist.ConfigError, match="steps_per_epoch must be an int >= 1"):
        lampdist.StepOptions(steps_per_epoch=0)
    with pytest.raises(lampdist.ConfigError, match="checkpoint_interval"):
        lampdist.LoopOptions(max_epochs=1, checkpoint_interval=0)
    with pytest.raises(lampdist.ConfigError, match="no checkpoint_state"):
        lampdist.LoopOptions(max_epochs=1, checkpoint_interval=60.0)


class Boom(Exception):
    pass


def _stateful(shard: list[Batch], fail_after: int | None, *, scramble_first: bool = False) -> Any:
    """A source of torchdata ``StatefulDataLoader``s shuffled by the pass's seed;
    ``scramble_first``: the first call shuffles with another seed (a resumed run then draws
    the rest of the interrupted pass only from the loader's saved state); ``fail_after``:
    raise after that many batches over the whole run (a crash mid-window)."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    x = torch.cat([b[0] for b in shard])
    y = torch.cat([b[1] for b in shard])
    dataset = torch.utils.data.TensorDataset(x, y)
    drawn = 0
    calls = 0

    def source(context: lampdist.PassContext) -> Iterable[Batch]:
        nonlocal calls
        calls += 1
        seed = 999_999 if scramble_first and calls == 1 else context.seed
        loader = stateful.StatefulDataLoader(
            dataset, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(seed)
        )
        if fail_after is None:
            return loader  # type: ignore[no-any-return]
        return _Failing(loader)

    class _Failing:
        """The loader, raising once ``fail_after`` batches have been drawn."""

        def __init__(self, loader: Any) -> None:
            self.loader = loader

        def state_dict(self) -> Any:
            return self.loader.state_dict()

        def load_state_dict(self, state: Any) -> None:
            self.loader.load_state_dict(state)

        def __iter__(self) -> Iterator[Batch]:
            nonlocal drawn
            for batch in self.loader:
                drawn += 1
                if fail_after is not None and drawn > fail_after:
                    raise Boom
                yield batch

    return source


def _replayed(shard: list[Batch], fail_after: int | None, *, scramble_first: bool = False) -> Any:
    """A source without state: a DataLoader shuffled by the pass's generator (a resumed
    stream draws and drops the batches the checkpoint had drawn)."""
    x = torch.cat([b[0] for b in shard])
    y = torch.cat([b[1] for b in shard])
    dataset = torch.utils.data.TensorDataset(x, y)
    drawn = 0

    def source(context: lampdist.PassContext) -> Iterator[Batch]:
        nonlocal drawn
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=3, shuffle=True, generator=context.generator()
        )
        for batch in loader:
            drawn += 1
            if fail_after is not None and drawn > fail_after:
                raise Boom
            yield batch

    return source


@pytest.mark.parametrize(
    ("kind", "step_on", "nranks"),
    [
        ("stateful", "root", 2),
        ("stateful", "sharded", 2),
        ("replayed", "root", 2),
        ("replayed", "sharded", 2),
        ("stateful", "root", 1),
    ],
)
async def test_a_run_killed_mid_window_resumes_on_the_next_batch_bitwise(
    tmp_path: Path, kind: str, step_on: lampdist._options.StepOn, nranks: int
) -> None:
    """Two ranks read shuffled loaders in windows of 3 steps; one run goes through 5 epochs,
    another crashes in the middle of epoch 3 (its data in the middle of a pass) and resumes
    from the checkpoint of epoch 2 with other weights: both end bitwise alike."""
    make = _stateful if kind == "stateful" else _replayed
    shards = make_shards([[4] * 5, [5] * 4], seed=4)[:nranks]  # 20 examples: 7 batches each
    initial = make_model()
    step = lampdist.StepOptions(steps_per_epoch=3, step_on=step_on)

    def sources(fail_after: int | None, *, resumed: bool = False) -> list[Any]:
        return [
            make(shard, fail_after if rank == nranks - 1 else None, scramble_first=resumed)
            for rank, shard in enumerate(shards)
        ]

    whole, whole_state = await _train(shards, initial, step, epochs=5, sources=sources(None))
    directory = tmp_path / "run"
    with pytest.raises(lampdist.TrainingError) as info:
        await _train(
            shards,
            initial,
            step,
            epochs=5,
            loop={"checkpoint_state": checkpoint.to_directory(directory)},
            sources=sources(3 * 3 + 1),  # the second batch of epoch 3
        )
    assert isinstance(info.value.__cause__, Boom)
    resumed = await anyio.to_thread.run_sync(checkpoint.load_latest, directory)
    assert resumed is not None and resumed.epoch == 3
    ranks = resumed.training_state.rank_states
    assert ranks is not None and len(ranks) == nranks
    position = ranks[-1]["position"]
    assert position["batches"] == 2  # 9 batches drawn: one pass of 7, then 2
    assert position["data_pass"] == 1
    assert (position["state"] is not None) == (kind == "stateful")
    other = make_model(seed=77)
    finished, state = await _train(
        shards, other, step, epochs=5, resume=resumed, sources=sources(None, resumed=True)
    )
    assert state.epoch == whole_state.epoch == 5
    assert [p.training_loss for p in state.learning_curve] == [
        p.training_loss for p in whole_state.learning_curve
    ]
    for a, b in zip(whole, finished, strict=True):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), name


async def test_checkpoints_on_wall_time_come_after_the_interval_and_at_the_end() -> None:
    shards = make_shards([[5, 7], [6, 6]], seed=5)
    saved: list[int] = []

    async def record(state: lampdist.TrainingState, lr_state: Any) -> None:
        saved.append(state.loop_state.epoch)

    step = lampdist.StepOptions(steps_per_epoch=2)
    await _train(
        shards,
        make_model(),
        step,
        epochs=4,
        loop={"checkpoint_state": record, "checkpoint_interval": 3600.0},
    )
    assert saved == [4]  # only the last epoch: an hour has not passed
    saved.clear()
    await _train(
        shards,
        make_model(),
        step,
        epochs=4,
        loop={"checkpoint_state": record, "checkpoint_interval": 1e-9},
    )
    assert saved == [1, 2, 3, 4]


async def test_progress_counts_each_window_on_its_own() -> None:
    shards = make_shards([[5, 7, 3], [6, 6]], seed=6)
    last: list[lampdist.PassEvent] = []

    async def record(event: lampdist.PassEvent) -> None:
        if event.done:
            last.append(event)

    step = lampdist.StepOptions(steps_per_epoch=2, accumulate_gradient_over_n_batches=2)
    await _train(shards, make_model(), step, epochs=3, loop={"on_event": record})
    assert [(e.batches, e.total_batches, e.step) for e in last] == [(4, 4, 2)] * 3


@attrs.frozen
class _StopAt:
    """An epoch schedule that stops training (factor 0) from ``epoch`` on."""

    epoch: int
    init: None = None

    def learning_rate_factor(
        self, state: None, epoch: int, last_validation_loss: float | None
    ) -> tuple[None, float]:
        return None, 0.0 if epoch >= self.epoch else 1.0


@pytest.mark.parametrize("ended_by", ["schedule", "early_stopping"])
async def test_a_loop_that_ends_early_saves_the_epoch_the_interval_skipped(ended_by: str) -> None:
    shards = make_shards([[5, 7], [6, 6]], seed=5)
    saved: list[int] = []

    async def record(state: lampdist.TrainingState, lr_state: Any) -> None:
        saved.append(state.loop_state.epoch)

    ending: dict[str, Any] = (
        {"learning_rate_schedule": _StopAt(epoch=2)}
        if ended_by == "schedule"
        else {  # the training loss falls, so "max" sees no improvement after epoch 0
            "early_stopping": lampdist.EarlyStopping(
                monitor=lampdist.Monitor("training_loss", mode="max"), patience=1
            )
        }
    )
    _, state = await _train(
        shards,
        make_model(),
        lampdist.StepOptions(steps_per_epoch=2),
        epochs=4,
        loop={"checkpoint_state": record, "checkpoint_interval": 3600.0, **ending},
    )
    assert state.epoch == 2
    assert saved == [2]  # the last epoch trained, though an hour has not passed


def _broken_factory() -> list[Batch]:
    raise RuntimeError("no data")


async def _async_batches() -> Any:
    yield (torch.zeros(2, 3), torch.zeros(2, 1))


def _raising_midway() -> Iterator[Batch]:
    yield (torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64))
    raise RuntimeError("disk gone")


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        (_broken_factory, lampdist.TrainingError, "factory raised RuntimeError: no data"),
        (_raising_midway, lampdist.TrainingError, "batch source raised RuntimeError: disk gone"),
        (lambda: [], lampdist.BadBatch, "yielded no batch in pass 0"),
        (_async_batches, lampdist.BadBatch, "not an async one"),
    ],
    ids=["factory-raises", "raises-midway", "empty", "async"],
)
async def test_a_broken_training_stream_names_the_rank_and_phase(
    source: Any, error: type[lampdist.LampdistError], match: str
) -> None:
    shards = make_shards([[5, 7], [6, 6]], seed=5)
    with pytest.raises(error, match=match) as caught:
        await _train(
            shards,
            make_model(),
            lampdist.StepOptions(steps_per_epoch=3),
            epochs=2,
            sources=[lambda s=shards[0]: list(s), source],
        )
    assert (caught.value.rank, caught.value.phase) == (1, "train")


class _NumpyState:
    """Batches whose ``state_dict()`` holds a numpy number (not loadable with weights_only)."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": np.int64(3)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)


async def test_a_follower_part_the_root_cannot_read_back_names_that_rank() -> None:
    shards = make_shards([[5, 7], [6, 6]], seed=5)

    async def record(state: lampdist.TrainingState, lr_state: Any) -> None:
        pass

    with pytest.raises(lampdist.CheckpointError, match="rank 1's part of the checkpoint") as caught:
        await _train(
            shards,
            make_model(),
            lampdist.StepOptions(steps_per_epoch=2),
            epochs=2,
            loop={"checkpoint_state": record},
            sources=[lambda s=shards[0]: list(s), lambda s=shards[1]: _NumpyState(s)],
        )
    assert (caught.value.rank, caught.value.phase) == (1, "checkpoint")
