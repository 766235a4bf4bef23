"""Format 2: tensor files round trip exactly, bad ones are refused, format 1 still loads."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import struct
import sys
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lampdist
from lampdist import LoopState, checkpoint
from lampdist._checkpoint import restore_rng_states
from lampdist._checkpoint._format import BLOCK_BYTES

from . import _format1
from .test_checkpoint import assert_identical, committed, small_state

# ---------------------------------------------------------------------------------------------
# helpers


def _rewrite(directory: Path, name: str, data: bytes) -> None:
    """Replace a file of a checkpoint and make its manifest agree (as a faulty writer would)."""
    (directory / name).write_bytes(data)
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    blocks = [
        f"{zlib.crc32(data[start : start + BLOCK_BYTES]):08x}"
        for start in range(0, len(data), BLOCK_BYTES)
    ]
    manifest["files"]["files"][name] = {"size": len(data), "blocks": blocks}
    body = json.dumps(
        {"format_version": manifest["format_version"], "files": manifest["files"]},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    manifest["checksum"] = hashlib.sha256(body).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def _tensor_file(header: Any, data: bytes = b"", *, raw_header: bytes | None = None) -> bytes:
    encoded = raw_header if raw_header is not None else json.dumps(header).encode()
    head = b"LDTENSOR" + struct.pack("<Q", len(encoded)) + encoded
    return head + bytes(-len(head) % 64) + data


async def _save(directory: Path, model_state: Any, epoch: int = 1) -> Path:
    state = attrs.evolve(small_state(epoch), model_state=model_state)
    await checkpoint.to_directory(directory)(state, None)
    return directory / committed(directory)[-1]


# ---------------------------------------------------------------------------------------------
# round trips

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    raw = torch.tensor(list(draw(st.binary(min_size=64, max_size=64))), dtype=torch.uint8)
    count = max(1, torch.Size(shape).numel())
    data = raw.repeat(count * dtype.itemsize // 64 + 1)[: count * dtype.itemsize]
    tensor = data.view(dtype)[: torch.Size(shape).numel()].reshape(shape)
    if draw(st.booleans()) and tensor.dim() == 2:
        tensor = tensor.t()  # not contiguous
    return tensor


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=5)
    | _tensors()
    | st.sampled_from([torch.float16, torch.int64, torch.device("cpu"), torch.Size([2, 3])])
)
_keys = st.one_of(st.text(max_size=5), st.integers(-5, 5), st.tuples(st.integers(0, 3)))
_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(_keys, inner, max_size=3)
        | st.dictionaries(_keys, inner, max_size=3).map(OrderedDict)
    ),
    max_leaves=12,
)


def _same(actual: Any, expected: Any) -> None:
    """assert_identical, with NaN equal to NaN in plain floats."""
    if isinstance(expected, float) and math.isnan(expected):
        assert isinstance(actual, float)
        assert math.isnan(actual)
    elif isinstance(expected, dict):
        assert type(actual) is type(expected)
        assert list(actual) == list(expected)
        for key in expected:
            _same(actual[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected)
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            _same(a, e)
    else:
        assert_identical(actual, expected)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=st.dictionaries(st.text(max_size=5), _values, max_size=4))
def test_tensor_files_round_trip_any_value_of_the_grammar(tmp_path: Path, value: Any) -> None:
    directory = tmp_path / "run"
    shutil.rmtree(directory, ignore_errors=True)
    state = attrs.evolve(small_state(1), model_state=value, optimizer_state={"v": value})
    anyio.run(checkpoint.to_directory(directory), state, None)
    assert (directory / "epoch-000001" / "model.tensors").exists()
    loaded = checkpoint.load_latest(directory)
    assert loaded is not None
    _same(loaded.training_state.model_state, value)
    _same(loaded.training_state.optimizer_state, {"v": value})


async def test_state_dict_metadata_and_many_small_tensors_round_trip(tmp_path: Path) -> None:
    model: OrderedDict[str, torch.Tensor] = OrderedDict(
        (f"t{i}", torch.full((i % 5,), float(i)))
        for i in range(3000)  # > IOV_MAX per block
    )
    model["big"] = torch.arange(5 << 20, dtype=torch.float32)  # spans blocks
    model._metadata = OrderedDict([("", {"version": 2})])  # type: ignore[attr-defined]  # as state_dict() does
    path = await _save(tmp_path, model)
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None
    assert_identical(loaded.training_state.model_state, model)
    assert getattr(loaded.training_state.model_state, "_metadata", None) == {"": {"version": 2}}
    assert sorted(p.name for p in path.iterdir()) == [
        "best_model.tensors",
        "manifest.json",
        "model.tensors",
        "optimizer.tensors",
        "rng.tensors",
        "state.json",
    ]


@pytest.mark.parametrize(
    "odd",
    [
        1 + 2j,  # a python complex
        torch.nn.Parameter(torch.ones(2)),  # requires grad
        torch.ones(3).to_sparse(),
        b"bytes",
    ],
    ids=["complex", "parameter", "sparse", "bytes"],
)
async def test_values_outside_the_grammar_fall_back_to_torch_save(tmp_path: Path, odd: Any) -> None:
    model = {"w": torch.ones(4), "odd": odd}
    path = await _save(tmp_path, model)
    assert (path / "model.pt").exists()
    assert not (path / "model.tensors").exists()
    assert (path / "optimizer.tensors").exists()
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None
    assert_identical(loaded.training_state.model_state["w"], model["w"])
    if isinstance(odd, torch.Tensor):
        assert type(loaded.training_state.model_state["odd"]) is type(odd)
        assert torch.equal(loaded.training_state.model_state["odd"].to_dense(), odd.to_dense())
    else:
        assert loaded.training_state.model_state["odd"] == odd


@pytest.mark.parametrize(
    "map_location",
    [
        "meta",
        torch.device("meta"),
        {"cpu": "meta"},
    ],
    ids=["str", "device", "dict"],
)
async def test_map_location_places_tensor_file_tensors(tmp_path: Path, map_location: Any) -> None:
    await _save(tmp_path, {"w": torch.ones(2, 3)})
    loaded = checkpoint.load_latest(tmp_path, map_location=map_location)
    assert loaded is not None
    weight = loaded.training_state.model_state["w"]
    assert (weight.device.type, weight.shape, weight.dtype) == ("meta", (2, 3), torch.float32)


async def test_a_callable_map_location_gets_each_storage_and_location(tmp_path: Path) -> None:
    await _save(tmp_path, {"w": torch.arange(6.0).reshape(2, 3)})
    locations = []

    def keep_or_copy(storage: Any, location: str) -> Any:
        locations.append(location)
        return None if len(locations) % 2 else storage.clone()

    loaded = checkpoint.load_latest(tmp_path, map_location=keep_or_copy)
    assert loaded is not None
    assert_identical(loaded.training_state.model_state["w"], torch.arange(6.0).reshape(2, 3))
    assert set(locations) == {"cpu"}

    def broken(storage: Any, location: str) -> Any:
        raise AssertionError("a user's bug")

    with pytest.raises(lampdist.CheckpointError, match="map_location"):
        checkpoint.load_latest(tmp_path, map_location=broken)


# ---------------------------------------------------------------------------------------------
# bad tensor files: refused, never a crash

_GOOD: dict[str, Any] = {"byteorder": sys.byteorder, "tensors": [], "value": {"dict": []}}
_ONE = {"dtype": "float32", "shape": [2], "device": "cpu", "offset": 0}


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"LDTENS",
        b"NOTMAGIC" + struct.pack("<Q", 2) + b"{}",
        b"LDTENSOR" + struct.pack("<Q", 1 << 60) + b"{}",
        _tensor_file(None, raw_header=b"{not json"),
        _tensor_file(None, raw_header=b"[" * 100_000 + b"]" * 100_000),
        _tensor_file({"tensors": [], "value": None}),
        _tensor_file({**_GOOD, "tensors": {}}),
        _tensor_file({**_GOOD, "tensors": [{**_ONE, "dtype": "object"}]}, bytes(8)),
        _tensor_file({**_GOOD, "tensors": [{**_ONE, "shape": [-2]}]}, bytes(8)),
        _tensor_file({**_GOOD, "tensors": [{**_ONE, "shape": [2**62]}]}, bytes(8)),
        _tensor_file({**_GOOD, "tensors": [{**_ONE, "offset": 3}]}, bytes(16)),
        _tensor_file({**_GOOD, "tensors": [_ONE, _ONE]}, bytes(128)),
        _tensor_file({**_GOOD, "tensors": [_ONE]}, bytes(4)),  # truncated tensor
        _tensor_file({**_GOOD, "tensors": [_ONE]}, bytes(8 + 64)),  # trailing bytes
        _tensor_file({**_GOOD, "value": {"pickle": "cos\nsystem\n"}}),
        _tensor_file({**_GOOD, "value": {"tensor": 0}}),
        _tensor_file({**_GOOD, "value": {"dict": [[["a"], 1]]}}),
        _tensor_file({**_GOOD, "value": {"odict": [], "attrs": {"__class__": 1}}}),
        _tensor_file({**_GOOD, "value": {"dtype": "no_such_dtype"}}),
        _tensor_file({**_GOOD, "value": {"device": "no-such-device"}}),
        _tensor_file({**_GOOD, "value": {"tuple": 5}}),
    ],
)
async def test_a_bad_tensor_file_is_skipped_as_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    await _save(tmp_path, {"w": torch.ones(2)}, epoch=1)
    newest = await _save(tmp_path, {"w": torch.zeros(2)}, epoch=2)
    _rewrite(newest, "model.tensors", content)  # the manifest agrees: only the format is wrong
    with caplog.at_level(logging.WARNING, logger="lampdist.checkpoint"):
        loaded = checkpoint.load_latest(tmp_path)
    assert loaded is not None
    assert loaded.training_state.loop_state.epoch == 1
    [record] = caplog.records
    assert "epoch-000002" in record.getMessage()
    shutil.rmtree(tmp_path / "epoch-000001")
    with pytest.raises(lampdist.CheckpointError, match=r"every checkpoint .* is damaged"):
        checkpoint.load_latest(tmp_path)


async def test_a_truncated_tensor_file_is_skipped(tmp_path: Path) -> None:
    await _save(tmp_path, {"w": torch.ones(2)}, epoch=1)
    newest = await _save(tmp_path, {"w": torch.arange(1000.0)}, epoch=2)
    data = (newest / "model.tensors").read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 20, 0):
        _rewrite(newest, "model.tensors", data[:cut])
        loaded = checkpoint.load_latest(tmp_path)
        assert loaded is not None
        assert loaded.training_state.loop_state.epoch == 1, cut


async def test_a_tensor_file_of_the_other_byte_order_is_an_error(tmp_path: Path) -> None:
    path = await _save(tmp_path, {"w": torch.ones(2)})
    other = "big" if sys.byteorder == "little" else "little"
    _rewrite(path, "model.tensors", _tensor_file({**_GOOD, "byteorder": other}))
    with pytest.raises(lampdist.CheckpointError, match="endian"):
        checkpoint.load_latest(tmp_path)


# ---------------------------------------------------------------------------------------------
# format 1


async def test_format_1_checkpoints_still_load_and_are_superseded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shutil.copytree(_format1.FIXTURE, tmp_path, dirs_exist_ok=True)
    expected, expected_lr = _format1.expected()
    loaded = checkpoint.load_latest(tmp_path, restore_rng=True)
    assert loaded is not None
    assert_identical(loaded.training_state, expected)
    assert loaded.schedule_state == attrs.asdict(expected_lr)
    assert loaded.rng_states is not None
    restore_rng_states(loaded.rng_states)
    drawn = torch.rand(3)
    _format1.seed()
    assert_identical(drawn, torch.rand(3))
    # a run resumed from it writes format 2 beside it; if that one is damaged, format 1 is used
    state = attrs.evolve(expected, loop_state=LoopState(epoch=8))
    await checkpoint.to_directory(tmp_path)(state, _format1.Format1ScheduleState(step=8, factor=1))
    assert committed(tmp_path) == ["epoch-000007", "epoch-000008"]
    newest = checkpoint.load_latest(tmp_path)
    assert newest is not None
    assert_identical(newest.training_state, state)
    (tmp_path / "epoch-000008" / "model.tensors").write_bytes(b"damaged")
    with caplog.at_level(logging.WARNING, logger="lampdist.checkpoint"):
        again = checkpoint.load_latest(tmp_path)
    assert again is not None
    assert again.training_state.loop_state.epoch == 7


async def test_a_format_1_checkpoint_with_a_flipped_bit_is_skipped(tmp_path: Path) -> None:
    shutil.copytree(_format1.FIXTURE / "epoch-000007", tmp_path / "epoch-000007")
    model = tmp_path / "epoch-000007" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x04
    model.write_bytes(bytes(data))
    with pytest.raises(lampdist.CheckpointError, match="sha256"):
        checkpoint.load_latest(tmp_path)
