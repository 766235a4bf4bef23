"""Telemetry on a CUDA rank: the step split from timing events, the gradient norm on the
device, and FLOPs counted under autocast (run with tests/run_gpu.py)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import anyio
import pytest
import torch

import lampdist

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


Batch = tuple[torch.Tensor, torch.Tensor]


def _batches(count: int, size: int, width: int, dtype: torch.dtype) -> list[Batch]:
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(size, width, generator=generator, dtype=dtype),
            torch.randn(size, 1, generator=generator, dtype=dtype),
        )
        for _ in range(count)
    ]


def _model(width: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    ).to(dtype)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


async def _train(
    module: torch.nn.Module,
    batches: Sequence[Batch],
    step: lampdist.StepOptions,
    *,
    flops: float | str | None = None,
) -> list[lampdist.PassEvent]:
    events: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.done and event.kind == "train":
            events.append(event)

    with anyio.fail_after(120):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(
                        module.cuda(),
                        mse,
                        flops_per_example=flops,  # type: ignore[arg-type]
                    ),
                    train_batches=lambda: list(batches),
                )
            ],
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=1e-3),
            loop=lampdist.LoopOptions(max_epochs=2, on_event=on_event),
            step=step,
        )
    return events


async def test_the_step_split_from_timing_events_covers_the_pass() -> None:
    """The device's time between the events of the steps' parts adds up to the pass's time
    (the device is the bottleneck: its time is the wall time) within 5%; forward and backward
    dominate a model of wide matrices."""
    batches = _batches(40, 2048, 4096, torch.float32)
    events = await _train(_model(4096, torch.float32), batches, lampdist.StepOptions())
    for event in events:
        (split,) = event.step_split
        assert split.steps == 40
        assert split.seconds == pytest.approx(event.seconds, rel=0.05)
        assert split.forward_backward > 0.5 * split.seconds
        assert min(split.data, split.exchange, split.optimizer, split.idle) >= 0


async def test_the_gradient_norm_on_the_device_is_clip_grad_norm() -> None:
    """float64 on the GPU: each pass's one step's norm is ``clip_grad_norm_``'s (1e-9)."""
    batches = _batches(1, 64, 32, torch.float64)
    initial = _model(32, torch.float64)
    reference = copy.deepcopy(initial).cuda()
    x, y = (t.cuda() for t in batches[0])
    mse(reference(x), y).backward()  # type: ignore[no-untyped-call]
    want = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")))
    events = await _train(copy.deepcopy(initial), batches, lampdist.StepOptions(grad_norm=True))
    assert events[0].grad_norm == pytest.approx(want, rel=0, abs=1e-9)


async def test_flops_are_counted_under_autocast_and_mfu_uses_the_table() -> None:
    """A bf16 run counts, per example, both layers' forward and weight gradient and the
    second layer's input gradient (the first needs none): 4 w^2 + 6 w FLOPs; on a GPU of the
    table it reports an MFU between 0 and 1."""
    width = 4096
    module = _model(width, torch.float32)
    batches = _batches(20, 1024, width, torch.float32)
    events = await _train(
        module, batches, lampdist.StepOptions(autocast_dtype=torch.bfloat16), flops="count"
    )
    want = 2 * width * width * 2 + 2 * width * 2  # forward and weight gradients, both layers
    want += 2 * width * 1  # the second layer's input gradient (the first needs none)
    assert events[0].flops_per_example == pytest.approx(want, rel=0.02)
    name = torch.cuda.get_device_name()
    if any(known in name for known in ("H100", "H200", "A100")):
        assert events[-1].mfu is not None and 0 < events[-1].mfu < 1
