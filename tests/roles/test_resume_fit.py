"""A checkpoint of another model or optimizer fails on the root before any rank trains, with a
CheckpointError naming the checkpoint and what differs; checkpoints move freely between
compiled and eager runs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import pytest
import torch

import lampdist
import lampdist._options
from lampdist import checkpoint

from .reference import Batch, make_model, make_shards, mse

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def two_groups(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    first, *rest = list(params)
    return torch.optim.AdamW([{"params": [first]}, {"params": rest}], lr=0.05)


def compiled(module: torch.nn.Module) -> torch.nn.Module:
    # backend="eager": dynamo traces the module, no code generation (fast on the CPU).
    return torch.compile(module, backend="eager")  # type: ignore[return-value]  # a wrapper


def wider(seed: int = 0) -> torch.nn.Module:
    return make_model(seed=seed, width=7)


def longer(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1), torch.nn.Linear(1, 1)
    ).double()


async def train(
    directory: Path,
    modules: Sequence[torch.nn.Module],
    *,
    max_epochs: int,
    resume: lampdist.Resumed | None = None,
    optimizer_factory: OptimizerFactory = adamw,
    step_on: lampdist._options.StepOn = "root",
    started: list[int] | None = None,
) -> lampdist.LoopState:
    """Two ranks, a checkpoint per epoch into ``directory``; ``started`` gets the rank of
    every training pass begun."""
    shards = make_shards([[6, 5], [4, 8]], seed=31)
    valid = make_shards([[6], [5]], seed=32)
    begun = started if started is not None else []

    def batches(rank: int, shard: list[Batch]) -> list[Batch]:
        begun.append(rank)
        return list(shard)

    return await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, mse),
                train_batches=functools.partial(batches, rank, shard),
                validation_batches=functools.partial(list, checks),
            )
            for rank, (module, shard, checks) in enumerate(zip(modules, shards, valid, strict=True))
        ],
        optimizer_factory=optimizer_factory,
        resume=resume,
        loop=lampdist.LoopOptions(
            max_epochs=max_epochs,
            checkpoint_state=checkpoint.to_directory(directory),
            return_min_validation_loss_model=range(max_epochs),
        ),
        step=lampdist.StepOptions(step_on=step_on),
    )


async def written(
    directory: Path,
    make: Callable[[int], torch.nn.Module] = make_model,
    optimizer_factory: OptimizerFactory = adamw,
) -> lampdist.Resumed:
    """The checkpoint of two epochs of two ranks of ``make``'s model."""
    await train(directory, [make(0), make(3)], max_epochs=2, optimizer_factory=optimizer_factory)
    resumed = checkpoint.load_latest(directory)
    assert resumed is not None
    assert resumed.training_state.best_model_state is not None
    return resumed


async def refused(
    directory: Path,
    resumed: lampdist.Resumed,
    make: Callable[[int], torch.nn.Module] = make_model,
    *,
    optimizer_factory: OptimizerFactory = adamw,
    step_on: lampdist._options.StepOn = "root",
) -> lampdist.CheckpointError:
    """The error of resuming ``resumed`` with ``make``'s model, which must come before any
    rank began a pass."""
    started: list[int] = []
    with pytest.raises(lampdist.CheckpointError) as caught:
        await train(
            directory,
            [make(50), make(53)],
            max_epochs=4,
            resume=resumed,
            optimizer_factory=optimizer_factory,
            step_on=step_on,
            started=started,
        )
    assert started == []
    error = caught.value
    assert (error.rank, error.phase) == (0, "resume")
    assert str(resumed.path) in str(error)
    assert "that wrote it, or start a new run in another directory" in str(error)
    return error


async def test_a_checkpoint_of_another_layer_size_fails_before_training(tmp_path: Path) -> None:
    resumed = await written(tmp_path, wider)
    message = str(await refused(tmp_path, resumed))
    assert "the model state in checkpoint" in message
    assert "resume with the model that wrote it" in message
    assert "parameter '0.weight': shape (7, 3) in the checkpoint, (6, 3) in the model" in message
    assert "parameter '0.bias': shape (7,) in the checkpoint, (6,) in the model" in message
    assert "parameter '2.weight': shape (1, 7) in the checkpoint, (1, 6) in the model" in message


async def test_missing_and_unexpected_keys_are_named(tmp_path: Path) -> None:
    resumed = await written(tmp_path / "short")
    missing = str(await refused(tmp_path / "short", resumed, longer))
    assert "parameter '3.weight': in the model, not in the checkpoint" in missing
    assert "parameter '3.bias': in the model, not in the checkpoint" in missing
    resumed = await written(tmp_path / "long", longer)
    unexpected = str(await refused(tmp_path / "long", resumed))
    assert "'3.weight' (shape (1, 1)): in the checkpoint, not in the model" in unexpected
    assert "'3.bias' (shape (1,)): in the checkpoint, not in the model" in unexpected


async def test_a_best_model_of_another_model_fails_before_training(tmp_path: Path) -> None:
    resumed = await written(tmp_path)
    other = await written(tmp_path / "wide", wider)
    assert other.training_state.best_model_state is not None
    mixed = attrs.evolve(
        resumed,
        training_state=attrs.evolve(
            resumed.training_state, best_model_state=other.training_state.best_model_state
        ),
    )
    message = str(await refused(tmp_path, mixed))
    assert "the best-model state in checkpoint" in message
    assert "parameter '0.weight': shape (7, 3) in the checkpoint, (6, 3) in the model" in message


@pytest.mark.parametrize("step_on", ["root", "sharded"])
async def test_an_optimizer_state_of_another_optimizer_fails_before_training(
    tmp_path: Path, step_on: lampdist._options.StepOn
) -> None:
    resumed = await written(tmp_path / "adamw")
    # AdamW's groups have no momentum: SGD would load them and fail at its first step.
    message = str(
        await refused(tmp_path / "adamw", resumed, optimizer_factory=sgd, step_on=step_on)
    )
    assert "the optimizer state in checkpoint" in message
    assert "resume with the optimizer that wrote it" in message
    assert "lack 'dampening', 'momentum', which this run's SGD has" in message
    resumed = await written(tmp_path / "sgd", optimizer_factory=sgd)
    # SGD's state has no step count: torch's AdamW refuses it with a KeyError.
    message = str(await refused(tmp_path / "sgd", resumed, step_on=step_on))
    assert "the optimizer state in checkpoint" in message


async def test_an_optimizer_state_of_other_parameter_groups_fails_before_training(
    tmp_path: Path,
) -> None:
    resumed = await written(tmp_path)
    message = str(await refused(tmp_path, resumed, optimizer_factory=two_groups))
    assert "it holds parameter groups of [4] parameters, this run's AdamW groups of [1, 3]" in (
        message
    )


def assert_equal(modules: Sequence[torch.nn.Module], others: Sequence[torch.nn.Module]) -> None:
    """Bitwise the same state dicts, key by key."""
    for module, other in zip(modules, others, strict=True):
        theirs = other.state_dict()
        assert list(module.state_dict()) == list(theirs)
        for name, value in module.state_dict().items():
            assert torch.equal(value, theirs[name]), name


def keys(state: object) -> list[str]:
    assert isinstance(state, dict)
    return list(state)


@pytest.mark.parametrize(
    ("first", "then"),
    [(compiled, lambda module: module), (lambda module: module, compiled)],
    ids=["compiled-then-eager", "eager-then-compiled"],
)
async def test_checkpoints_move_between_compiled_and_eager_runs(
    tmp_path: Path,
    first: Callable[[torch.nn.Module], torch.nn.Module],
    then: Callable[[torch.nn.Module], torch.nn.Module],
) -> None:
    eager = [make_model(0), make_model(3)]
    await train(tmp_path / "whole", eager, max_epochs=3)
    await train(tmp_path / "split", [first(make_model(0)), first(make_model(3))], max_epochs=2)
    resumed = checkpoint.load_latest(tmp_path / "split")
    assert resumed is not None
    state = resumed.training_state
    assert keys(state.model_state) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert keys(state.best_model_state) == keys(state.model_state)
    # Another start: only the checkpoint can make the resumed run end like the whole one.
    later = [make_model(50), make_model(53)]
    await train(tmp_path / "split", [then(later[0]), then(later[1])], max_epochs=3, resume=resumed)
    assert_equal(eager, later)


async def test_a_compiled_root_and_an_eager_follower_agree(tmp_path: Path) -> None:
    eager = [make_model(0), make_model(3)]
    await train(tmp_path / "eager", eager, max_epochs=2)
    mixed = [make_model(0), make_model(3)]
    await train(tmp_path / "mixed", [compiled(mixed[0]), mixed[1]], max_epochs=2)
    assert_equal(eager, mixed)


async def test_keys_a_compiled_module_wrote_load_into_an_eager_one(tmp_path: Path) -> None:
    resumed = await written(tmp_path)
    # A second copy: a run trains the optimizer state it resumed from in place.
    again = checkpoint.load_latest(tmp_path)
    assert again is not None
    state = again.training_state
    assert state.best_model_state is not None
    prefixed = attrs.evolve(
        again,
        training_state=attrs.evolve(
            state,
            model_state={f"_orig_mod.{k}": v for k, v in state.model_state.items()},
            best_model_state={f"_orig_mod.{k}": v for k, v in state.best_model_state.items()},
        ),
    )
    plain, old = [make_model(50), make_model(53)], [make_model(50), make_model(53)]
    await train(tmp_path / "plain", plain, max_epochs=3, resume=resumed)
    await train(tmp_path / "old", old, max_epochs=3, resume=prefixed)
    assert_equal(plain, old)
