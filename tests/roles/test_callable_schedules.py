"""Schedules as plain callables: the ranks agree on a lambda by its values (two processes),
each step's learning rate is the base rate times the lambda's factor exactly, a rate
schedule sets the learning rates themselves, and a run with lambda schedules checkpoints and
resumes at the right step, bitwise."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import lampdist
from lampdist import checkpoint, schedules

from .reference import Batch, make_model, make_shards, mse
from .schedule_rank import BASE_LR, EPOCHS, SCHEDULES, STEPS_PER_EPOCH
from .test_tcp_exactness import ROOT_DIR


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# --- two processes over TCP -----------------------------------------------------------------


def _spawn(rank: int, out: Path, port: int, schedule: str) -> subprocess.Popen[str]:
    env = {**os.environ, "LAMPDIST_SECRET": "test-secret", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.roles.schedule_rank", "--rank", str(rank)]
        + ["--port", str(port), "--out", str(out), "--schedule", schedule],
        cwd=ROOT_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run_pair(out: Path, root_schedule: str, follower_schedule: str) -> list[tuple[int, str]]:
    """Both ranks to their end: each one's exit code and stderr."""
    out.mkdir(parents=True, exist_ok=True)
    root = _spawn(0, out, 0, root_schedule)
    follower = None
    try:
        assert root.stdout is not None
        line = root.stdout.readline()
        assert line.startswith("PORT "), line + (root.stderr.read() if root.stderr else "")
        follower = _spawn(1, out, int(line.split()[1]), follower_schedule)
        _, root_err = root.communicate(timeout=90)
        _, follower_err = follower.communicate(timeout=90)
    finally:
        for process in (root, follower):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    return [(root.returncode, root_err), (follower.returncode, follower_err)]


def test_two_processes_with_the_same_lambda_train_and_other_lambdas_are_refused(
    tmp_path: Path,
) -> None:
    """Each process builds its own lambda (another object, its repr another address): the
    same code agrees and trains, every step at the base rate times its factor; a lambda that
    differs from step 700 on, far beyond the first windows, is refused on both ranks with a
    MismatchError naming ``learning_rate_per_step``."""
    same = _run_pair(tmp_path / "same", "warmup", "warmup-again")
    assert [code for code, _ in same] == [0, 0], same
    fn = SCHEDULES["warmup"]
    expected = [BASE_LR * (1.0 * fn(s)) for s in range(STEPS_PER_EPOCH * EPOCHS)]
    for rank in (0, 1):
        assert json.loads((tmp_path / "same" / f"rank{rank}.json").read_text()) == expected

    other = _run_pair(tmp_path / "other", "warmup", "late")
    for code, err in other:
        assert code != 0
        last = err.strip().splitlines()[-1]
        assert "MismatchError" in last and "learning_rate_per_step: factors" in last, err
    assert not (tmp_path / "other" / "rank0.json").exists()


def test_the_agreed_values_tell_schedules_apart_by_what_they_give() -> None:
    def options(schedule: Any, window: int = 4) -> str:
        step = lampdist.StepOptions(steps_per_epoch=window, learning_rate_per_step=schedule)
        return dict(step.agreed_fields())["learning_rate_per_step"]

    warmup = options(schedules.warmup_linear_steps(0, 10))
    assert warmup == options(lambda s: max(0.0, 1.0 + (0.0 - 1.0) * (min(s, 10) / 10)))
    assert warmup.startswith("factors 1.0, 0.9, 0.8, 0.7, ... (sha256 ")
    assert options(lambda s: 1.0) != options(lambda s: 1.0 if s < 3000 else 0.5)  # the spread
    assert options(lambda s: 1.0) != options(schedules.rate(lambda s: 1.0))  # rates, factors
    # a schedule that raises from some step on agrees with its twin, and not with another
    assert options(lambda s: 1 / (s < 1500)) == options(lambda s: 1 / (s < 1500))
    assert options(lambda s: 1 / (s < 1500)) != options(lambda s: 1 / (s < 1400))


# --- in one process: the local loop ---------------------------------------------------------


def _fn(step: int) -> float:
    return min(1.0, (step + 1) / 5) * 0.9 ** (step // 3)


@pytest.fixture
def recorded() -> Iterator[dict[int, list[list[float]]]]:
    """Every optimizer step's learning rates (one per param group), by optimizer."""
    seen: dict[int, list[list[float]]] = {}

    def record(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        seen.setdefault(id(optimizer), []).append([g["lr"] for g in optimizer.param_groups])

    handle = register_optimizer_step_pre_hook(record)
    yield seen
    handle.remove()


BASES = (0.05, 0.02)


def two_groups(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with two param groups of different base rates."""
    first, *rest = list(params)
    return torch.optim.SGD(
        [{"params": [first], "lr": BASES[0]}, {"params": rest, "lr": BASES[1]}], momentum=0.9
    )


def one_group(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=BASES[0])


async def _train(
    step: lampdist.StepOptions,
    *,
    epochs: int,
    factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] = two_groups,
    loop: dict[str, Any] | None = None,
    resume: lampdist.Resumed | None = None,
    initial: torch.nn.Module | None = None,
) -> list[torch.nn.Module]:
    shards: list[list[Batch]] = make_shards([[5, 7, 3], [6, 6]], seed=2)
    modules = [copy.deepcopy(initial or make_model()), make_model(seed=11)]
    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse),
                    train_batches=lambda s=shard: list(s),
                )
                for module, shard in zip(modules, shards, strict=True)
            ],
            optimizer_factory=factory,
            loop=lampdist.LoopOptions(max_epochs=epochs, **(loop or {})),
            step=step,
            resume=resume,
        )
    return modules


@pytest.mark.parametrize("step_on", ["root", "every_rank", "sharded"])
async def test_a_lambda_sets_every_steps_rate_to_the_base_times_its_factor_exactly(
    recorded: dict[int, list[list[float]]], step_on: lampdist._options.StepOn
) -> None:
    """Two param groups keep their own base rates; a lambda epoch schedule multiplies."""
    step = lampdist.StepOptions(steps_per_epoch=3, learning_rate_per_step=_fn, step_on=step_on)
    await _train(step, epochs=3, loop={"learning_rate_schedule": lambda epoch: 0.5**epoch})
    expected = [
        [base * (0.5 ** (s // 3) * _fn(s)) for base in BASES] for s in range(9)
    ]  # the order the step path multiplies in: base * (epoch factor * step factor)
    assert recorded and all(rates == expected for rates in recorded.values()), recorded
    assert len(recorded) == (1 if step_on == "root" else 2)


async def test_a_rate_schedule_sets_the_learning_rates_themselves(
    recorded: dict[int, list[list[float]]],
) -> None:
    def rate(step: int) -> float:
        return 0.01 + 0.003 * step

    step = lampdist.StepOptions(steps_per_epoch=3, learning_rate_per_step=schedules.rate(rate))
    await _train(step, epochs=2, factory=one_group)
    (rates,) = recorded.values()
    assert rates == [[rate(s)] for s in range(6)]

    recorded.clear()
    per_group = schedules.rate(lambda s: (0.01 * (s + 1), 0.002))
    step = lampdist.StepOptions(steps_per_epoch=3, learning_rate_per_step=per_group)
    await _train(step, epochs=2)
    (rates,) = recorded.values()
    assert rates == [[0.01 * (s + 1), 0.002] for s in range(6)]


async def test_one_rate_for_groups_of_different_base_rates_is_refused() -> None:
    step = lampdist.StepOptions(
        steps_per_epoch=3, learning_rate_per_step=schedules.rate(lambda s: 0.01)
    )
    with pytest.raises(lampdist.ConfigError, match=r"learning_rate_per_step: schedules.rate"):
        await _train(step, epochs=1)
    three = lampdist.StepOptions(
        steps_per_epoch=3, learning_rate_per_step=schedules.rate(lambda s: (0.1, 0.2, 0.3))
    )
    with pytest.raises(lampdist.ConfigError, match="3 learning rates for 2 param groups"):
        await _train(three, epochs=1)


async def test_a_run_with_lambda_schedules_resumes_at_the_right_step_bitwise(
    tmp_path: Path, recorded: dict[int, list[list[float]]]
) -> None:
    """A run of 4 windows against one of 2 windows resumed from its checkpoint for 2 more,
    with other lambda objects of the same code: the resumed steps take the rates of steps
    6 to 11, and the weights end bitwise alike. Nothing of a lambda is checkpointed."""

    def options() -> tuple[lampdist.StepOptions, dict[str, Any]]:
        step = lampdist.StepOptions(
            steps_per_epoch=3,
            step_on="every_rank",
            learning_rate_per_step=lambda s: min(1.0, (s + 1) / 5) * 0.9 ** (s // 3),
        )
        return step, {"learning_rate_schedule": lambda epoch: 0.5**epoch}

    initial = make_model()
    step, loop = options()
    whole = await _train(step, epochs=4, loop=loop, initial=initial)
    whole_rates = list(recorded.values())
    recorded.clear()
    step, loop = options()
    loop["checkpoint_state"] = checkpoint.to_directory(tmp_path)
    await _train(step, epochs=2, loop=loop, initial=initial)
    resumed = await anyio.to_thread.run_sync(checkpoint.load_latest, tmp_path)
    assert resumed is not None and resumed.epoch == 2
    assert resumed.schedule_state is None
    recorded.clear()
    step, loop = options()
    again = await _train(step, epochs=4, loop=loop, resume=resumed, initial=make_model(seed=5))
    expected = [[base * (0.5 ** (s // 3) * _fn(s)) for base in BASES] for s in range(6, 12)]
    assert [rates[6:] for rates in whole_rates] == list(recorded.values()) == [expected] * 2
    for a, b in zip(whole, again, strict=True):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), name


def test_a_callable_is_wrapped_and_what_is_none_refused() -> None:
    step = lampdist.StepOptions(steps_per_epoch=2, learning_rate_per_step=_fn)
    assert step.learning_rate_per_step is not None
    assert step.learning_rate_per_step.factor(4) == _fn(4)  # type: ignore[union-attr]  # a factor schedule
    loop = lampdist.LoopOptions(max_epochs=1, learning_rate_schedule=lambda epoch: 0.25)
    assert loop.learning_rate_schedule.learning_rate_factor(None, 3, None) == (None, 0.25)
    with pytest.raises(lampdist.ConfigError, match="learning_rate_per_step must be a function"):
        lampdist.StepOptions(steps_per_epoch=2, learning_rate_per_step=0.5)
    with pytest.raises(lampdist.ConfigError, match="needs steps_per_epoch"):
        lampdist.StepOptions(learning_rate_per_step=_fn)
    with pytest.raises(lampdist.ConfigError, match="rate needs a callable"):
        schedules.rate(0.1)  # type: ignore[arg-type]  # on purpose
