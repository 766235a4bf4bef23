"""lampdist.checkpoint: round trips, atomicity under SIGKILL and cancellation, damage, versions."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import random
import selectors
import signal
import struct
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import pytest
import torch

import lampdist
from lampdist import CurvePoint, LoopState, TrainingState, checkpoint, schedules
from lampdist._checkpoint import ShardedState, _torch_io
from lampdist._checkpoint._files import HashingWriter, hash_file, write_file
from lampdist._checkpoint._format import BLOCK_BYTES
from lampdist._checkpoint._rng import capture_rng_states, restore_rng_states
from lampdist._checkpoint._write import write_checkpoint

from .checkpoint_writer import expected_state, seed_everything

# ---------------------------------------------------------------------------------------------
# helpers


def assert_identical(actual: Any, expected: Any, where: str = "state") -> None:
    """Equal values of equal types; tensors bitwise equal with equal dtype and shape."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{where}: dtype"
        assert actual.shape == expected.shape, f"{where}: shape"
        assert actual.device == expected.device, f"{where}: device"
        a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
        e = expected.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, e), f"{where}: tensor bits differ"
    elif isinstance(expected, Mapping):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}[{key!r}]")
        assert getattr(actual, "_metadata", None) == getattr(expected, "_metadata", None)
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{where}: length"
        for index, (a_item, e_item) in enumerate(zip(actual, expected, strict=True)):
            assert_identical(a_item, e_item, f"{where}[{index}]")
    elif attrs.has(type(expected)):
        for field in attrs.fields(type(expected)):
            assert_identical(
                getattr(actual, field.name), getattr(expected, field.name), f"{where}.{field.name}"
            )
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def trained(optimizer_name: str, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )
    optimizer: torch.optim.Optimizer
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 5)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def curve(epochs: int) -> tuple[CurvePoint, ...]:
    return tuple(
        CurvePoint(
            epoch=i,
            training_loss=1 / (i + 3),
            validation_loss=None if i % 2 else 0.1 * i + 1e-17,
            smoothed_validation_loss=None if i % 2 else 0.2 / 3 * i,
        )
        for i in range(epochs)
    )


def small_state(epoch: int) -> TrainingState:
    return expected_state(epoch)[0]


def committed(directory: Path) -> list[str]:
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("epoch-"))


def scratch(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp-"))


@attrs.frozen(kw_only=True)
class _Inner:
    count: int
    best: float | None = None


@attrs.frozen(kw_only=True)
class _ScheduleState:
    factor: float
    inner: _Inner
    maybe: _Inner | None = None
    history: tuple[float, ...] = ()


@attrs.frozen(kw_only=True)
class _Schedule:
    init: Any

    def learning_rate_factor(
        self, state: Any, epoch: int, last_validation_loss: float | None
    ) -> tuple[Any, float]:
        return state, 1.0


SCHEDULE = _Schedule(init=_ScheduleState(factor=1.0, inner=_Inner(count=0)))


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
async def test_round_trip_restores_every_field_exactly(tmp_path: Path, optimizer_name: str) -> None:
    model, optimizer = trained(optimizer_name)
    best = copy.deepcopy(model.state_dict())
    loop_state = LoopState(
        epoch=7,
        last_validation_loss=0.123456789012345,
        min_validation_loss=0.1,
        min_validation_epoch=4,
        learning_curve=curve(7),
    )
    state = TrainingState(
        loop_state=loop_state,
        model_state=model.state_dict(),
        optimizer_state=optimizer.state_dict(),
        best_model_state=best,
    )
    lr_state = _ScheduleState(
        factor=0.3, inner=_Inner(count=3, best=2.5), maybe=_Inner(count=1), history=(0.5, 0.25)
    )
    await checkpoint.to_directory(tmp_path)(state, lr_state)

    loaded = checkpoint.load_latest(tmp_path)

    assert loaded is not None
    loaded_state = loaded.training_state
    loaded_lr = schedules.state_from_json(SCHEDULE, loaded.schedule_state)
    assert_identical(loaded_state, state)
    assert loaded_state == attrs.evolve(
        state,
        model_state=loaded_state.model_state,
        optimizer_state=loaded_state.optimizer_state,
        best_model_state=loaded_state.best_model_state,
    )
    assert_identical(loaded_lr, lr_state)
    # the optimizer resumes exactly: one more step from either copy gives the same weights
    twin, twin_optimizer = trained(optimizer_name, steps=0)
    twin.load_state_dict(loaded_state.model_state)
    twin_optimizer.load_state_dict(dict(loaded_state.optimizer_state))
    batch = torch.randn(8, 5)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        o.zero_grad()
        m(batch).pow(2).mean().backward()
        o.step()
    assert_identical(twin.state_dict(), model.state_dict())


async def test_round_trip_without_best_model_and_with_plain_schedule_states(tmp_path: Path) -> None:
    state = TrainingState(
        loop_state=LoopState(),
        model_state=OrderedDict(
            b=torch.tensor([True, False]),
            i8=torch.arange(-3, 3, dtype=torch.int8),
            bf=torch.randn(2, 3).to(torch.bfloat16),
            t=torch.randn(3, 2).t(),  # not contiguous
            z=torch.zeros(0, 4),
            s=torch.tensor(-0.0),
            n=torch.tensor([float("nan"), float("inf")]),
        ),
        optimizer_state={"state": {}, "param_groups": []},
    )
    save = checkpoint.to_directory(tmp_path / "deeper" / "dir")
    for lr_state in (None, 0.25, 3):
        await save(state, lr_state)
        loaded = checkpoint.load_latest(tmp_path / "deeper" / "dir")
        assert loaded is not None
        assert_identical(loaded.training_state, state)
        assert_identical(loaded.schedule_state, lr_state)


@pytest.mark.parametrize("kind", ["tensors", "torch.save", "torch.save with CRCs"])
async def test_files_larger_than_a_block_are_checked_block_by_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    big = torch.arange(5 << 20, dtype=torch.float32)  # 20 MiB: two blocks and a bit
    model_state: dict[str, Any] = {"big": big, "small": torch.ones(3)}
    filename = "model.tensors"
    if kind != "tensors":  # a python complex is outside the tensor file: torch.save it is
        model_state["c"] = 1 + 2j
        filename = "model.pt"
    if kind == "torch.save with CRCs":  # the fallback for a torch whose _save changed
        monkeypatch.setattr(_torch_io, "_CRC_FREE_SAVE", False)
    state = attrs.evolve(small_state(2), model_state=model_state)
    save = checkpoint.to_directory(tmp_path)
    await save(small_state(1), None)
    await save(state, None)
    manifest = json.loads((tmp_path / "epoch-000002" / "manifest.json").read_text())
    assert sorted(manifest["files"]["files"])[1:3] == sorted([filename, "optimizer.tensors"])
    assert len(manifest["files"]["files"][filename]["blocks"]) == 2
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None
    assert_identical(loaded.training_state, state)
    model_file = tmp_path / "epoch-000002" / filename
    data = bytearray(model_file.read_bytes())
    data[BLOCK_BYTES + 12345] ^= 0x10  # in the second block only
    model_file.write_bytes(bytes(data))
    assert _loaded_epoch(tmp_path) == 1


def test_block_checksums_are_right_when_hashing_lags_behind_writing(tmp_path: Path) -> None:
    data = os.urandom(5 * BLOCK_BYTES + 1000)
    path = tmp_path / "blob"

    def produce(writer: HashingWriter) -> None:
        # Keep the only hashing thread busy until every byte is written, so that all the
        # block hashes are still queued when the write loop ends.
        def written() -> None:  # every whole block is on disk (the tail may be buffered)
            for _ in range(10_000):
                if os.stat(path).st_size >= 5 * BLOCK_BYTES:
                    return
                threading.Event().wait(0.001)
            raise AssertionError("the writer did not get to write every block")

        blocker = pool.submit(written)
        writer.write(b"head")
        writer.write(data)
        blocker.result()

    with ThreadPoolExecutor(1) as pool:
        record = write_file(path, produce, check=lambda: None, pool=pool, algorithm="sha256")
    content = b"head" + data
    expected = tuple(
        hashlib.sha256(content[start : start + BLOCK_BYTES]).hexdigest()
        for start in range(0, len(content), BLOCK_BYTES)
    )
    assert record.size == len(content)
    assert record.digests == expected
    assert hash_file(path, "sha256") == (len(content), expected)


async def test_an_attrs_schedule_state_is_stored_as_json(tmp_path: Path) -> None:
    lr_state = _ScheduleState(factor=0.5, inner=_Inner(count=2))
    await checkpoint.to_directory(tmp_path)(small_state(1), lr_state)
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None
    assert loaded.schedule_state == {
        "factor": 0.5,
        "inner": {"count": 2, "best": None},
        "maybe": None,
        "history": [],
    }


async def test_a_schedule_state_that_is_not_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(lampdist.CheckpointError, match="schedule state"):
        await checkpoint.to_directory(tmp_path)(small_state(1), object())
    assert committed(tmp_path) == []


async def test_values_that_would_need_code_to_load_are_refused(tmp_path: Path) -> None:
    await checkpoint.to_directory(tmp_path)(small_state(1), None)
    state = attrs.evolve(
        small_state(2), optimizer_state={"state": {}, "param_groups": [{"fn": _Inner(count=1)}]}
    )
    with pytest.raises(lampdist.CheckpointError, match=r"optimizer_state\['param_groups'\]\[0\]"):
        await checkpoint.to_directory(tmp_path)(state, None)
    with pytest.raises(lampdist.CheckpointError, match="numbers"):
        await checkpoint.to_directory(tmp_path)(small_state(2), object())
    assert committed(tmp_path) == ["epoch-000001"]
    assert scratch(tmp_path) == []


async def test_rng_states_come_back_on_request(tmp_path: Path) -> None:
    saved = capture_rng_states()
    try:
        seed_everything(11)
        await checkpoint.to_directory(tmp_path)(small_state(1), None)
        after_save = (torch.rand(3), random.random(), np.random.rand())
        seed_everything(99)
        plain = checkpoint.load_latest(tmp_path)
        assert plain is not None and plain.rng_states is None
        loaded = checkpoint.load_latest(tmp_path, restore_rng=True)
        assert loaded is not None and loaded.rng_states is not None
        assert torch.rand(3)[0] != after_save[0][0]  # loading restores nothing by itself
        restore_rng_states(loaded.rng_states)  # what a resumed run does on the root
        resumed = (torch.rand(3), random.random(), np.random.rand())
        assert_identical(resumed[0], after_save[0])
        assert resumed[1:] == after_save[1:]
    finally:
        torch.set_rng_state(saved.torch_cpu)
        random.setstate(saved.python)
        np.random.set_state(saved.numpy)


def test_a_resumed_checkpoint_prints_what_it_holds_not_its_values() -> None:
    rng = capture_rng_states()
    rank_state = {"position": None, "rng_tensors": {"torch_cpu": rng.torch_cpu}}
    model = {"weight": torch.zeros(250, 1000), "bias": torch.zeros(1000)}  # 1.004 MB
    resumed = checkpoint.Resumed(
        training_state=TrainingState(
            loop_state=LoopState(epoch=3),
            model_state=model,
            optimizer_state={
                "state": {0: {"momentum_buffer": torch.zeros(3)}, 1: {"step": torch.tensor(2.0)}},
                "param_groups": [{"lr": 0.1, "params": [0, 1]}],
            },
            best_model_state=model,
            rank_states=(rank_state, rank_state),
        ),
        schedule_state={"count": 3, "history": list(range(100))},
        rng_states=rng,
        path="runs/a/epoch-000003",
    )
    assert repr(resumed) == (
        "Resumed(path='runs/a/epoch-000003', epoch=3, model=2 tensors (1.0 MB), "
        "optimizer=2 tensors (16 B), best_model=2 tensors (1.0 MB), rank_states=for 2 ranks, "
        "rng_states=yes, schedule_state={'count': 3, 'history': [0, 1, 2, 3, 4, 5, 6, 7, 8, "
        "9, 10...)"
    )
    assert str(resumed) == repr(resumed)

    sharded = attrs.evolve(
        resumed.training_state,
        model_state={},
        optimizer_state={},
        best_model_state=None,
        rank_states=None,
        shards=ShardedState(path="runs/a/epoch-000003/shards", nranks=1),
    )
    plain = attrs.evolve(resumed, training_state=sharded, rng_states=None, schedule_state=None)
    assert repr(plain) == (
        "Resumed(path='runs/a/epoch-000003', epoch=3, shards=from 1 rank, rng_states=None, "
        "schedule_state=None)"
    )


# ---------------------------------------------------------------------------------------------
# the directory: retention, ordering, leftovers


async def test_keeps_the_newest_and_rewrites_of_an_epoch_supersede(tmp_path: Path) -> None:
    save = checkpoint.to_directory(tmp_path, keep=2)
    for epoch in range(1, 6):
        await save(small_state(epoch), None)
    assert committed(tmp_path) == ["epoch-000004", "epoch-000005"]
    rewritten = attrs.evolve(small_state(5), model_state={"w": torch.ones(2)})
    await save(rewritten, None)
    assert committed(tmp_path) == ["epoch-000004", "epoch-000005.1"]
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None
    assert_identical(loaded.training_state, rewritten)
    with pytest.raises(lampdist.CheckpointError, match="newer than the epoch 3"):
        await save(small_state(3), None)
    assert committed(tmp_path) == ["epoch-000004", "epoch-000005.1"]
    assert scratch(tmp_path) == []


async def test_a_negative_epoch_is_refused(tmp_path: Path) -> None:
    state = attrs.evolve(small_state(1), loop_state=LoopState(epoch=-1))
    with pytest.raises(lampdist.CheckpointError, match="negative"):
        await checkpoint.to_directory(tmp_path)(state, None)


def test_keep_must_be_positive() -> None:
    for keep in (0, -1, True):
        with pytest.raises(lampdist.ConfigError, match="keep"):
            checkpoint.to_directory("unused", keep=keep)


async def test_no_checkpoint_gives_none_and_leftovers_are_cleaned_up(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path / "missing") is None
    assert checkpoint.load_latest(tmp_path) is None
    leftover = tmp_path / ".tmp-epoch-000001-deadbeef"
    leftover.mkdir()
    (leftover / "model.tensors").write_bytes(b"half")
    (tmp_path / ".tmp-stray-file").write_bytes(b"")
    (tmp_path / "epoch-notanumber").mkdir()
    assert checkpoint.load_latest(tmp_path) is None
    await checkpoint.to_directory(tmp_path)(small_state(1), None)
    assert scratch(tmp_path) == []
    assert checkpoint.load_latest(tmp_path) is not None


@contextlib.contextmanager
def _lock_held(directory: Path) -> Iterator[None]:
    import fcntl

    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.mark.skipif(sys.platform == "win32", reason="the writer lock is POSIX only")
async def test_a_second_concurrent_writer_is_refused(tmp_path: Path) -> None:
    with _lock_held(tmp_path):
        with pytest.raises(lampdist.CheckpointError, match="another writer"):
            await checkpoint.to_directory(tmp_path)(small_state(1), None)
        assert committed(tmp_path) == []
    await checkpoint.to_directory(tmp_path)(small_state(1), None)
    assert committed(tmp_path) == ["epoch-000001"]


# ---------------------------------------------------------------------------------------------
# damage and versions


async def _three_epochs(directory: Path) -> None:
    save = checkpoint.to_directory(directory)
    for epoch in (1, 2, 3):
        await save(small_state(epoch), None)


def _loaded_epoch(directory: Path) -> int:
    loaded = checkpoint.load_latest(directory)
    assert loaded is not None
    assert_identical(loaded.training_state, small_state(loaded.training_state.loop_state.epoch))
    return loaded.training_state.loop_state.epoch


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_tensor_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    offset = data.find(struct.pack("<8f", *[3.0] * 8))  # inside epoch 3's "w" tensor
    assert offset > 0
    data[offset + 5] ^= 0x01
    path.write_bytes(bytes(data))


def _remove(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize(
    ("damage", "filename"),
    [
        (_truncate, "model.tensors"),
        (_flip_a_tensor_byte, "model.tensors"),
        (_truncate, "manifest.json"),
        (_remove, "manifest.json"),
        (_remove, "optimizer.tensors"),
        (_truncate, "state.json"),
    ],
)
async def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any, filename: str
) -> None:
    await _three_epochs(tmp_path)
    damage(tmp_path / "epoch-000003" / filename)
    with caplog.at_level(logging.WARNING, logger="lampdist.checkpoint"):
        assert _loaded_epoch(tmp_path) == 2
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "epoch-000003" in record.getMessage()
    # training resumed from epoch 2 writes epoch 3 again: the damaged one is superseded
    await checkpoint.to_directory(tmp_path)(small_state(3), None)
    assert committed(tmp_path) == ["epoch-000001", "epoch-000002", "epoch-000003.1"]
    assert _loaded_epoch(tmp_path) == 3


async def test_every_checkpoint_damaged_is_an_error(tmp_path: Path) -> None:
    await _three_epochs(tmp_path)
    for name in committed(tmp_path):
        _truncate(tmp_path / name / "model.tensors")
    with pytest.raises(lampdist.CheckpointError, match="every checkpoint"):
        checkpoint.load_latest(tmp_path)


def _rewrite_manifest_version(path: Path, version: int) -> None:
    manifest = json.loads(path.read_text())
    manifest["format_version"] = version
    body = json.dumps(
        {"format_version": version, "files": manifest["files"]},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    manifest["checksum"] = hashlib.sha256(body).hexdigest()
    path.write_text(json.dumps(manifest))


async def test_a_newer_format_is_refused_not_skipped(tmp_path: Path) -> None:
    await _three_epochs(tmp_path)
    manifest = tmp_path / "epoch-000003" / "manifest.json"
    _rewrite_manifest_version(manifest, checkpoint.FORMAT_VERSION + 1)
    with pytest.raises(lampdist.CheckpointVersionError, match="upgrade lampdist") as caught:
        checkpoint.load_latest(tmp_path)
    assert caught.value.phase == "resume"
    _rewrite_manifest_version(manifest, checkpoint.FORMAT_VERSION)  # the test edit is faithful
    assert _loaded_epoch(tmp_path) == 3


async def test_a_bad_map_location_is_an_error_not_damage(tmp_path: Path) -> None:
    await _three_epochs(tmp_path)
    with pytest.raises(lampdist.CheckpointError, match="map_location"):
        checkpoint.load_latest(tmp_path, map_location="no-such-device")


async def test_map_location_is_applied(tmp_path: Path) -> None:
    await _three_epochs(tmp_path)
    loaded = checkpoint.load_latest(tmp_path, map_location="meta")
    assert loaded is not None
    assert loaded.training_state.model_state["w"].device.type == "meta"


# ---------------------------------------------------------------------------------------------
# interruption: every abort point, cancellation, SIGKILL


class _Abort(Exception):
    pass


def test_an_abort_at_any_point_leaves_no_partial_checkpoint(tmp_path: Path) -> None:
    state = small_state(2)
    write_checkpoint(
        tmp_path, small_state(1), None, capture_rng_states(), keep=3,
        check=lambda: None,
    )  # fmt: skip
    points = 0

    def count() -> None:
        nonlocal points
        points += 1

    probe = tmp_path / "probe"
    write_checkpoint(probe, state, None, capture_rng_states(), keep=3, check=count)
    assert points > 10
    for abort_at in range(1, points + 1):
        calls = 0

        def abort(abort_at: int = abort_at) -> None:
            nonlocal calls
            calls += 1
            if calls == abort_at:
                raise _Abort

        with pytest.raises(_Abort):
            write_checkpoint(
                tmp_path, state, None, capture_rng_states(), keep=3,
                check=abort,
            )  # fmt: skip
        assert committed(tmp_path) == ["epoch-000001"], abort_at
        assert scratch(tmp_path) == [], abort_at
        assert _loaded_epoch(tmp_path) == 1


def test_loading_while_a_writer_prunes_sees_whole_checkpoints(tmp_path: Path) -> None:
    last = 30
    failures: list[BaseException] = []

    def write() -> None:
        try:
            for epoch in range(1, last + 1):
                state, lr_state = expected_state(epoch)
                write_checkpoint(
                    tmp_path, state, lr_state, capture_rng_states(), keep=1,
                    check=lambda: None,
                )  # fmt: skip
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        seen = 0
        while writer.is_alive() or seen < last:
            loaded = checkpoint.load_latest(tmp_path)
            if loaded is not None:
                epoch = loaded.training_state.loop_state.epoch
                assert epoch >= seen
                assert_identical(loaded.training_state, expected_state(epoch)[0])
                seen = epoch
            if failures:
                break
    finally:
        writer.join(30)
    assert failures == []
    assert seen == last


class _BlockingStateDict(Mapping[str, torch.Tensor]):
    """A state dict whose iteration (on the writer thread) waits for the test."""

    def __init__(self, data: dict[str, torch.Tensor]) -> None:
        self.data = data
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.data[key]

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator[str]:
        self.entered.set()
        assert self.release.wait(10)
        return iter(self.data)


async def test_cancellation_during_a_write_leaves_no_checkpoint(tmp_path: Path) -> None:
    save = checkpoint.to_directory(tmp_path)
    await save(small_state(1), None)
    blocking = _BlockingStateDict({"w": torch.ones(1000)})
    state = attrs.evolve(small_state(2), model_state=blocking)
    scope = anyio.CancelScope()

    async def write() -> None:
        with scope:
            await save(state, None)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await anyio.to_thread.run_sync(blocking.entered.wait, 10)
            assert scratch(tmp_path) != []  # it is mid-write: the scratch directory exists
            scope.cancel()
            blocking.release.set()
    assert scope.cancelled_caught
    assert committed(tmp_path) == ["epoch-000001"]
    assert scratch(tmp_path) == []
    await save(small_state(2), None)
    assert _loaded_epoch(tmp_path) == 2


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        assert selector.select(timeout), "the writer host did not answer in time"
    return process.stdout.readline().strip()


def test_sigkilled_writers_never_leave_an_unloadable_or_mixed_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "run"
    stop_epoch = 50
    host_script = Path(__file__).with_name("checkpoint_writer.py")
    pauses = random.Random(20240611)
    with open(tmp_path / "host.err", "w") as host_err:
        host = subprocess.Popen(
            [sys.executable, str(host_script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=host_err,
            text=True,
        )
    assert host.stdin is not None
    saved = capture_rng_states()

    def ask(line: str) -> str:
        assert host.stdin is not None
        host.stdin.write(line + "\n")
        host.stdin.flush()
        return _read_line(host, 30)

    try:
        assert _read_line(host, 60) == "ready"
        newest = 0
        kills = 0
        interrupted = 0  # kills that left a writer's scratch behind: they hit mid-write
        window = (
            0.1  # kill within this many seconds: wider after a kill before any save, else narrower
        )
        while kills < 200:
            if newest >= stop_epoch:
                if interrupted:
                    break
                # Every kill so far missed the writes (a fast writer, a slow machine):
                # go on to later epochs until one lands mid-write.
                stop_epoch += 10
            pid = int(ask(f"write {directory} {stop_epoch} {kills}"))
            threading.Event().wait(pauses.uniform(0.0, window))
            os.kill(pid, signal.SIGKILL)
            kills += 1
            status = int(ask(f"reap {pid}"))
            interrupted += bool(scratch(directory)) if directory.exists() else 0
            assert os.WIFSIGNALED(status) or status == 0, (tmp_path / "host.err").read_text()
            with caplog.at_level(logging.WARNING, logger="lampdist.checkpoint"):
                loaded = checkpoint.load_latest(directory, restore_rng=True)
            if loaded is None:
                assert newest == 0, "a committed checkpoint became unloadable"
                window = min(2 * window, 2.0)
                continue
            state, lr_state = loaded.training_state, loaded.schedule_state
            assert loaded.rng_states is not None
            restore_rng_states(loaded.rng_states)
            epoch = state.loop_state.epoch
            assert epoch >= newest
            window = min(2 * window, 2.0) if epoch == newest else max(0.7 * window, 0.02)
            expected, expected_lr = expected_state(epoch)
            assert_identical(state, expected)
            assert lr_state == attrs.asdict(expected_lr)
            drawn = torch.rand(2)
            seed_everything(epoch)
            assert_identical(drawn, torch.rand(2))
            newest = epoch
        assert newest == stop_epoch, f"only reached epoch {newest} in {kills} kills"
        assert kills >= 5
        assert interrupted >= 1, f"none of {kills} kills landed mid-write"
        pid = int(ask(f"write {directory} {stop_epoch + 1} 0"))  # one clean write at the end
        assert int(ask(f"reap {pid}")) == 0, (tmp_path / "host.err").read_text()
        assert scratch(directory) == []
        assert committed(directory) == [f"epoch-{stop_epoch:06d}", f"epoch-{stop_epoch + 1:06d}"]
        assert caplog.records == []  # SIGKILL never damages a committed checkpoint
    finally:
        torch.set_rng_state(saved.torch_cpu)
        random.setstate(saved.python)
        np.random.set_state(saved.numpy)
        host.stdin.close()
        host.wait(30)
