"""Choosing and stopping by a metric, end to end: in-process ranks keep the model of the best
validation accuracy, stop early, and resume an early-stopping run exactly (from disk too)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

import lampdist
from lampdist import checkpoint, schedules

from .reference import Batch, make_model, make_shards, mse

ACCURACY = lampdist.Monitor("validation_accuracy", mode="max")
MAX_EPOCHS = 10


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def _classifier(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
    ).double()


def _classes(shards: list[list[Batch]]) -> list[list[Batch]]:
    edges = torch.tensor([-0.3, 0.3])
    return [[(x, torch.bucketize(y.reshape(-1), edges)) for x, y in shard] for shard in shards]


def _correct(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    return (out.argmax(1) == y).sum(), y.numel()


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y)


class Stop(Exception):
    pass


# lr 0.5 for three epochs, then 2: the accuracy peaks at epoch 5, the loss bottoms at 7
SCHEDULE = schedules.from_epoch_count(lambda epoch: 1.0 if epoch < 3 else 4.0)


async def train(
    *,
    resume: lampdist.Resumed | None = None,
    stop_after: int | None = None,
    directory: Path | None = None,
    early_stopping: lampdist.EarlyStopping | None = None,
    schedule: schedules.LearningRateSchedule[Any] = SCHEDULE,
    snapshots: list[dict[str, torch.Tensor]] | None = None,
) -> tuple[list[torch.nn.Module], lampdist.LoopState | None, list[lampdist.TrainingState]]:
    train_shards = _classes(make_shards([[6, 5, 7, 4], [4, 8, 3], []], seed=21))
    valid_shards = _classes(make_shards([[9, 4], [8], [5]], seed=22))
    seed = 0 if resume is None else 40  # a resumed run starts from other weights
    modules = [_classifier(seed + rank) for rank in range(3)]
    saved: list[lampdist.TrainingState] = []
    to_disk = checkpoint.to_directory(directory) if directory is not None else None

    async def on_checkpoint(state: lampdist.TrainingState, lr_state: Any) -> None:
        saved.append(copy.deepcopy(state))
        if to_disk is not None:
            await to_disk(state, lr_state)
        if stop_after is not None and state.loop_state.epoch == stop_after:
            raise Stop

    async def on_event(event: lampdist.PassEvent) -> None:
        if snapshots is not None and event.kind == "valid":
            snapshots.append(copy.deepcopy(modules[0].state_dict()))

    try:
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(
                        module, _cross_entropy, metrics={"accuracy": lampdist.Metric(_correct)}
                    ),
                    train_batches=functools.partial(list, t),
                    validation_batches=functools.partial(list, v),
                )
                for module, t, v in zip(modules, train_shards, valid_shards, strict=True)
            ],
            optimizer_factory=sgd,
            resume=resume,
            loop=lampdist.LoopOptions(
                max_epochs=MAX_EPOCHS,
                learning_rate_schedule=schedule,
                return_min_validation_loss_model=range(MAX_EPOCHS),
                best_model_monitor=ACCURACY,
                early_stopping=early_stopping,
                checkpoint_state=on_checkpoint,
                on_event=on_event,
            ),
        )
    except lampdist.CheckpointError as exc:
        if not isinstance(exc.__cause__, Stop):
            raise
        return modules, None, saved
    return modules, state, saved


def _stopped_at(values: list[float], patience: int) -> int:
    """The epochs an accuracy-watching, Lightning-style early stop runs."""
    best, wait = -float("inf"), 0
    for epoch, value in enumerate(values):
        best, wait = (value, 0) if value > best else (best, wait + 1)
        if wait >= patience:
            return epoch + 1
    return len(values)


async def test_every_rank_ends_with_the_model_of_the_best_accuracy() -> None:
    snapshots: list[dict[str, torch.Tensor]] = []
    modules, state, _ = await train(snapshots=snapshots)
    assert state is not None and state.epoch == MAX_EPOCHS
    accuracies = [float(p.metrics["validation_accuracy"]) for p in state.learning_curve]  # type: ignore[arg-type]
    losses = [float(p.validation_loss) for p in state.learning_curve]  # type: ignore[arg-type]
    best = accuracies.index(max(accuracies))  # the first of the highest
    assert (state.min_validation_epoch, state.min_validation_loss) == (best, accuracies[best])
    assert best != losses.index(min(losses))  # not lamp's choice here
    for module in modules:
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, snapshots[best][name]), name


async def test_early_stopping_ends_every_rank_after_patience_epochs() -> None:
    rule = lampdist.EarlyStopping(monitor=ACCURACY, patience=2)
    _, uninterrupted, _ = await train()
    assert uninterrupted is not None
    accuracies = [float(p.metrics["validation_accuracy"]) for p in uninterrupted.learning_curve]  # type: ignore[arg-type]
    expected = _stopped_at(accuracies, patience=2)
    assert expected < MAX_EPOCHS  # the run does stop early
    modules, state, saved = await train(early_stopping=rule)
    assert state is not None
    assert state.epoch == expected
    assert state.learning_curve == uninterrupted.learning_curve[:expected]
    assert state.early_stopping is not None and state.early_stopping.wait == 2
    assert [s.loop_state.epoch for s in saved] == list(range(1, expected + 1))
    # every rank stopped cleanly with the best model (the same weights everywhere)
    for module in modules[1:]:
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, modules[0].state_dict()[name]), name


@pytest.mark.parametrize("stop_after", [1, 5, 8])
async def test_an_early_stopping_run_resumes_exactly(tmp_path: Path, stop_after: int) -> None:
    """Interrupted after ``stop_after`` epochs and resumed from its checkpoint on disk, the
    run stops where the uninterrupted one stopped, with the same loop state (metrics, best
    model, early-stopping state and schedule) and the same weights, bitwise."""
    rule = lampdist.EarlyStopping(monitor=ACCURACY, patience=3)
    # halves the learning rate before epochs 7 and 9: resuming after 7 needs its state
    schedule = schedules.reduce_on_plateau(patience=2, threshold=0.05, monitor=ACCURACY)
    whole, whole_state, whole_saved = await train(early_stopping=rule, schedule=schedule)
    assert whole_state is not None and whole_state.epoch == 9  # of MAX_EPOCHS = 10
    _, stopped, _ = await train(
        early_stopping=rule, schedule=schedule, stop_after=stop_after, directory=tmp_path
    )
    assert stopped is None
    resumed = await anyio.to_thread.run_sync(checkpoint.load_latest, tmp_path)
    assert resumed is not None and resumed.epoch == stop_after
    assert resumed.training_state.loop_state == whole_saved[stop_after - 1].loop_state
    modules, state, saved = await train(early_stopping=rule, schedule=schedule, resume=resumed)
    assert state == whole_state
    assert [s.loop_state.epoch for s in saved] == list(range(stop_after + 1, state.epoch + 1))
    for a, b in zip(whole, modules, strict=True):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), name


async def test_a_run_resumed_where_it_stopped_early_trains_no_epoch(tmp_path: Path) -> None:
    rule = lampdist.EarlyStopping(monitor=ACCURACY, patience=2)
    _, state, _ = await train(early_stopping=rule, directory=tmp_path)
    assert state is not None
    resumed = await anyio.to_thread.run_sync(checkpoint.load_latest, tmp_path)
    assert resumed is not None and resumed.epoch == state.epoch
    _, again, saved = await train(early_stopping=rule, resume=resumed)
    assert again == state and saved == []


async def test_a_monitor_of_an_unknown_metric_is_refused_before_training() -> None:
    with pytest.raises(lampdist.ConfigError, match="watches 'validation_acc', which is no metric"):
        await train(
            early_stopping=lampdist.EarlyStopping(monitor=lampdist.Monitor("validation_acc", "max"))
        )


async def _train_without_validation(loop: lampdist.LoopOptions) -> lampdist.LoopState:
    """Two ranks with training batches only."""
    shards = make_shards([[4, 4], [4]], seed=23)
    with anyio.fail_after(30):
        return await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(make_model(seed=rank), mse),
                    train_batches=lambda s=shard: list(s),
                )
                for rank, shard in enumerate(shards)
            ],
            optimizer_factory=sgd,
            loop=loop,
        )


@pytest.mark.parametrize(
    "loop",
    [
        {"return_min_validation_loss_model": range(3)},
        {"learning_rate_schedule": schedules.reduce_on_plateau()},
    ],
    ids=["best-model", "plateau"],
)
async def test_lamps_defaults_without_validation_train_as_lamp_does(loop: dict[str, Any]) -> None:
    """No validation: no best model is kept and no plateau comes (lamp's rules), no error."""
    state = await _train_without_validation(lampdist.LoopOptions(max_epochs=3, **loop))
    assert state.epoch == 3
    assert state.min_validation_loss is None and state.min_validation_epoch is None


@pytest.mark.parametrize(
    "monitor", [lampdist.Monitor(), ACCURACY], ids=["smoothed-loss", "validation-metric"]
)
async def test_early_stopping_on_a_validation_value_without_validation_is_refused(
    monitor: lampdist.Monitor,
) -> None:
    rule = lampdist.EarlyStopping(monitor=monitor)
    with pytest.raises(lampdist.ConfigError, match="no validation_batches"):
        await _train_without_validation(lampdist.LoopOptions(max_epochs=3, early_stopping=rule))
