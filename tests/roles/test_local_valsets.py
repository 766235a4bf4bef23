"""Several validation sets over in-process ranks: each set's loss exact over uneven shards, the
driving set chosen by ``LoopOptions.validation_set``, the validation before training, the
evaluation-only run, and the ranks' agreement on the sets."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import torch

import lampdist
from lampdist import checkpoint

from .reference import Batch, make_model, make_shards, mse

TRAIN_SIZES = [[5, 7, 3], [6, 0, 4]]
SETS = {  # each rank's batch sizes: uneven, one rank without any batch of "far"
    "near": [[5, 3], [4]],
    "far": [[2, 6, 1], []],
}
NRANKS = 2


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def far(batches: Sequence[Batch]) -> list[Batch]:
    """Targets the training data pulls the model away from."""
    return [(x, 3.0 - 4.0 * y) for x, y in batches]


def set_shards() -> dict[str, list[list[Batch]]]:
    """Every set's batches, by rank."""
    near = make_shards(SETS["near"], seed=2)
    return {"near": near, "far": [far(s) for s in make_shards(SETS["far"], seed=3)]}


def reference_loss(module: torch.nn.Module, shards: Sequence[Sequence[Batch]]) -> float:
    """One process's mean loss over the concatenation of every rank's batches (float64)."""
    with torch.no_grad():
        batches = [b for shard in shards for b in shard]
        xs = torch.cat([x for x, _ in batches])
        ys = torch.cat([y for _, y in batches])
        return float(mse(module(xs), ys))


def entries(
    modules: Sequence[torch.nn.Module],
    order: Sequence[str] = ("near", "far"),
    orders: dict[int, Sequence[str]] | None = None,
) -> list[lampdist.ModelWithData]:
    train = make_shards(TRAIN_SIZES, seed=1)
    sets = set_shards()
    result = []
    for rank, module in enumerate(modules):
        names = (orders or {}).get(rank, order)
        result.append(
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, mse),
                train_batches=functools.partial(list, train[rank]),
                validation_batches={n: functools.partial(list, sets[n][rank]) for n in names},
            )
        )
    return result


def fresh_modules() -> list[torch.nn.Module]:
    modules = [make_model(seed=10 + rank) for rank in range(NRANKS)]
    modules[0].load_state_dict(make_model().state_dict())
    return modules


async def train(
    modules: Sequence[torch.nn.Module], loop: lampdist.LoopOptions, **kwargs: Any
) -> lampdist.LoopState:
    with anyio.fail_after(60):
        return await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=entries(modules),
            optimizer_factory=sgd,
            loop=loop,
            **kwargs,
        )


@pytest.mark.parametrize("step_on", ["root", "every_rank", "sharded"])
async def test_each_sets_loss_is_exact_over_uneven_shards_before_and_after_training(
    step_on: lampdist._options.StepOn,
) -> None:
    modules = fresh_modules()
    initial = {name: reference_loss(make_model(), shards) for name, shards in set_shards().items()}
    events: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent | lampdist.Recovered) -> None:
        assert isinstance(event, lampdist.PassEvent)
        if event.done:
            events.append(event)

    loop = lampdist.LoopOptions(max_epochs=2, validate_before_training=True, on_event=on_event)
    state = await train(modules, loop, step=lampdist.StepOptions(step_on=step_on))
    first, *epochs = state.learning_curve
    assert first.epoch == -1 and math.isnan(first.training_loss)
    assert first.smoothed_validation_loss is None
    for name, loss in initial.items():
        assert first.metrics[f"validation_{name}_loss"] == pytest.approx(loss, rel=1e-12)
    assert first.validation_loss == first.metrics["validation_near_loss"]  # the first set
    final = {name: reference_loss(modules[0], shards) for name, shards in set_shards().items()}
    last = epochs[-1]
    assert [p.epoch for p in epochs] == [0, 1]
    assert last.metrics == {
        "validation_near_loss": pytest.approx(final["near"], rel=1e-12),
        "validation_far_loss": pytest.approx(final["far"], rel=1e-12),
    }
    assert last.validation_loss == last.metrics["validation_near_loss"]
    # every set's pass an event of its own, named, in order; the first before any training
    assert [(e.epoch, e.kind, e.validation_set) for e in events] == [
        (0, "valid", "near"),
        (0, "valid", "far"),
        (0, "train", None),
        (0, "valid", "near"),
        (0, "valid", "far"),
        (1, "train", None),
        (1, "valid", "near"),
        (1, "valid", "far"),
    ]
    assert events[-1].loss == last.metrics["validation_far_loss"]


async def test_the_driving_set_drives_the_best_model_and_early_stopping() -> None:
    outcomes = {}
    for driving in ("near", "far"):
        modules = fresh_modules()
        loop = lampdist.LoopOptions(
            max_epochs=6,
            validation_set=driving,
            return_min_validation_loss_model=range(6),
            early_stopping=lampdist.EarlyStopping(
                monitor=lampdist.Monitor("smoothed_validation_loss"), patience=2
            ),
        )
        state = await train(modules, loop)
        curve = state.learning_curve
        for point in curve:  # every set reported whichever drives
            assert point.validation_loss == point.metrics[f"validation_{driving}_loss"]
        outcomes[driving] = (state.epoch, state.min_validation_epoch)
        losses = [cast(float, p.metrics[f"validation_{driving}_loss"]) for p in curve]
        assert outcomes[driving] == by_the_rules(losses, patience=2, max_epochs=6)
    # near's losses: best at epoch 3 and no two epochs in a row without improving; far's
    # worsen after epoch 2, which stops the run after epoch 4
    assert outcomes == {"near": (6, 3), "far": (5, 2)}


def by_the_rules(losses: Sequence[float], *, patience: int, max_epochs: int) -> tuple[int, int]:
    """(epochs run, best epoch) by the early stopping and best model rules on ``losses``."""
    best, best_epoch, wait = math.inf, -1, 0
    for epoch, loss in enumerate(losses):
        if loss < best:
            best, best_epoch, wait = loss, epoch, 0
        else:
            wait += 1
        if wait >= patience:
            return epoch + 1, best_epoch
    return max_epochs, best_epoch


async def test_a_monitor_watches_any_sets_loss() -> None:
    modules = fresh_modules()
    loop = lampdist.LoopOptions(
        max_epochs=6,
        early_stopping=lampdist.EarlyStopping(
            monitor=lampdist.Monitor("validation_far_loss"), patience=1
        ),
    )
    state = await train(modules, loop)
    assert state.epoch < 6  # the first set (near) drives, but far's loss stopped the run


async def test_validation_before_training_is_not_repeated_on_resume(tmp_path: Path) -> None:
    loop = lampdist.LoopOptions(
        max_epochs=1,
        validate_before_training=True,
        checkpoint_state=checkpoint.to_directory(tmp_path),
    )
    first = await train(fresh_modules(), loop)
    resume = checkpoint.load_latest(tmp_path)
    assert resume is not None
    stored = resume.training_state.loop_state.learning_curve
    assert [(p.epoch, p.validation_loss, p.metrics) for p in stored] == [
        (p.epoch, p.validation_loss, p.metrics) for p in first.learning_curve
    ]
    assert math.isnan(stored[0].training_loss)
    events: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent | lampdist.Recovered) -> None:
        assert isinstance(event, lampdist.PassEvent)
        if event.done:
            events.append(event)

    loop = lampdist.LoopOptions(
        max_epochs=2,
        validate_before_training=True,
        checkpoint_state=checkpoint.to_directory(tmp_path),
        on_event=on_event,
    )
    state = await train(fresh_modules(), loop, resume=resume)
    assert [p.epoch for p in state.learning_curve] == [-1, 0, 1]
    assert state.learning_curve[1] == first.learning_curve[1]
    assert [(e.epoch, e.kind) for e in events] == [(1, "train"), (1, "valid"), (1, "valid")]


async def test_evaluate_locally_from_a_checkpoint(tmp_path: Path) -> None:
    trained = fresh_modules()
    loop = lampdist.LoopOptions(max_epochs=2, checkpoint_state=checkpoint.to_directory(tmp_path))
    state = await train(trained, loop)
    modules = fresh_modules()  # the untrained weights: the checkpoint's must win
    newest = max(tmp_path.glob("epoch-*"))  # noqa: ASYNC240  (a test's directory listing)
    with anyio.fail_after(60):
        evaluation = await lampdist.evaluate_locally(
            models_with_data_streams=entries(modules),
            optimizer_factory=sgd,
            resume=newest,
        )
    want = {name: reference_loss(trained[0], shards) for name, shards in set_shards().items()}
    assert list(evaluation.losses) == ["near", "far"]
    assert evaluation.losses == {n: pytest.approx(loss, rel=1e-12) for n, loss in want.items()}
    assert evaluation.examples == {"near": 12, "far": 9}
    last = state.learning_curve[-1]
    assert evaluation.losses["far"] == pytest.approx(last.metrics["validation_far_loss"], rel=1e-12)
    for module in modules:  # every rank holds the evaluated model
        for name, tensor in trained[0].state_dict().items():
            assert torch.equal(module.state_dict()[name], tensor)


async def test_ranks_that_name_other_sets_are_refused() -> None:
    modules = fresh_modules()
    with anyio.fail_after(60), pytest.raises(lampdist.MismatchError, match="validation sets"):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=entries(modules, orders={1: ("far", "near")}),
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=1),
        )


def test_bad_set_names_and_choices_are_refused() -> None:
    model = lampdist.SupervisedModel(make_model(), mse, metrics={"near_loss": mse_metric()})

    def data(sets: Any, m: lampdist.SupervisedModel | None = None) -> lampdist.ModelWithData:
        plain = lampdist.SupervisedModel(make_model(), mse)
        return lampdist.ModelWithData(model=m or plain, train_batches=list, validation_batches=sets)

    for sets in ({}, {"": list}, {"not a name": list}, {3: list}):
        with pytest.raises(lampdist.ConfigError, match="validation_batches"):
            data(sets)
    with pytest.raises(lampdist.ConfigError, match="validation_near_loss"):
        data({"near": list}, model)  # a set's loss named as a metric
    with pytest.raises(lampdist.ConfigError, match="rename the set"):
        data(
            {"a_b": list, "a": list},
            lampdist.SupervisedModel(
                make_model(), mse, metrics={"b_loss": mse_metric(), "x": mse_metric()}
            ),
        )
    with pytest.raises(lampdist.ConfigError, match="validation_batches\\['v'\\]"):
        data({"v": 3})
    two = data({"val": list, "train": list})
    assert two.validation_sets == ("val", "train")
    for chosen, given in (("test", two), ("val", data(list)), ("val", data(None))):
        loop = lampdist.LoopOptions(max_epochs=1, validation_set=chosen)
        with pytest.raises(lampdist.ConfigError, match="validation_set"):
            lampdist._loop_options.check_monitors(loop, given)
    with pytest.raises(lampdist.ConfigError, match="validation_set"):
        lampdist.LoopOptions(max_epochs=1, validation_set="")
    watched = lampdist.LoopOptions(
        max_epochs=1,
        early_stopping=lampdist.EarlyStopping(monitor=lampdist.Monitor("validation_test_loss")),
    )
    with pytest.raises(lampdist.ConfigError, match="validation_test_loss"):
        lampdist._loop_options.check_monitors(watched, two)
    good = lampdist.LoopOptions(
        max_epochs=1,
        validation_set="train",
        early_stopping=lampdist.EarlyStopping(monitor=lampdist.Monitor("validation_val_loss")),
    )
    lampdist._loop_options.check_monitors(good, two)


def mse_metric() -> lampdist.Metric:
    return lampdist.Metric(lambda out, y: (((out - y) ** 2).sum(), y.numel()))
