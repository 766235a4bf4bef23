"""Every entry point preloads what a first run would import, before it waits on a peer, in
a worker thread that a cancelled caller does not wait for, with the garbage collections that
the import would make deferred."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio
import pytest
import torch

import lampdist
from lampdist import _preload
from lampdist.control import local_channels
from lampdist.launch import LaunchEnv


class Preloaded(Exception):
    """What the preload raises here: the entry point got that far, and no further."""


@pytest.fixture
def failing_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail() -> None:
        raise Preloaded

    monkeypatch.setattr(_preload, "_done", threading.Event())
    monkeypatch.setattr(_preload, "_import_modules", fail)


def _data() -> lampdist.ModelWithData:
    model = lampdist.SupervisedModel(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss)
    return lampdist.ModelWithData(model=model, train_batches=list)


def _sgd(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1)


def _entry_points() -> dict[str, Callable[[], Awaitable[Any]]]:
    """Each entry point of a two-rank run whose peer never comes."""
    root, followers = local_channels(2)
    loop = lampdist.LoopOptions(max_epochs=1)
    return {
        "drive": lambda: lampdist.drive_distributed_training(
            nranks=2, device="cpu", control=root, data=_data(), optimizer_factory=_sgd, loop=loop
        ),
        "follow": lambda: lampdist.follow_distributed_training(
            rank=1, nranks=2, device="cpu", control=followers[0], data=_data()
        ),
        "local": lambda: lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[_data(), _data()], optimizer_factory=_sgd, loop=loop
        ),
        "train": lambda: lampdist.train(
            data=_data(),
            optimizer_factory=_sgd,
            loop=loop,
            launch=LaunchEnv(rank=1, nranks=2, port=1, secret="s"),  # nobody there
            stop_on_signals=False,
        ),
    }


@pytest.mark.usefixtures("failing_preload")
@pytest.mark.parametrize("entry", ["drive", "follow", "local", "train"])
async def test_every_entry_point_preloads_before_it_waits_on_a_peer(entry: str) -> None:
    with anyio.fail_after(10), pytest.raises(Preloaded):
        await _entry_points()[entry]()


async def test_a_cancelled_preload_does_not_wait_for_the_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    monkeypatch.setattr(_preload, "_done", threading.Event())
    monkeypatch.setattr(_preload, "_import_modules", lambda: release.wait(10))
    threading.Timer(2.0, release.set).start()  # the import ends, whatever the preload does
    started = time.monotonic()
    with anyio.move_on_after(0.05):
        await _preload.preload()
    assert not release.is_set(), f"the cancelled preload waited {time.monotonic() - started} s"
    release.set()


async def test_a_preload_imports_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    done = threading.Event()

    def count() -> None:
        calls.append(1)
        done.set()

    monkeypatch.setattr(_preload, "_done", done)
    monkeypatch.setattr(_preload, "_import_modules", count)
    for _ in range(3):
        await _preload.preload()
    assert calls == [1]


def test_the_import_makes_no_collection_and_leaves_none_to_make() -> None:
    """Collections off in the block; after it, on again, nothing left frozen, and what the
    block made in the oldest generation, where only a full collection examines it."""
    assert gc.isenabled()
    with _preload._collections_deferred():
        assert not gc.isenabled()
        made: list[list[int]] = [[] for _ in range(1000)]  # tracked objects, young
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    oldest = {id(item) for item in gc.get_objects(generation=2)}
    assert all(id(item) in oldest for item in made)


def test_collections_turned_off_or_objects_frozen_stay_so() -> None:
    gc.disable()
    try:
        with _preload._collections_deferred():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with _preload._collections_deferred():
            assert gc.isenabled()
        # Another thread of this worker may free frozen objects meanwhile; an unfreeze would
        # leave none frozen.
        assert gc.get_freeze_count() > 0.9 * frozen
    finally:
        gc.unfreeze()


EXIT_SCRIPT = """
import atexit, gc, sys
import anyio
from lampdist import _preload

# registered first, so it runs last: after the handler that the preload registers
atexit.register(lambda: sys.stdout.write(f"frozen at exit: {gc.get_freeze_count() > 0}\\n"))
anyio.run(_preload.preload)
sys.stdout.write(f"frozen before exit: {gc.get_freeze_count() > 0}\\n")
"""


def test_a_process_that_preloaded_exits_without_collecting_torch() -> None:
    """The objects are frozen only at exit, so that the interpreter's last collections skip
    them (a lampdist process exits about a second sooner: docs/reliability.md)."""
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines() == ["frozen before exit: False", "frozen at exit: True"]
