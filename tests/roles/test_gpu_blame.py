"""What a failed step names on CUDA (run on the GPU machine), where a step's values are read
back some steps later unless the skip policy or float16 loss scaling reads them at once: the
ranks whose own loss was not finite where every rank can be asked, else the rank's own."""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Callable, Iterable
from typing import Literal

import anyio
import pytest
import torch

import lampdist
import lampdist._options
from lampdist._epoch._tally import Tally

from .reference import make_model, make_shards, mse

pytestmark = pytest.mark.gpu

needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices and NCCL",
)

NAN_SUM = "the summed loss of the step is nan"
GATHERED = f"the loss of rank 1 was nan ({NAN_SUM})"
NOT_GATHERED = "the other ranks' own losses were not gathered"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def nan_at_step_1() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    calls = 0

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return mse(output, target) * (math.nan if calls == 2 else 1.0)

    return loss


async def train(
    nranks: int,
    step: lampdist.StepOptions,
    *,
    poisoned: int | None,
    wide_batch: int | None = None,
) -> lampdist.LoopState:
    shards = make_shards([[4] * 40] * nranks, seed=5)
    data = []
    for rank, shard in enumerate(shards):
        device = f"cuda:{rank}"
        batches = [(x.float().to(device), y.float().to(device)) for x, y in shard]
        if wide_batch is not None and rank == nranks - 1:
            inputs, target = batches[wide_batch]
            batches[wide_batch] = (torch.cat([inputs, inputs[:, :1]], dim=1), target)
        loss = nan_at_step_1() if rank == poisoned else mse
        model = lampdist.SupervisedModel(make_model().float().to(device), loss)
        data.append(lampdist.ModelWithData(model=model, train_batches=lambda b=batches: list(b)))
    several = pytest.warns(RuntimeWarning, match="one process per GPU")
    with anyio.fail_after(120), several if nranks > 1 else contextlib.nullcontext():
        return await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=data,
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=1),
            step=step,
        )


async def raised(nranks: int, step: lampdist.StepOptions) -> lampdist.NonFiniteLoss:
    with pytest.raises(lampdist.NonFiniteLoss) as caught:
        await train(nranks, step, poisoned=nranks - 1)
    return caught.value


@needs_a_gpu
async def test_a_rank_alone_on_a_gpu_names_itself(caplog: pytest.LogCaptureFixture) -> None:
    error = await raised(1, lampdist.StepOptions())
    assert error.message == (
        f"epoch 0, step 1: the loss of rank 0 was nan ({NAN_SUM}); pass non_finite_loss='skip' "
        "to skip such steps (on CUDA the check may lag the step by up to 16 steps)"
    )
    caplog.set_level(logging.WARNING, logger="lampdist._epoch")
    await train(1, lampdist.StepOptions(non_finite_loss="skip"), poisoned=0)
    warnings = [r.getMessage() for r in caplog.records if "skipping the step" in r.getMessage()]
    assert warnings == [
        f"epoch 0, step 1: skipping the step: the loss of rank 0 was nan ({NAN_SUM})"
    ]


@needs_a_gpu
@pytest.mark.parametrize("value", [math.nan, 2.5])
def test_a_step_read_back_later_names_the_ranks_own_loss(value: float) -> None:
    """On CUDA the tally reads a step's values back some steps later, when this rank alone
    cannot ask the others: it names its own loss of that step, kept with the step."""
    tally = Tally(rank=1, epoch=3, nranks=2)
    device = torch.device("cuda:0")
    finite = torch.tensor([4.0, 1.0, 1.0], dtype=torch.float64, device=device)
    tally.submit(0, finite, own=torch.tensor(0.5, dtype=torch.float64, device=device))
    summed = torch.tensor([8.0, math.nan, 1.0], dtype=torch.float64, device=device)
    tally.submit(1, summed, own=torch.tensor(value, dtype=torch.float64, device=device))
    with pytest.raises(lampdist.NonFiniteLoss) as caught:
        tally.drain()
    own = (
        "the loss of rank 1 was nan"
        if math.isnan(value)
        else "the loss of rank 1 was finite, another rank's was not"
    )
    assert caught.value.message == (
        f"epoch 3, step 1: {own} ({NAN_SUM}; {NOT_GATHERED}); pass non_finite_loss='skip' to "
        "skip such steps (on CUDA the check may lag the step by up to 16 steps)"
    )
    assert tally.examples == 4  # the step before counted


@needs_a_gpu
async def test_a_batch_of_the_wrong_shape_on_a_gpu_names_its_shapes() -> None:
    with pytest.raises(lampdist.TrainingError) as caught:
        await train(1, lampdist.StepOptions(), poisoned=None, wide_batch=3)
    assert caught.value.message.startswith("epoch 0, batch 3: the model raised RuntimeError")
    assert caught.value.message.endswith("(inputs float32[4, 4], target float32[4, 1])")


@needs_two_gpus
@pytest.mark.parametrize(
    ("step_on", "autocast", "named"),
    [
        # fp16 loss scaling: every rank reads each step's values at once (the root's
        # followers the loss scale): the ranks are gathered.
        ("root", torch.float16, "gathered"),
        ("sharded", torch.float16, "gathered"),
        # Read back later, each rank at its own pace: a rank names itself only.
        ("root", None, "own"),
        ("every_rank", None, "own"),
    ],
)
async def test_two_gpus_name_the_rank_where_every_rank_reads_at_once(
    step_on: lampdist._options.StepOn,
    autocast: torch.dtype | None,
    named: Literal["gathered", "own"],
) -> None:
    error = await raised(2, lampdist.StepOptions(step_on=step_on, autocast_dtype=autocast))
    assert error.message.startswith("epoch 0, step 1: ")
    if named == "gathered":
        assert error.message.startswith(f"epoch 0, step 1: {GATHERED}; pass ")
        return
    # The root knows its own loss was finite; with every_rank rank 1's error may come first.
    own = {
        0: f"the loss of rank 0 was finite, another rank's was not ({NAN_SUM}; {NOT_GATHERED})",
        1: f"the loss of rank 1 was nan ({NAN_SUM}; {NOT_GATHERED})",
    }
    assert error.rank is not None
    assert error.message.startswith(f"epoch 0, step 1: {own[error.rank]}; pass "), error.message
    assert re.search(r"lag the step by up to \d+ steps\)$", error.message)


@needs_two_gpus
@pytest.mark.parametrize("step_on", ["every_rank", "sharded"])
async def test_two_gpus_name_the_rank_in_the_skip_warning(
    step_on: lampdist._options.StepOn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="lampdist._epoch")
    await train(2, lampdist.StepOptions(step_on=step_on, non_finite_loss="skip"), poisoned=1)
    warnings = [r.getMessage() for r in caplog.records if "skipping the step" in r.getMessage()]
    assert warnings == [f"epoch 0, step 1: skipping the step: {GATHERED}"] * 2
