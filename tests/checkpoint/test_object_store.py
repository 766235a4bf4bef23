"""Checkpoints in an object store: a real S3 endpoint (moto's server over HTTP, see
s3_server.py), reached through obstore the way a user's run reaches S3."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import lampdist
from lampdist._checkpoint import (
    FileRecord,
    check_store_writable,
    is_url,
    list_checkpoints,
    new_store_shards,
    read_latest,
    read_latest_from_store,
    write_checkpoint,
    write_to_store,
)
from lampdist._checkpoint._rng import RngStates, capture_rng_states
from lampdist._state import TrainingState

from .checkpoint_writer import expected_state
from .s3_server import S3Server
from .store_writer import large_state
from .test_checkpoint import assert_identical

obstore = pytest.importorskip("obstore")
pytest.importorskip("moto.server")

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# helpers


def store_of(url: str) -> Any:
    """An obstore store of ``url``'s bucket root, for the test's own reads and writes."""
    from obstore.store import from_url

    return from_url(url.rpartition("/")[0])


def run_of(url: str) -> str:
    return url.rpartition("/")[2]


def keys(url: str) -> list[str]:
    """Every object under ``url``, relative to it."""
    store = store_of(url)
    run = run_of(url)
    found = [meta["path"] for chunk in obstore.list(store, run) for meta in chunk]
    return sorted(key.removeprefix(f"{run}/") for key in found)


def object_bytes(url: str, key: str) -> bytes:
    return bytes(obstore.get(store_of(url), f"{run_of(url)}/{key}").bytes())


def put_object(url: str, key: str, data: bytes) -> None:
    obstore.put(store_of(url), f"{run_of(url)}/{key}", data)


def write(
    url: str,
    state: TrainingState,
    lr_state: Any = None,
    *,
    keep: int = 3,
    check: Callable[[], None] = lambda: None,
    options: dict[str, str] | None = None,
    rng: RngStates | None = None,
) -> str:
    rng = capture_rng_states() if rng is None else rng
    return write_to_store(
        url, state, lr_state, rng, keep=keep, check=check, options=options
    )  # fmt: skip


def write_epoch(url: str, epoch: int, *, keep: int = 3) -> str:
    state, lr_state = expected_state(epoch)
    return write(url, state, lr_state, keep=keep)


def names(url: str) -> list[str]:
    return [listed.name for listed in list_checkpoints(url, verify=False)]


def full_state() -> TrainingState:
    """Model, optimizer, best model (with a value only torch.save holds: a ``.pt``
    fallback), the ranks' states, and a tensor over one part (a multipart upload)."""
    state, _ = expected_state(4)
    model = dict(state.model_state)
    model["big"] = torch.arange(5 << 20, dtype=torch.float32)  # 20 MB: two parts
    return attrs.evolve(
        state,
        model_state=model,
        best_model_state={"w": torch.ones(3), "odd": torch.ones(3).to_sparse()},
        rank_states=({"seen": torch.tensor([1, 2])}, {"seen": torch.tensor([3])}),
    )


# ---------------------------------------------------------------------------------------------
# the format and the protocol


def test_urls_are_told_from_paths() -> None:
    for url in ("s3://bucket/run", "gs://b/r", "az://c/r", "abfs://c/r", "memory://x", "S3://b"):
        assert is_url(url), url
    for path in ("runs/a", "/tmp/s3:/x", Path("s3://b"), "file:///tmp/a", "", None, 3):
        assert not is_url(path), path


def test_a_checkpoint_round_trips_and_is_the_local_one_byte_for_byte(
    s3_url: str, tmp_path: Path
) -> None:
    state = full_state()
    rng = capture_rng_states()
    local = write_checkpoint(tmp_path, state, {"lr": 0.5}, rng, keep=1, check=lambda: None)
    written = write(s3_url, state, {"lr": 0.5}, rng=rng)
    assert written == f"{s3_url}/epoch-000004"

    files = sorted(path.name for path in local.iterdir())
    assert "best_model.pt" in files
    assert keys(s3_url) == [f"epoch-000004/{name}" for name in files]
    for name in files:  # the manifest too: the same files, the same bytes
        assert object_bytes(s3_url, f"epoch-000004/{name}") == (local / name).read_bytes(), name

    from_disk = read_latest(tmp_path, map_location=None)
    from_store = read_latest_from_store(s3_url, map_location=None, options=None)
    assert from_disk is not None and from_store is not None
    assert from_store.path == written
    assert_identical(from_store.training_state.model_state, from_disk.training_state.model_state)
    for field in ("loop_state", "optimizer_state", "rank_states"):
        assert_identical(
            getattr(from_store.training_state, field), getattr(from_disk.training_state, field)
        )
    best_disk = from_disk.training_state.best_model_state
    best_store = from_store.training_state.best_model_state
    assert best_disk is not None and best_store is not None
    assert_identical(best_store["w"], best_disk["w"])
    assert torch.equal(best_store["odd"].to_dense(), best_disk["odd"].to_dense())
    assert from_store.lr_state_json == from_disk.lr_state_json
    assert from_store.rng.to_json() == from_disk.rng.to_json()
    assert_identical(list(from_store.rng.tensors()), list(from_disk.rng.tensors()))
    big = from_store.training_state.model_state["big"]
    big.add_(1)  # writable, not a view of a read-only download


def test_a_directory_copied_up_loads_from_the_store(s3_url: str, tmp_path: Path) -> None:
    state, lr_state = expected_state(5)
    local = write_checkpoint(
        tmp_path, state, lr_state, capture_rng_states(), keep=1, check=lambda: None
    )
    for path in local.iterdir():  # what `aws s3 sync` does
        put_object(s3_url, f"{local.name}/{path.name}", path.read_bytes())
    loaded = read_latest_from_store(s3_url, map_location=None, options=None)
    assert loaded is not None
    assert_identical(loaded.training_state.model_state, state.model_state)
    assert_identical(loaded.training_state.loop_state, state.loop_state)


def test_no_checkpoint_reads_as_none(s3_url: str) -> None:
    assert read_latest_from_store(s3_url, map_location=None, options=None) is None
    assert list_checkpoints(s3_url, verify=True) == []


def test_the_manifest_is_uploaded_last(s3_url: str) -> None:
    write_epoch(s3_url, 1)
    seen = []

    def check() -> None:  # between every piece of every file, inside obstore's runtime
        with ThreadPoolExecutor(1) as other:  # so the test's own client runs elsewhere
            seen.append("epoch-000002/manifest.json" in other.submit(keys, s3_url).result())

    state, lr_state = expected_state(2)
    write(s3_url, state, lr_state, check=check)
    assert seen and not any(seen)
    assert "epoch-000002/manifest.json" in keys(s3_url)


def test_only_the_newest_keep_are_kept(s3_url: str) -> None:
    for epoch in range(1, 5):
        write_epoch(s3_url, epoch, keep=2)
    assert names(s3_url) == ["epoch-000004", "epoch-000003"]
    assert {key.partition("/")[0] for key in keys(s3_url)} == {"epoch-000004", "epoch-000003"}


def test_the_same_epoch_again_is_the_next_generation(s3_url: str) -> None:
    write_epoch(s3_url, 3)
    assert write_epoch(s3_url, 3) == f"{s3_url}/epoch-000003.1"
    assert names(s3_url) == ["epoch-000003.1"]  # it supersedes the first
    loaded = read_latest_from_store(s3_url, map_location=None, options=None)
    assert loaded is not None and loaded.path == f"{s3_url}/epoch-000003.1"


def test_an_older_epoch_is_refused(s3_url: str) -> None:
    write_epoch(s3_url, 3)
    with pytest.raises(lampdist.CheckpointError, match="newer than the epoch 2") as caught:
        write_epoch(s3_url, 2)
    assert caught.value.phase == "checkpoint"
    assert names(s3_url) == ["epoch-000003"]


def test_check_store_writable_has_the_local_rules(s3_url: str) -> None:
    check_store_writable(s3_url, 0, resumed=False, options=None)  # nothing there
    write_epoch(s3_url, 3)
    with pytest.raises(lampdist.CheckpointError, match="this is a new run") as caught:
        check_store_writable(s3_url, 0, resumed=False, options=None)
    assert caught.value.phase == "configure"
    check_store_writable(s3_url, 2, resumed=True, options=None)  # writes epoch 3 next
    check_store_writable(s3_url, 7, resumed=True, options=None)
    with pytest.raises(lampdist.CheckpointError, match="newer than the run resumed at epoch 1"):
        check_store_writable(s3_url, 1, resumed=True, options=None)


@pytest.mark.parametrize("missing", ["metadata", "a rank's file", "a short file"])
def test_shards_that_are_not_all_there_are_not_committed(s3_url: str, missing: str) -> None:
    """The root commits a sharded checkpoint only when every rank's files are in the store
    as their records say; otherwise nothing of it stays, the ranks' uploads included."""
    state, lr_state = expected_state(1)
    shards = new_store_shards(s3_url, 1, 2, {}, None)
    assert shards.path == f"{s3_url}/epoch-000001/shards"
    files = {
        "shards/.metadata": b"meta",
        "shards/__0_0.distcp": b"zero",
        "shards/__1_0.distcp": b"one",
    }
    records = [FileRecord(name=name, size=len(data), digests=()) for name, data in files.items()]
    if missing == "metadata":
        del files["shards/.metadata"]
        records = records[1:]
    elif missing == "a rank's file":
        del files["shards/__1_0.distcp"]
    else:
        files["shards/__1_0.distcp"] = b"on"
    for name, data in files.items():
        put_object(s3_url, f"epoch-000001/{name}", data)
    sharded = attrs.evolve(state, shards=attrs.evolve(shards, records=tuple(records)))
    with pytest.raises(lampdist.CheckpointError) as caught:
        write(s3_url, sharded, lr_state)
    assert caught.value.phase == "checkpoint"
    assert keys(s3_url) == []


@pytest.mark.parametrize("damage", ["truncated", "altered", "missing"])
def test_a_damaged_file_is_skipped_with_a_warning_and_flagged(
    s3_url: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    write_epoch(s3_url, 1)
    write_epoch(s3_url, 2)
    key = "epoch-000002/model.tensors"
    data = object_bytes(s3_url, key)
    if damage == "truncated":
        put_object(s3_url, key, data[:-7])
    elif damage == "altered":
        put_object(s3_url, key, data[:-1] + bytes([data[-1] ^ 0x10]))
    else:
        obstore.delete(store_of(s3_url), f"{run_of(s3_url)}/{key}")

    with caplog.at_level(logging.WARNING, logger="lampdist.checkpoint"):
        loaded = read_latest_from_store(s3_url, map_location=None, options=None)
    assert loaded is not None and loaded.training_state.loop_state.epoch == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1
    assert f"{s3_url}/epoch-000002" in warned[0] and "model.tensors" in warned[0]

    listed = list_checkpoints(s3_url, verify=True)
    assert [(item.name, item.verified) for item in listed] == [
        ("epoch-000002", False),
        ("epoch-000001", True),
    ]
    assert listed[0].problem is not None and "model.tensors" in listed[0].problem
    assert listed[0].location == f"{s3_url}/epoch-000002"
    first = [k for k in keys(s3_url) if k.startswith("epoch-000001/")]
    sizes = [len(object_bytes(s3_url, k)) for k in first if not k.endswith("manifest.json")]
    assert listed[1].size == sum(sizes)


def test_every_checkpoint_damaged_is_an_error_naming_them(s3_url: str) -> None:
    write_epoch(s3_url, 1)
    put_object(s3_url, "epoch-000001/state.json", b"{}")
    with pytest.raises(lampdist.CheckpointError, match=r"every checkpoint in .* is damaged"):
        read_latest_from_store(s3_url, map_location=None, options=None)


class Abort(Exception):
    """What the test's check() raises midway (a cancellation)."""


def test_an_aborted_write_commits_nothing_and_keeps_the_previous_one(s3_url: str) -> None:
    write_epoch(s3_url, 1, keep=1)
    calls = 0

    def check() -> None:
        nonlocal calls
        calls += 1
        if calls == 4:  # in the middle of the model's 20 MB (a multipart upload)
            raise Abort

    with pytest.raises(Abort):
        write(s3_url, full_state(), keep=1, check=check)
    assert [key for key in keys(s3_url) if not key.startswith("epoch-000001/")] == []
    assert names(s3_url) == ["epoch-000001"]
    loaded = read_latest_from_store(s3_url, map_location=None, options=None)
    assert loaded is not None and loaded.training_state.loop_state.epoch == 1


def test_leftovers_are_ignored_and_removed_by_the_next_writer(s3_url: str) -> None:
    write_epoch(s3_url, 1)
    put_object(s3_url, "epoch-000002/model.tensors", b"half an upload")
    put_object(s3_url, "epoch-000002/stray.bin", b"from an earlier attempt")
    put_object(s3_url, "epoch-000009/model.tensors", b"not ours to remove")
    assert names(s3_url) == ["epoch-000001"]
    loaded = read_latest_from_store(s3_url, map_location=None, options=None)
    assert loaded is not None and loaded.training_state.loop_state.epoch == 1

    write_epoch(s3_url, 2)
    assert "epoch-000002/stray.bin" not in keys(s3_url)
    assert "epoch-000009/model.tensors" in keys(s3_url)  # newer than what was written
    loaded = read_latest_from_store(s3_url, map_location=None, options=None)
    assert loaded is not None and loaded.training_state.loop_state.epoch == 2


def test_a_failing_store_is_one_error_naming_the_url_without_credentials(s3_url: str) -> None:
    from .s3_server import free_port

    options = {
        "endpoint": f"http://127.0.0.1:{free_port()}",  # nothing listens
        "max_retries": "1",
        "retry_timeout": "2",
    }
    with pytest.raises(lampdist.CheckpointError) as caught:
        write(s3_url, expected_state(1)[0], options=options)
    message = str(caught.value)
    assert caught.value.phase == "checkpoint"
    assert s3_url in message
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in message
    assert "\n" not in message


def test_bad_options_are_a_config_error(s3_url: str) -> None:
    with pytest.raises(lampdist.ConfigError, match="cannot open"):
        read_latest_from_store(s3_url, map_location=None, options={"no_such_key": "1"})
    with pytest.raises(lampdist.ConfigError, match="max_retries"):
        read_latest_from_store(s3_url, map_location=None, options={"max_retries": "many"})


# ---------------------------------------------------------------------------------------------
# faults: a killed writer, a stalled server, a server that loses everything

KILL_POINTS = 10
LARGE_MB = 96


def _start_writer(url: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.store_writer", url, str(LARGE_MB)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "1", "the writer failed to write epoch 1"
    return process


@pytest.mark.slow
def test_a_writer_killed_anywhere_in_an_upload_leaves_epoch_1_or_2(s3_url: str) -> None:
    expected, _ = large_state(LARGE_MB)
    # one whole write, to measure how long epoch 2 takes
    url = f"{s3_url}-calibration"
    writer = _start_writer(url)
    started = time.monotonic()
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "2"
    duration = time.monotonic() - started
    assert writer.wait(timeout=60) == 0

    outcomes = []
    for point in range(KILL_POINTS):
        url = f"{s3_url}-kill-{point}"
        writer = _start_writer(url)
        time.sleep(duration * (point + 0.5) / KILL_POINTS)
        writer.kill()
        writer.wait(timeout=60)

        loaded = read_latest_from_store(url, map_location=None, options=None)
        assert loaded is not None, f"kill {point}: every checkpoint lost"
        epoch = loaded.training_state.loop_state.epoch
        outcomes.append(epoch)
        if epoch == 2:
            assert_identical(loaded.training_state.model_state, expected.model_state)
        else:
            assert epoch == 1
        listed = list_checkpoints(url, verify=True)
        assert all(item.verified for item in listed), f"kill {point}: {listed}"
        # the next writer goes on from there (what the killed one left is no checkpoint; a
        # request of it still in flight in the server may land later: not asserted on)
        write_epoch(url, 3, keep=1)
        listed = list_checkpoints(url, verify=True)
        assert [(item.name, item.verified) for item in listed] == [("epoch-000003", True)]
    assert set(outcomes) <= {1, 2}


def _write_in_thread(
    url: str, state: TrainingState, check: Callable[[], None], options: dict[str, str]
) -> tuple[threading.Thread, list[BaseException | str]]:
    result: list[BaseException | str] = []

    def run() -> None:
        try:
            result.append(write(url, state, check=check, options=options))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _on_call(number: int, action: Callable[[], None]) -> Callable[[], None]:
    calls = 0

    def check() -> None:
        nonlocal calls
        calls += 1
        if calls == number:
            action()

    return check


def test_a_stalled_server_fails_the_write_after_its_deadline(own_s3_server: S3Server) -> None:
    url = f"s3://{own_s3_server.create_bucket()}/run"
    write_epoch(url, 1)
    options = {"timeout": "1s", "max_retries": "2", "retry_timeout": "4"}
    state, _ = large_state(48)
    thread, result = _write_in_thread(url, state, _on_call(4, own_s3_server.pause), options)
    thread.join(timeout=90)
    own_s3_server.resume()
    assert not thread.is_alive(), "the write did not give up on a stalled server"
    (outcome,) = result
    if isinstance(outcome, str):  # a retry got through
        assert outcome == f"{url}/epoch-000002"
    else:
        assert isinstance(outcome, lampdist.CheckpointError), outcome
        assert outcome.phase == "checkpoint"
        assert f"{url}/epoch-000002/" in str(outcome)
        loaded = read_latest_from_store(url, map_location=None, options=None)
        assert loaded is not None and loaded.training_state.loop_state.epoch == 1
        write_epoch(url, 2)  # and the next write goes through, leaving no leftovers
        assert {key.partition("/")[0] for key in keys(url)} == {"epoch-000001", "epoch-000002"}


def test_a_server_restarted_empty_fails_the_write_naming_the_object(
    own_s3_server: S3Server,
) -> None:
    bucket = own_s3_server.create_bucket()
    url = f"s3://{bucket}/run"
    write_epoch(url, 1)
    options = {"max_retries": "3", "retry_timeout": "10"}
    state, _ = large_state(48)
    thread, result = _write_in_thread(url, state, _on_call(4, own_s3_server.restart), options)
    thread.join(timeout=120)
    assert not thread.is_alive()
    (outcome,) = result
    assert isinstance(outcome, lampdist.CheckpointError), outcome
    assert outcome.phase == "checkpoint"
    assert f"{url}/epoch-000002/" in str(outcome)


def test_the_url_of_a_run_has_room_for_any_run_name(s3_url: str) -> None:
    url = f"{s3_url}/nested/{secrets.token_hex(2)}/"
    write_epoch(url, 1)
    loaded = read_latest_from_store(url, map_location=None, options=None)
    assert loaded is not None and loaded.path == f"{url.rstrip('/')}/epoch-000001"
