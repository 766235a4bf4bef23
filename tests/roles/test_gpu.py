"""The exactness test on two GPUs over NCCL (run on a machine with 2 CUDA devices).

float32 on CUDA: the clique sums gradients in a different order than one process summing the
concatenated batch, and cuBLAS picks different kernels for different batch sizes, so results
agree to float32 rounding, not bitwise. Each step's relative error is a few ulp (~1e-7);
over the few dozen SGD steps here it stays far below the 1e-5 relative tolerance used.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
import torch

import lampdist
import lampdist._options

from .reference import Batch, make_model, make_shards, mse, reference_training
from .test_tcp_exactness import assert_matches_the_reference, run_two_processes

pytestmark = pytest.mark.gpu

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices and NCCL",
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def on(device: str, batches: Sequence[Batch]) -> list[Batch]:
    return [(x.float().to(device), y.float().to(device)) for x, y in batches]


@needs_two_gpus
@pytest.mark.parametrize("step_on", ["root", "every_rank", "sharded"])
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 1e-9, None], ids=["bucket", "tiny", "none"])
async def test_two_gpus_match_the_single_gpu_reference(
    step_on: lampdist._options.StepOn, accumulate: int, bucket_cap_mb: float | None
) -> None:
    sizes = [[5, 7, 3, 9, 2, 8], [6, 6, 0, 4]]
    train = make_shards(sizes, seed=1)
    valid = make_shards([[5, 3], [4]], seed=2)
    initial = make_model().float()
    expected, train_losses, valid_losses = reference_training(
        copy.deepcopy(initial).to("cuda:0"),
        sgd,
        [on("cuda:0", shard) for shard in train],
        [on("cuda:0", shard) for shard in valid],
        epochs=3,
        accumulate=accumulate,
    )
    modules = [copy.deepcopy(initial).to(f"cuda:{r}") for r in range(2)]
    with pytest.warns(RuntimeWarning, match="one process per GPU"):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse),
                    train_batches=functools.partial(list, on(f"cuda:{r}", train[r])),
                    validation_batches=functools.partial(list, on(f"cuda:{r}", valid[r])),
                )
                for r, module in enumerate(modules)
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=3),
            step=lampdist.StepOptions(
                accumulate_gradient_over_n_batches=accumulate,
                step_on=step_on,
                bucket_cap_mb=bucket_cap_mb,
            ),
        )
    for module in modules:
        for (name, got), want in zip(
            module.state_dict().items(), expected.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-6, msg=name)
    for a, b in zip(modules[0].parameters(), modules[1].parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    assert [p.training_loss for p in state.learning_curve] == pytest.approx(train_losses, rel=1e-5)
    assert [p.validation_loss for p in state.learning_curve] == pytest.approx(
        valid_losses, rel=1e-5
    )


@needs_two_gpus
def test_one_process_per_gpu_over_nccl_matches_the_reference(tmp_path: Path) -> None:
    """The recommended deployment: a process per GPU, NCCL between them, TCP control. The
    follower starts from other weights, so the first broadcast over NCCL is checked too.
    float64 on the GPUs: the reference on the CPU agrees to a few ulp."""
    run_two_processes(tmp_path, "--cuda")
    assert_matches_the_reference(tmp_path)
