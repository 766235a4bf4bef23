"""Training sources that keep their own place resume without replay: lampdist's
``RandomBatches`` (no seed in user code), a ``datasets.IterableDataset`` and a
``StatefulDataLoader`` over a ``datasets.Dataset``, each resumed in the middle of a window on
2 ranks, bitwise; what a resume on another number of ranks keeps and refuses; and the warning
of a replay that takes long."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch

import lampdist
from lampdist import checkpoint

from .data_sources import KINDS, Dying, loss_model, make_source, rows
from .reference import make_model, make_shards

SIZES = [[4] * 5, [5] * 4]
"""20 rows per rank: 7 batches of 3 per pass over them."""
EPOCHS = 5


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class Boom(Exception):
    pass


class _Crashing:
    """A source whose iterables raise :class:`Boom` after ``after`` batches over the run."""

    def __init__(self, source: Any, after: int) -> None:
        self.source, self.after, self.taken = source, after, 0

    def __call__(self, context: lampdist.PassContext) -> Any:
        owner, iterable = self, self.source(context)

        class Iterable_:
            state_dict = iterable.state_dict
            load_state_dict = iterable.load_state_dict

            def __iter__(self) -> Iterator[Any]:
                for batch in iterable:
                    owner.taken += 1
                    if owner.taken > owner.after:
                        raise Boom
                    yield batch

        return Iterable_()


def _sources(kind: str, nranks: int, crash_after: int | None = None) -> list[Any]:
    sources = [make_source(kind, *rows(shard)) for shard in make_shards(SIZES * 2, seed=4)]
    sources = sources[:nranks]
    if crash_after is not None:
        sources[-1] = _Crashing(sources[-1], crash_after)
    return sources


async def _train(
    sources: list[Any],
    step: lampdist.StepOptions,
    *,
    initial: torch.nn.Module,
    directory: Path | None = None,
    resume: lampdist.Resumed | None = None,
) -> tuple[list[torch.nn.Module], lampdist.LoopState]:
    modules = [copy.deepcopy(initial)] + [make_model(seed=10 + r) for r in range(1, len(sources))]
    saving: dict[str, Any] = {}
    if directory is not None:
        saving["checkpoint_state"] = checkpoint.to_directory(directory)
    with anyio.fail_after(120):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(model=loss_model(module), train_batches=source)
                for module, source in zip(modules, sources, strict=True)
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=EPOCHS, **saving),
            step=step,
            resume=resume,
        )
    return modules, state


async def _crash_and_load(
    kind: str, step: lampdist.StepOptions, directory: Path, nranks: int = 2
) -> lampdist.Resumed:
    """A run whose last rank crashes at the second batch of epoch 3; its last checkpoint."""
    with pytest.raises(lampdist.TrainingError) as info:
        await _train(
            _sources(kind, nranks, crash_after=3 * 3 + 1),
            step,
            initial=make_model(),
            directory=directory,
        )
    assert isinstance(info.value.__cause__, Boom)
    resumed = await anyio.to_thread.run_sync(checkpoint.load_latest, directory)
    assert resumed is not None and resumed.epoch == 3
    return resumed


@pytest.mark.parametrize("kind", KINDS)
async def test_a_stateful_source_resumes_mid_window_bitwise_without_replay(
    tmp_path: Path, kind: str
) -> None:
    """Two ranks read windows of 3 steps; one run goes through 5 epochs, another crashes in
    the middle of epoch 3 (in the middle of its second pass over the data) and resumes from
    the checkpoint of epoch 2 with other weights and sources that never drew a batch: both
    end bitwise alike, the resumed sources loading their state rather than replaying."""
    pytest.importorskip("datasets")
    step = lampdist.StepOptions(steps_per_epoch=3)
    whole, whole_state = await _train(_sources(kind, 2), step, initial=make_model())
    resumed = await _crash_and_load(kind, step, tmp_path / "run")
    ranks = resumed.training_state.rank_states
    assert ranks is not None
    position = ranks[-1]["position"]
    assert position["state"] is not None
    if kind != "random":  # 9 batches drawn: one pass of 7, then 2
        assert (position["data_pass"], position["batches"]) == (1, 2)
    counting = [_Counting(source) for source in _sources(kind, 2)]
    finished, state = await _train(counting, step, initial=make_model(seed=77), resume=resumed)
    assert [p.training_loss for p in state.learning_curve] == [
        p.training_loss for p in whole_state.learning_curve
    ]
    for a, b in zip(whole, finished, strict=True):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), name
    # epochs 3 and 4: 6 batches a rank and a few loaded ahead (AHEAD); a replay of the 9
    # batches drawn before the checkpoint would make at least 15
    assert all(source.taken < 9 + 6 for source in counting), [s.taken for s in counting]


class _Counting:
    """A source counting the batches its iterables yield."""

    def __init__(self, source: Any) -> None:
        self.source, self.taken = source, 0

    def __call__(self, context: lampdist.PassContext) -> Any:
        owner, iterable = self, self.source(context)

        class Counted:
            state_dict = iterable.state_dict
            load_state_dict = iterable.load_state_dict

            def __iter__(self) -> Iterator[Any]:
                for batch in iterable:
                    owner.taken += 1
                    yield batch

        return Counted()


async def test_random_batches_draw_other_batches_on_each_rank_and_in_each_pass() -> None:
    """The generator is seeded from the run's shuffle seed and the rank: ranks differ, runs
    with the same seed agree, and a bounded pass (``steps``) draws anew in the next pass."""
    seen: list[tuple[int, int, list[int]]] = []

    def sample(generator: torch.Generator) -> int:
        return int(torch.randint(0, 1 << 30, (), generator=generator))

    source = lampdist.RandomBatches(sample, steps=4)
    for seed in (0, 0, 1):
        for rank in (0, 1):
            for data_pass in (0, 1):
                context = lampdist.PassContext(
                    epoch=data_pass,
                    kind="train",
                    rank=rank,
                    nranks=2,
                    seed=lampdist._source.pass_seed(seed, rank, data_pass, "train"),
                )
                seen.append((seed, rank, list(source(context))))
    draws = [d for _, _, d in seen]
    assert all(len(d) == 4 for d in draws)
    assert draws[:4] == draws[4:8]  # the same seed: the same batches
    assert len({tuple(d) for d in draws[:4] + draws[8:]}) == 8  # ranks, passes, seeds differ


async def test_an_endless_random_batches_without_steps_per_epoch_is_refused() -> None:
    """Its pass would never end (without the refusal the run trains until ``_train``'s
    deadline): refused before the run starts, naming both ways out."""
    x, y = make_shards([[4]])[0][0]
    batch = {"x": x, "y": y}
    sources = [lampdist.RandomBatches(lambda generator: batch) for _ in range(2)]
    with pytest.raises(lampdist.ConfigError, match=r"steps_per_epoch=N.*steps=N"):
        await _train(sources, lampdist.StepOptions(), initial=make_model(seed=0))


def test_random_batches_resume_from_their_state_at_once() -> None:
    """The state after k draws makes a new iterable draw batch k + 1, at any k."""
    source = lampdist.RandomBatches(lambda g: torch.rand(2, generator=g))
    context = lampdist.PassContext(epoch=0, kind="train", rank=1, nranks=2, seed=5)
    first = source(context)
    draws = iter(first)
    for _ in range(1000):
        next(draws)
    state = first.state_dict()
    want = next(draws)
    again = source(context)
    again.load_state_dict(state)
    assert again.drawn == 1000
    assert torch.equal(next(iter(again)), want)
    with pytest.raises(lampdist.ConfigError, match="not a RandomBatches state"):
        again.load_state_dict({"sampler": 3})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"sample": 3}, "sample must be a callable"), ({"steps": 0}, "steps must be a positive")],
)
def test_random_batches_refuse_bad_values(kwargs: dict[str, Any], message: str) -> None:
    arguments = {"sample": lambda g: 0, **kwargs}
    with pytest.raises(lampdist.ConfigError, match=message):
        lampdist.RandomBatches(arguments.pop("sample"), **arguments)


async def test_a_source_state_on_another_rank_count_is_refused(tmp_path: Path) -> None:
    """A StatefulDataLoader's place in its own rank's data cannot be split over 1 rank: a
    ConfigError before training, naming both counts and the way out (which works)."""
    pytest.importorskip("datasets")
    step = lampdist.StepOptions(steps_per_epoch=3)
    resumed = await _crash_and_load("hf-loader", step, tmp_path / "run")
    with pytest.raises(lampdist.ConfigError, match=r"written by 2 ranks.*this run has 1") as info:
        await _train(_sources("hf-loader", 1), step, initial=make_model(), resume=resumed)
    assert "rank_states=None" in str(info.value)
    afresh = attrs.evolve(
        resumed, training_state=attrs.evolve(resumed.training_state, rank_states=None)
    )
    _, state = await _train(_sources("hf-loader", 1), step, initial=make_model(), resume=afresh)
    assert state.epoch == EPOCHS


async def test_random_batches_on_another_rank_count_draw_a_new_pass(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """RandomBatches' state gives way on 1 rank: it draws from the seed of the pass after
    the furthest one (not the first batches again), and the same resume twice agrees."""
    step = lampdist.StepOptions(steps_per_epoch=3)
    resumed = await _crash_and_load("random", step, tmp_path / "run")
    drawn: list[list[torch.Tensor]] = []

    def recording() -> Any:
        inner = _sources("random", 1)[0]
        mine: list[torch.Tensor] = []
        drawn.append(mine)

        def sample(generator: torch.Generator) -> Any:
            batch = inner.sample(generator)
            mine.append(batch["x"])
            return batch

        return lampdist.RandomBatches(sample)

    with caplog.at_level(logging.WARNING, logger="lampdist"):
        await _train([recording()], step, initial=make_model(), resume=resumed)
    assert any("afresh, at pass 1" in r.getMessage() for r in caplog.records)
    await _train([recording()], step, initial=make_model(), resume=resumed)
    await _train([recording()], step, initial=make_model())  # a new run, from pass 0
    first, second, new = drawn
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=False))
    assert not torch.equal(first[0], new[0])


class _Slow:
    """A source without state whose every batch takes ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self) -> Iterator[Any]:
        x, y = rows(make_shards([[3] * 3], seed=4)[0])
        while True:
            time.sleep(self.delay)
            yield {"x": x, "y": y}


async def test_a_long_replay_is_logged_once_naming_the_source_and_the_batches(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A source without state replays on resume; past 2 s one warning names it and the
    batches it replays."""
    step = lampdist.StepOptions(steps_per_epoch=2)
    saved: list[lampdist.TrainingState] = []

    async def keep(state: lampdist.TrainingState, lr_state: object) -> None:
        saved.append(copy.deepcopy(state))

    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(model=loss_model(make_model()), train_batches=_Slow(0))
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=5, checkpoint_state=keep),
            step=step,
        )
    resumed = lampdist.Resumed(training_state=saved[-1])  # 10 batches drawn
    with caplog.at_level(logging.WARNING, logger="lampdist"), anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(model=loss_model(make_model()), train_batches=_Slow(0.25))
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=6),
            step=step,
            resume=resumed,
        )
    replays = [r.getMessage() for r in caplog.records if "replays" in r.getMessage()]
    assert len(replays) == 1, replays
    assert "replays 10 batches of the training source" in replays[0]
    assert "_Slow" in replays[0] and "RandomBatches" in replays[0]


def test_dying_keeps_the_state_of_what_it_wraps() -> None:
    """The recovery harness's wrapper keeps the state of what it wraps."""
    source = Dying(make_source("random", *rows(make_shards([[3]], seed=4)[0])), 10**9, Path(), 9)
    context = lampdist.PassContext(epoch=0, kind="train", rank=0, nranks=1, seed=1)
    iterable = source(context)
    next(iter(iterable))
    assert iterable.state_dict()["drawn"] == 1


@pytest.mark.parametrize("position", [10, 10**12])
def test_the_first_batch_after_a_resume_costs_the_same_at_any_position(position: int) -> None:
    """A stream resumed from a RandomBatches state draws the batch after its position with
    the first call of ``sample`` (a few more load ahead), whatever the position."""
    from lampdist._epoch._feed import AHEAD
    from lampdist._epoch._stream import StreamPosition, TrainStream, stream_context

    calls = [0]

    def sample(generator: torch.Generator) -> torch.Tensor:
        calls[0] += 1
        return torch.rand(2, generator=generator)

    source: lampdist.RandomBatches[Any] = lampdist.RandomBatches(sample)
    draws = source(stream_context(0, 0, 1)(0))
    iterator = iter(draws)
    for _ in range(10):
        next(iterator)
    state = {**draws.state_dict(), "drawn": position}  # the generator's state is what counts
    want = next(iterator)
    calls[0] = 0
    stream = TrainStream.open(
        source,
        model=loss_model(make_model()),
        device=torch.device("cpu"),
        rank=0,
        intra_op_threads=1,
        window=10**15,
        start=StreamPosition(data_pass=0, batches=position, state=state),
        context=stream_context(0, 0, 1),
    )
    try:
        loaded = stream.feed.next()
        assert loaded is not None and torch.equal(loaded.data, want)
        assert calls[0] <= AHEAD + 2
    finally:
        stream.close()
