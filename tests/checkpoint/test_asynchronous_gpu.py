"""Asynchronous checkpoints of a model on a GPU: pinned staging ordered on the compute
stream, and the same checkpoints as synchronous writes (run on the GPU machine)."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
import torch

import lampdist
from lampdist import checkpoint
from lampdist._checkpoint._staging import Staging

from ..roles.reference import Batch, make_model, make_shards, mse
from .test_checkpoint import committed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_a_gpu_state_is_snapshotted_on_the_gpu_before_later_kernels_change_it() -> None:
    weight = torch.randn(4096, 1024, device="cuda:0")
    expected = weight.cpu()
    staging = Staging()
    staged = staging.stage({"w": weight, "step": torch.tensor(3)})
    weight.mul_(3.0)  # queued after the snapshot on the same stream: must not reach it
    (copy,) = staged.finish()  # on the writer's thread, in a run
    assert staging.host.capacity == 64 and staging.pinned.pinned
    assert torch.equal(copy["w"], expected) and copy["step"].item() == 3
    assert copy["w"].device.type == "cpu"
    pointer = copy["w"].data_ptr()
    (again,) = staging.stage({"w": weight, "step": torch.tensor(4)}).finish()
    assert again["w"].data_ptr() == pointer  # the pinned buffer is reused
    assert torch.equal(again["w"], expected * 3.0)


def test_without_room_for_a_snapshot_the_state_goes_straight_to_pinned_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="lampdist")
    weight = torch.randn(4096, 1024, device="cuda:0")  # 16 MB: a segment of its own
    expected = weight.cpu()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    allowed = torch.cuda.memory_reserved(0) + (1 << 20)  # no room for a 16 MB snapshot
    torch.cuda.set_per_process_memory_fraction(allowed / total, 0)
    try:
        staging = Staging()
        staged = staging.stage({"w": weight})
        weight.mul_(3.0)
        (copy,) = staged.finish()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    assert torch.equal(copy["w"], expected) and staging.pinned.pinned
    assert "no room on cuda:0" in caplog.text


def adam(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def on_gpu(batches: Sequence[Batch]) -> list[Batch]:
    return [(x.to("cuda:0"), y.to("cuda:0")) for x, y in batches]


async def _train(module: torch.nn.Module, effect: lampdist.CheckpointState) -> None:
    train = make_shards([[5, 7, 3, 9, 2, 8, 0, 4]], seed=1)
    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, mse),
                train_batches=functools.partial(on_gpu, train[0]),
            )
        ],
        optimizer_factory=adam,
        loop=lampdist.LoopOptions(max_epochs=4, checkpoint_state=effect),
    )


async def test_asynchronous_checkpoints_of_a_gpu_model_equal_synchronous_ones(
    tmp_path: Path,
) -> None:
    initial = make_model().to("cuda:0")
    synchronous, asynchronous = copy.deepcopy(initial), copy.deepcopy(initial)
    await _train(synchronous, checkpoint.to_directory(tmp_path / "sync", keep=10))
    await _train(
        asynchronous, checkpoint.to_directory(tmp_path / "async", keep=10, asynchronous=True)
    )
    names = committed(tmp_path / "sync")
    assert names == committed(tmp_path / "async") and len(names) == 4
    for name in names:
        for kind in ("model", "optimizer"):
            sync_bytes = (tmp_path / "sync" / name / f"{kind}.tensors").read_bytes()
            async_bytes = (tmp_path / "async" / name / f"{kind}.tensors").read_bytes()
            assert async_bytes == sync_bytes, (name, kind)
