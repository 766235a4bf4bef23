"""A rank alone on a GPU trains as a plain PyTorch loop does (run on the GPU machine).

Alone, lampdist exchanges nothing and steps as a plain loop: one batch's mean loss, backward,
optimizer step, gradients set to None. On the same GPU in float64 the results agree to
rounding; with accumulation the losses are weighted by their share of the step's examples
before backward instead of averaging the concatenated batch.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Iterable, Sequence

import pytest
import torch

import lampdist

from .reference import Batch, make_model, make_shards, mse, reference_training

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def adam(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def on_gpu(batches: Sequence[Batch]) -> list[Batch]:
    return [(x.to("cuda:0"), y.to("cuda:0")) for x, y in batches]


@pytest.mark.parametrize("accumulate", [1, 3])
async def test_a_rank_alone_on_a_gpu_matches_a_plain_loop(accumulate: int) -> None:
    train = make_shards([[5, 7, 3, 9, 2, 8, 0, 4]], seed=1)
    valid = make_shards([[5, 3]], seed=2)
    initial = make_model().to("cuda:0")
    expected, train_losses, valid_losses = reference_training(
        initial, adam, [on_gpu(train[0])], [on_gpu(valid[0])], epochs=3, accumulate=accumulate
    )
    module = copy.deepcopy(initial)
    state = await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, mse),
                train_batches=functools.partial(on_gpu, train[0]),
                validation_batches=functools.partial(on_gpu, valid[0]),
            )
        ],
        optimizer_factory=adam,
        loop=lampdist.LoopOptions(max_epochs=3),
        step=lampdist.StepOptions(accumulate_gradient_over_n_batches=accumulate),
    )
    for (name, got), want in zip(
        module.state_dict().items(), expected.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=name)
    assert [p.training_loss for p in state.learning_curve] == pytest.approx(train_losses, rel=1e-9)
    assert [p.validation_loss for p in state.learning_curve] == pytest.approx(
        valid_losses, rel=1e-9
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
async def test_a_rank_alone_on_a_gpu_trains_with_autocast(dtype: torch.dtype) -> None:
    train = [(x.float(), y.float()) for x, y in on_gpu(make_shards([[16] * 12], seed=3)[0])]
    module = make_model().float().to("cuda:0")
    before = [p.detach().clone() for p in module.parameters()]
    state = await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, mse),
                train_batches=lambda: train,
                validation_batches=None,
            )
        ],
        optimizer_factory=adam,
        loop=lampdist.LoopOptions(max_epochs=2),
        step=lampdist.StepOptions(autocast_dtype=dtype),
    )
    assert all(math.isfinite(p.training_loss) for p in state.learning_curve)
    assert state.learning_curve[-1].training_loss < state.learning_curve[0].training_loss
    assert any(not torch.equal(a, b) for a, b in zip(module.parameters(), before, strict=True))
