"""A run interrupted after epoch k and resumed from its checkpoint ends exactly like one that
was never interrupted: weights, optimizer, best model, loop state and schedule."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from typing import Any

import pytest
import torch

import lampdist
import lampdist._options
from lampdist import schedules

from .reference import make_model, make_shards, mse


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


class Stop(Exception):
    pass


def _resumed(state: lampdist.TrainingState, lr_state: Any) -> lampdist.Resumed:
    """What load_latest would give for a checkpoint of ``state`` and ``lr_state``."""
    return lampdist.Resumed(training_state=state, schedule_state=schedules.state_to_json(lr_state))


async def train(
    *,
    max_epochs: int,
    stop_after: int | None = None,
    resume: tuple[lampdist.TrainingState, Any] | None = None,
    schedule: schedules.LearningRateSchedule[Any],
    step_on: lampdist._options.StepOn = "root",
    joined: bool = False,
) -> tuple[list[torch.nn.Module], lampdist.LoopState | None, list[tuple[Any, Any]]]:
    """Two ranks train on shards; ``joined``: one rank on the step-wise concatenation of the
    same shards (the same updates, to rounding)."""
    shards = make_shards([[6, 5, 7], [4, 8]], seed=11)
    valid = make_shards([[6], [5]], seed=12)
    if joined:
        shards = [[_join(shards[0][0], shards[1][0]), _join(shards[0][1], shards[1][1])]]
        shards[0].append(make_shards([[6, 5, 7], [4, 8]], seed=11)[0][2])
        valid = [[_join(valid[0][0], valid[1][0])]]
    # A resumed run starts from other weights: only the checkpoint can make it end the same.
    seed = 0 if resume is None else 50
    modules = [make_model(seed=seed), make_model(seed=seed + 3)][: len(shards)]
    saved: list[tuple[Any, Any]] = []

    async def checkpoint(state: lampdist.TrainingState, lr_state: Any) -> None:
        saved.append((copy.deepcopy(state), lr_state))
        if stop_after is not None and state.loop_state.epoch == stop_after:
            raise Stop

    try:
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(m, mse),
                    train_batches=functools.partial(list, s),
                    validation_batches=functools.partial(list, v),
                )
                for m, s, v in zip(modules, shards, valid, strict=True)
            ],
            optimizer_factory=adamw,
            resume=None if resume is None else _resumed(*resume),
            loop=lampdist.LoopOptions(
                max_epochs=max_epochs,
                checkpoint_state=checkpoint,
                learning_rate_schedule=schedule,
                return_min_validation_loss_model=range(max_epochs),
                validation_loss_exponential_smoothing_factor=0.5,
            ),
            step=lampdist.StepOptions(step_on=step_on),
        )
    except lampdist.CheckpointError as exc:
        if not isinstance(exc.__cause__, Stop):
            raise
        return modules, None, saved
    return modules, state, saved


@pytest.mark.parametrize("step_on", ["root", "every_rank", "sharded"])
@pytest.mark.parametrize(
    "schedule",
    [
        schedules.reduce_on_plateau(patience=1, reduce_factor=0.5),
        schedules.decrement(every=2, factor=0.5),
        # diverges after epoch 2, so the best model was saved before the interruption
        schedules.from_epoch_count(lambda epoch: 1.0 if epoch < 2 else 60.0),
    ],
    ids=["reduce_on_plateau", "decrement", "best-model-before-interruption"],
)
async def test_interrupted_and_resumed_equals_uninterrupted(
    schedule: schedules.LearningRateSchedule[Any], step_on: lampdist._options.StepOn
) -> None:
    whole, whole_state, whole_saved = await train(
        schedule=schedule,
        max_epochs=6,
        step_on=step_on,
    )
    _, stopped, partial_saved = await train(
        stop_after=3,
        schedule=schedule,
        max_epochs=6,
        step_on=step_on,
    )
    assert stopped is None
    assert len(partial_saved) == 3
    resumed, resumed_state, resumed_saved = await train(
        resume=partial_saved[-1],
        schedule=schedule,
        max_epochs=6,
        step_on=step_on,
    )
    # It ran epochs 3, 4 and 5 only (each checkpoint holds the next epoch to run).
    assert [state.loop_state.epoch for state, _ in resumed_saved] == [4, 5, 6]
    assert resumed_state == whole_state
    for a, b in zip(whole, resumed, strict=True):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), name
    (want, want_lr), (got, got_lr) = whole_saved[-1], resumed_saved[-1]
    assert got_lr == want_lr
    assert got.loop_state == want.loop_state == whole_state
    assert want.best_model_state is not None
    assert got.best_model_state is not None
    for name, tensor in want.best_model_state.items():
        assert torch.equal(got.best_model_state[name], tensor), name
    want_opt, got_opt = want.optimizer_state["state"], got.optimizer_state["state"]
    assert want_opt.keys() == got_opt.keys()
    for key, entry in want_opt.items():
        for field, value in entry.items():
            assert torch.equal(torch.as_tensor(got_opt[key][field]), torch.as_tensor(value))


def _join(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> Any:
    return torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])


async def test_a_sharded_checkpoint_holds_the_whole_optimizer_state() -> None:
    """The sharded root's checkpoint holds the state of the whole optimizer, in the format
    that the root design writes: the same entries, shapes and values."""
    schedule = schedules.decrement(every=2, factor=0.5)
    _, _, by_root = await train(schedule=schedule, max_epochs=3, step_on="root")
    _, _, sharded = await train(schedule=schedule, max_epochs=3, step_on="sharded")
    want, got = by_root[-1][0].optimizer_state, sharded[-1][0].optimizer_state
    assert got["param_groups"] == want["param_groups"]
    assert want["state"].keys() == got["state"].keys() and len(want["state"]) == 4
    for key, entry in want["state"].items():
        assert entry.keys() == got["state"][key].keys()
        for field, value in entry.items():
            torch.testing.assert_close(
                torch.as_tensor(got["state"][key][field]).to(value.device),
                value,
                rtol=0,
                atol=1e-12,
                msg=f"{key}.{field}",
            )


@pytest.mark.parametrize(
    ("first", "then"),
    [("sharded", "joined"), ("root", "sharded"), ("sharded", "every_rank")],
    ids=["sharded-2-to-1-rank", "root-to-sharded", "sharded-to-every-rank"],
)
async def test_a_checkpoint_resumes_under_another_design_or_number_of_ranks(
    first: lampdist._options.StepOn, then: str
) -> None:
    """A checkpoint is the same whatever wrote it: a run checkpointed by one design resumes
    under another, or on one rank over the same data, and ends where the uninterrupted run
    ends (to rounding: the ranks' sums add in another order)."""
    schedule = schedules.decrement(every=2, factor=0.5)
    whole, whole_state, _ = await train(schedule=schedule, max_epochs=5, step_on=first)
    _, _, partial_saved = await train(stop_after=2, schedule=schedule, max_epochs=5, step_on=first)
    joined = then == "joined"
    resumed, resumed_state, _ = await train(
        resume=partial_saved[-1],
        schedule=schedule,
        max_epochs=5,
        step_on="root" if joined else then,  # type: ignore[arg-type]
        joined=joined,
    )
    assert resumed_state is not None and whole_state is not None
    assert resumed_state.epoch == whole_state.epoch == 5
    for module in resumed:
        for (name, got), want in zip(
            module.state_dict().items(), whole[0].state_dict().values(), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=name)
