"""The run's state component in pieces, without a root: what a rank's own state is and how
it is stored, where the state goes (the storages and the one place that chooses them), when
it is saved (the save rule), what recovery keeps in memory, and a recovery as an event of
its own."""

from __future__ import annotations

import math
import random
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import lampdist
from lampdist import checkpoint
from lampdist._checkpoint import DirectoryStorage, EffectStorage, UrlStorage, storage_for
from lampdist._epoch import RankState
from lampdist._epoch._stream import StreamPosition
from lampdist._roles._run_state import MemoryStorage, SaveRule
from lampdist._state import as_pass_event

pytestmark = pytest.mark.anyio


# -- what: a rank's own state ------------------------------------------------------------------


def test_a_rank_state_comes_back_from_its_stored_form_and_restores_the_rng() -> None:
    position = StreamPosition(data_pass=2, batches=5)
    state = RankState.capture(position)
    drawn = torch.rand(3), random.random()
    back = RankState.from_plain(state.to_plain())
    assert back.position == position
    torch.rand(7), random.random()  # the generators move on
    back.restore_rng()
    assert torch.equal(torch.rand(3), drawn[0]) and random.random() == drawn[1]


def test_a_rank_state_without_a_place_in_its_data_stores_none() -> None:
    stored = RankState.capture(None).to_plain()
    assert stored["position"] is None
    assert RankState.from_plain(stored).position is None


# -- where: the storages -------------------------------------------------------------------------


async def _effect(training_state: lampdist.TrainingState, lr_state: Any, /) -> None:
    return


def test_the_storage_of_an_effect_is_chosen_in_one_place(tmp_path: Path) -> None:
    directory = checkpoint.to_directory(tmp_path)
    url = checkpoint.to_url("s3://bucket/run")
    assert isinstance(directory, DirectoryStorage) and storage_for(directory) == directory
    assert isinstance(url, UrlStorage) and storage_for(url) == url
    own = storage_for(_effect)
    assert isinstance(own, EffectStorage) and own.effect is _effect
    assert directory.holds_shards and url.holds_shards and not own.holds_shards


async def test_an_effect_of_the_callers_own_is_awaited_with_the_state() -> None:
    saved: list[tuple[int, Any]] = []

    async def effect(training_state: lampdist.TrainingState, lr_state: Any, /) -> None:
        saved.append((training_state.loop_state.epoch, lr_state))

    storage = storage_for(effect)
    await storage.check_before_training(3, resumed=True)  # the caller's own: nothing checked
    state = lampdist.TrainingState(
        loop_state=lampdist.LoopState(epoch=4), model_state={}, optimizer_state={}
    )
    async with storage.opened() as saver:
        await saver.save(state, "lr", stage_on=_here)
        saver.check()
        await saver.finish()
    assert saved == [(4, "lr")]


async def _here(function: Any) -> Any:
    return function()


async def test_a_directory_storage_refuses_a_new_run_where_checkpoints_are(tmp_path: Path) -> None:
    storage = storage_for(checkpoint.to_directory(tmp_path))
    state = lampdist.TrainingState(
        loop_state=lampdist.LoopState(epoch=1),
        model_state={"w": torch.ones(2)},
        optimizer_state={"state": {}, "param_groups": []},
    )
    async with storage.opened() as saver:
        await saver.save(state, None, stage_on=_here)
    assert (tmp_path / "epoch-000001").is_dir()
    with pytest.raises(lampdist.CheckpointError):
        await storage.check_before_training(0, resumed=False)
    await storage.check_before_training(1, resumed=True)


# -- recovery's memory ---------------------------------------------------------------------------


def _captured(value: float) -> lampdist.TrainingState:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        model.weight.fill_(value)
    return lampdist.TrainingState(
        loop_state=lampdist.LoopState(epoch=5),
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        best_model_state={"weight": torch.zeros(1, 2)},
        rank_states=(RankState.capture(None).to_plain(),),
    )


async def test_memory_keeps_copies_and_hands_out_fresh_ones() -> None:
    memory = MemoryStorage()
    state = _captured(1.0)
    async with memory.opened() as saver:
        await saver.save(state, None, stage_on=_here)
    state.model_state["weight"].fill_(9.0)  # training goes on in place
    state.optimizer_state["state"][0]["momentum_buffer"].fill_(9.0)
    first = memory.latest()
    kept = first.training_state
    assert torch.equal(kept.model_state["weight"], torch.ones(1, 2))
    assert not torch.equal(
        kept.optimizer_state["state"][0]["momentum_buffer"], torch.full((1, 2), 9.0)
    )
    # no loop state and no best model: a recovery goes back to the ranks' state only
    assert kept.loop_state == lampdist.LoopState() and kept.best_model_state is None
    assert first.rng_states is not None  # the root's, from its rank state
    kept.model_state["weight"].fill_(7.0)  # what a load aliases and the optimizer steps
    assert torch.equal(memory.latest().training_state.model_state["weight"], torch.ones(1, 2))


# -- when: the save rule -------------------------------------------------------------------------


def test_without_an_interval_every_epoch_is_saved() -> None:
    rule = SaveRule(interval=None, max_epochs=10, stop_requested=lambda: False)
    assert rule.due(lampdist.LoopState(epoch=1))


def test_an_interval_saves_once_its_time_has_passed_and_always_the_last_epoch_and_a_stop() -> None:
    stop = [False]
    rule = SaveRule(interval=3600.0, max_epochs=10, stop_requested=lambda: stop[0])
    rule.restart()
    assert not rule.due(lampdist.LoopState(epoch=1))
    assert rule.due(lampdist.LoopState(epoch=10))  # the last epoch
    stop[0] = True
    assert rule.due(lampdist.LoopState(epoch=2))  # a stop
    stop[0] = False
    rule.last = time.monotonic() - 3601.0
    assert rule.due(lampdist.LoopState(epoch=2))


# -- a recovery, its own event -------------------------------------------------------------------


def _recovered() -> lampdist.Recovered:
    return lampdist.Recovered(
        ranks=(2,),
        phase="valid",
        epoch=3,
        pass_index=7,
        seconds=1.5,
        rejoin_seconds=1.0,
        recoveries=1,
        reason="rank 2: gone",
    )


def test_a_recovery_read_as_the_pass_event_it_used_to_be_is_warned() -> None:
    event = _recovered()
    with pytest.warns(DeprecationWarning, match="isinstance"):
        assert event.kind == "valid"
    with pytest.warns(DeprecationWarning, match="event of its own"):
        assert event.recovered is event
    with pytest.warns(DeprecationWarning, match="event of its own"):
        assert event.step == 0 and math.isnan(event.loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert event.ranks == (2,)  # its own fields: no warning
        with pytest.raises(AttributeError):
            event.no_such_field  # noqa: B018  # the point of the test
    plain = as_pass_event(event)
    assert plain.recovered is event and plain.pass_index == 7 and plain.seconds == 1.5


async def test_a_tracker_records_a_recovery_as_it_always_did(tmp_path: Path) -> None:
    """Given the event of its own, a tracker writes what it wrote for the PassEvent that
    carried it, and reads none of the deprecated fields."""
    events: list[lampdist.PassEvent | lampdist.Recovered] = [
        _recovered(),
        as_pass_event(_recovered()),
    ]
    for index, event in enumerate(events):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            async with lampdist.trackers.JsonLinesTracker(tmp_path / f"{index}.jsonl") as tracker:
                await tracker(event)
    assert (tmp_path / "0.jsonl").read_text() == (tmp_path / "1.jsonl").read_text()
    assert '"kind": "valid", "pass_index": 7, "step": 0' in (tmp_path / "0.jsonl").read_text()


# -- a design answers for what it can keep ---------------------------------------------------


async def _own_effect(training_state: lampdist.TrainingState, lr_state: Any, /) -> None:
    return


@pytest.mark.parametrize(
    ("loop", "refused"),
    [
        (
            lampdist.LoopOptions(max_epochs=1, return_min_validation_loss_model=(0,)),
            "return_min_validation_loss_model",
        ),
        (
            lampdist.LoopOptions(max_epochs=1, checkpoint_state=_own_effect),
            r"checkpoint_state other than checkpoint.to_directory",
        ),
    ],
    ids=["best-model", "own-checkpoint-effect"],
)
async def test_a_sharding_design_refuses_what_its_root_cannot_keep(
    loop: lampdist.LoopOptions, refused: str
) -> None:
    """fsdp's root holds no whole model (no best model) and its ranks write their own shards
    (a storage that holds them): refused before anything runs, naming rank 0 and the phase."""
    root, _ = lampdist.control.local_channels(2)
    model = lampdist.SupervisedModel(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss)
    with anyio.fail_after(10), pytest.raises(lampdist.ConfigError, match=refused) as caught:
        await lampdist.drive_distributed_training(
            nranks=2,
            device="cpu",
            control=root,
            data=lampdist.ModelWithData(model=model, train_batches=list),
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1),
            loop=loop,
            step=lampdist.StepOptions(step_on="fsdp"),
        )
    assert caught.value.rank == 0 and caught.value.phase == "configure"
