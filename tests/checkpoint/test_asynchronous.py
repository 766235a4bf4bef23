"""Asynchronous checkpoints: staged copies, one write in flight, failures reported, nothing
half committed on cancellation, the same checkpoints as synchronous writes."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch

import lampdist
from lampdist import checkpoint
from lampdist._checkpoint._background import background_writes
from lampdist._checkpoint._staging import Staging
from lampdist._checkpoint._storage import DirectoryStorage
from lampdist._checkpoint._tensor_file import SAVED_DEVICE, encode, parse_header

from ..roles.reference import make_model, make_shards, mse
from .test_checkpoint import assert_identical, committed, scratch


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- staging ---------------------------------------------------------------------------------


def test_staged_copies_are_equal_and_independent_of_the_state() -> None:
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = OrderedDict(weight=weight, steps=torch.tensor(7), flags=torch.tensor([True, False]))
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    optimizer: dict[str, Any] = {
        "state": {0: {"exp_avg": weight.t()}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    copy, optimizer_copy, nothing = Staging().stage(state, optimizer, None).finish()
    assert nothing is None
    assert_identical(dict(copy), dict(state))
    assert copy._metadata == {"": {"version": 1}}
    assert torch.equal(optimizer_copy["state"][0]["exp_avg"], weight.t())
    assert optimizer_copy["param_groups"] == optimizer["param_groups"]
    assert optimizer_copy["param_groups"] is not optimizer["param_groups"]
    weight.add_(100)  # training goes on
    optimizer["param_groups"][0]["lr"] = 0.5
    assert copy["weight"][0, 1].item() == 1.0
    assert optimizer_copy["state"][0]["exp_avg"][1, 0].item() == 1.0
    assert optimizer_copy["param_groups"][0]["lr"] == 0.1


def test_a_tensor_held_twice_is_staged_once() -> None:
    shared = torch.ones(5)
    staged = Staging().stage({"a": shared, "b": shared})
    (copy,) = staged.finish()
    assert copy["a"] is copy["b"]
    assert staged.nbytes == 64  # 20 bytes, aligned


def test_the_buffer_is_reused_and_grows_only_when_it_must() -> None:
    staging = Staging()
    first = staging.stage({"w": torch.ones(1000)}).finish()[0]["w"]
    pointer = first.data_ptr()
    second = staging.stage({"w": torch.full((1000,), 2.0)}).finish()[0]["w"]
    assert second.data_ptr() == pointer
    assert staging.host.capacity == 4032
    staging.stage({"w": torch.ones(10)}).finish()
    assert staging.host.capacity == 4032  # smaller states reuse it
    staging.stage({"w": torch.ones(2000)}).finish()
    assert staging.host.capacity == 8000 and not staging.host.pinned


def test_a_staged_copy_records_the_device_of_the_tensor_it_copies() -> None:
    staged = torch.ones(3)
    setattr(staged, SAVED_DEVICE, "cuda:1")  # what staging a tensor of cuda:1 sets
    encoded = encode({"w": staged, "b": torch.zeros(2)})
    assert encoded is not None
    header = parse_header(encoded.head[16:].rstrip(b"\0"), file_size=encoded.size)
    assert [spec.device for spec in header.tensors] == ["cuda:1", "cpu"]


# -- the background writer -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Gated(DirectoryStorage):
    """A real directory checkpoint whose writes wait for ``gate`` first (a slow disk)."""

    gate: threading.Event = attrs.field(factory=threading.Event, eq=False)
    started: threading.Event = attrs.field(factory=threading.Event, eq=False)

    def write(self, training_state: Any, lr_state: Any, rng: Any, check: Any) -> object:
        self.started.set()
        while not self.gate.wait(0.01):
            check()
        return super().write(training_state, lr_state, rng, check)


def _state(epoch: int, value: float) -> lampdist.TrainingState:
    return lampdist.TrainingState(
        loop_state=lampdist.LoopState(epoch=epoch),
        model_state={"w": torch.full((64,), value)},
        optimizer_state={"state": {}, "param_groups": []},
    )


async def _stage_here(function: Any) -> Any:
    return function()


async def _saves(
    target: DirectoryStorage, *states: lampdist.TrainingState, then: Exception | None = None
) -> None:
    """Save ``states`` in one run of ``target``'s background writer, then fail with ``then``."""
    async with background_writes(target) as writer:
        for state in states:
            await writer.save(state, None, stage_on=_stage_here)
        if then is not None:
            raise then


async def test_save_returns_before_the_write_and_the_write_has_the_state_of_the_call(
    tmp_path: Path,
) -> None:
    target = _Gated(directory=tmp_path, keep=3, asynchronous=True, timeout=5.0)
    state = _state(1, 1.0)
    async with background_writes(target) as writer:
        await writer.save(state, None, stage_on=_stage_here)
        assert writer.writing
        assert committed(tmp_path) == []
        state.model_state["w"].fill_(2.0)  # the next steps change the model
        target.gate.set()
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None and loaded.epoch == 1
    assert torch.equal(loaded.training_state.model_state["w"], torch.full((64,), 1.0))
    assert len(writer.blocked) == 1


async def test_a_checkpoint_due_during_a_write_waits_for_it(tmp_path: Path) -> None:
    target = _Gated(directory=tmp_path, keep=3, asynchronous=True, timeout=5.0)
    async with background_writes(target) as writer:
        await writer.save(_state(1, 1.0), None, stage_on=_stage_here)
        with anyio.move_on_after(0.3) as waited:
            await writer.save(_state(2, 2.0), None, stage_on=_stage_here)
        assert waited.cancelled_caught  # it waited for epoch 1's write
        assert committed(tmp_path) == []
        target.gate.set()
        await writer.save(_state(2, 2.0), None, stage_on=_stage_here)
    assert committed(tmp_path) == ["epoch-000001", "epoch-000002"]


async def test_a_write_past_its_timeout_is_aborted_and_named(tmp_path: Path) -> None:
    target = _Gated(directory=tmp_path, keep=3, asynchronous=True, timeout=0.2)
    with pytest.raises(lampdist.CheckpointError) as caught:
        await _saves(target, _state(1, 1.0), _state(2, 2.0))
    assert caught.value.phase == "checkpoint" and caught.value.rank == 0
    assert "epoch 0" in str(caught.value) and "0.2 s" in str(caught.value)
    assert committed(tmp_path) == [] and scratch(tmp_path) == []


async def test_a_failed_write_is_raised_by_the_next_check(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = DirectoryStorage(directory=blocker, keep=3, asynchronous=True)
    async with background_writes(target) as writer:
        await writer.save(_state(1, 1.0), None, stage_on=_stage_here)
        await writer._wait("test")
        with pytest.raises(lampdist.CheckpointError) as caught:
            writer.check()
        assert caught.value.phase == "checkpoint"
        assert "the asynchronous checkpoint of epoch 0" in str(caught.value)
        writer.check()  # reported once


async def test_the_end_raises_a_write_that_failed(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    target = DirectoryStorage(directory=blocker, keep=3, asynchronous=True)
    with pytest.raises(lampdist.CheckpointError, match="asynchronous checkpoint of epoch 0"):
        async with background_writes(target) as writer:
            await writer.save(_state(1, 1.0), None, stage_on=_stage_here)


async def test_a_cancelled_run_aborts_the_write_and_leaves_nothing_half_committed(
    tmp_path: Path,
) -> None:
    target = _Gated(directory=tmp_path, keep=3, asynchronous=True, timeout=5.0)
    async with background_writes(target) as writer:
        await writer.save(_state(1, 1.0), None, stage_on=_stage_here)
        target.gate.set()
    with anyio.CancelScope() as scope:
        gated = _Gated(directory=tmp_path, keep=3, asynchronous=True, timeout=5.0)
        async with background_writes(gated) as writer:
            await writer.save(_state(2, 2.0), None, stage_on=_stage_here)
            await anyio.to_thread.run_sync(gated.started.wait)
            scope.cancel()
            await anyio.sleep_forever()
    assert not writer.writing
    assert committed(tmp_path) == ["epoch-000001"] and scratch(tmp_path) == []
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None and loaded.epoch == 1


async def test_a_run_that_fails_still_commits_the_write_in_flight(tmp_path: Path) -> None:
    target = _Gated(directory=tmp_path, keep=3, asynchronous=True, timeout=5.0)
    target.gate.set()
    with pytest.raises(RuntimeError, match="training failed"):
        await _saves(target, _state(1, 1.0), then=RuntimeError("training failed"))
    assert committed(tmp_path) == ["epoch-000001"]


# -- through a training entry point ----------------------------------------------------------


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05)


async def _train(
    effect: Any, *, epochs: int = 4, trained: list[int] | None = None
) -> list[torch.nn.Module]:
    shards = make_shards([[6, 5, 7], [4, 8]], seed=21)
    modules = [make_model(), make_model(seed=3)]
    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(m, mse), train_batches=functools.partial(list, s)
            )
            for m, s in zip(modules, shards, strict=True)
        ],
        optimizer_factory=adamw,
        loop=lampdist.LoopOptions(
            max_epochs=epochs,
            checkpoint_state=effect,
            on_event=None if trained is None else functools.partial(_record, trained),
        ),
    )
    return modules


async def _record(trained: list[int], event: lampdist.PassEvent) -> None:
    trained.append(event.epoch)


async def test_asynchronous_checkpoints_equal_synchronous_ones_bitwise(tmp_path: Path) -> None:
    synchronous = await _train(checkpoint.to_directory(tmp_path / "sync", keep=10))
    asynchronous = await _train(
        checkpoint.to_directory(tmp_path / "async", keep=10, asynchronous=True)
    )
    assert_identical(asynchronous[0].state_dict(), synchronous[0].state_dict())
    names = committed(tmp_path / "sync")
    assert names == committed(tmp_path / "async") and len(names) == 4
    for name in names:
        for kind in ("model", "optimizer"):
            sync_bytes = (tmp_path / "sync" / name / f"{kind}.tensors").read_bytes()
            async_bytes = (tmp_path / "async" / name / f"{kind}.tensors").read_bytes()
            assert async_bytes == sync_bytes, (name, kind)


@attrs.frozen(kw_only=True)
class _FailsAt(DirectoryStorage):
    """A real directory checkpoint whose disk fails at one epoch's write."""

    epoch: int

    def write(self, training_state: Any, lr_state: Any, rng: Any, check: Any) -> object:
        if training_state.loop_state.epoch == self.epoch:
            raise lampdist.CheckpointError("no space left on device", phase="checkpoint")
        return super().write(training_state, lr_state, rng, check)


async def test_a_failed_write_ends_the_run_by_the_next_epoch_boundary(tmp_path: Path) -> None:
    effect = _FailsAt(directory=tmp_path, keep=10, asynchronous=True, epoch=2)
    trained: list[int] = []
    with pytest.raises(lampdist.CheckpointError) as caught:
        await _train(effect, epochs=6, trained=trained)
    assert caught.value.phase == "checkpoint" and caught.value.rank == 0
    assert "asynchronous checkpoint of epoch 1" in str(caught.value)
    assert "no space left on device" in str(caught.value)
    # epoch 1's write failed beside epoch 2's training: no epoch after 2 trains (here the
    # failure is at once, so epoch 2 does not start either)
    assert max(trained) in (1, 2)
    assert committed(tmp_path) == ["epoch-000001"] and scratch(tmp_path) == []


async def test_the_run_returns_after_its_last_checkpoint_is_committed(tmp_path: Path) -> None:
    modules = await _train(checkpoint.to_directory(tmp_path, keep=2, asynchronous=True))
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None and loaded.epoch == 4
    assert_identical(dict(loaded.training_state.model_state), dict(modules[0].state_dict()))


@pytest.mark.parametrize("bad", [{"timeout": 0}, {"timeout": float("inf")}, {"asynchronous": 1}])
def test_bad_options_are_refused(tmp_path: Path, bad: dict[str, Any]) -> None:
    with pytest.raises(lampdist.ConfigError):
        checkpoint.to_directory(tmp_path, **bad)
