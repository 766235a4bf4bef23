"""Failures, bad input and cancellation in the single-process loop end every rank promptly."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import anyio
import attrs
import pytest
import torch

import lampdist
import lampdist._options

from .reference import Batch, make_model, make_shards, mse


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def source(batches: Sequence[Batch]) -> lampdist.BatchSource:
    return lambda: list(batches)


def entries(
    nranks: int = 2, models: Sequence[torch.nn.Module] | None = None, loss: Any = mse
) -> list[lampdist.ModelWithData]:
    shards = make_shards([[4, 4, 4]] * nranks, seed=7)
    models = models or [make_model() for _ in range(nranks)]
    return [
        lampdist.ModelWithData(
            model=lampdist.SupervisedModel(m, loss),
            train_batches=source(s),
            validation_batches=source(s),
        )
        for m, s in zip(models, shards, strict=True)
    ]


def with_loss(entry: lampdist.ModelWithData, loss: Any) -> lampdist.ModelWithData:
    return attrs.evolve(entry, model=lampdist.SupervisedModel(entry.model.module, loss))


async def run(
    streams: Sequence[lampdist.ModelWithData],
    loop: lampdist.LoopOptions | None = None,
    step: lampdist.StepOptions | None = None,
) -> lampdist.LoopState:
    with anyio.fail_after(20):
        return await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=streams,
            optimizer_factory=sgd,
            loop=loop or lampdist.LoopOptions(max_epochs=2),
            step=step or lampdist.StepOptions(),
        )


async def test_exception_in_a_followers_loss_names_that_rank_and_phase() -> None:
    def failing_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("boom")

    streams = entries(3)
    streams[2] = with_loss(streams[2], failing_loss)
    with pytest.raises(lampdist.TrainingError) as caught:
        await run(streams)
    assert (caught.value.rank, caught.value.phase) == (2, "train")
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


async def test_exception_in_the_roots_checkpoint_stops_everyone() -> None:
    async def checkpoint(state: lampdist.TrainingState, lr_state: object) -> None:
        raise OSError("disk full")

    with pytest.raises(lampdist.CheckpointError, match="disk full") as caught:
        await run(entries(3), lampdist.LoopOptions(max_epochs=2, checkpoint_state=checkpoint))
    assert (caught.value.rank, caught.value.phase) == (0, "checkpoint")
    assert isinstance(caught.value.__cause__, OSError)


async def test_a_batch_source_that_raises_names_rank_and_phase() -> None:
    def broken() -> list[Batch]:
        raise RuntimeError("no data")

    streams = entries(2)
    streams[1] = attrs.evolve(streams[1], train_batches=broken)
    with pytest.raises(lampdist.TrainingError, match="no data") as caught:
        await run(streams)
    assert (caught.value.rank, caught.value.phase) == (1, "train")


async def test_a_batch_of_the_wrong_shape_is_a_bad_batch() -> None:
    streams = entries(2)
    streams[0] = attrs.evolve(streams[0], train_batches=lambda: [torch.zeros(3)])  # type: ignore[arg-type]  # on purpose
    with pytest.raises(lampdist.BadBatch) as caught:
        await run(streams)
    assert (caught.value.rank, caught.value.phase) == (0, "train")


async def test_models_that_differ_between_ranks_are_refused_before_training() -> None:
    trained: list[int] = []

    class Counting(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.inner = make_model(width=width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            trained.append(1)
            return self.inner(x)  # type: ignore[no-any-return]

    streams = entries(3, models=[Counting(6), Counting(6), Counting(7)])
    with pytest.raises(lampdist.MismatchError, match=r"ranks \[2\] have model") as caught:
        await run(streams)
    assert trained == []
    # The error names what differs, not only who.
    assert (
        "rank 2: parameter 'inner.0.weight': shape (7, 3), torch.float64, requires_grad=True "
        "(the root: shape (6, 3), torch.float64, requires_grad=True)"
    ) in str(caught.value)


async def test_a_mismatch_names_missing_and_extra_parameters_and_buffers() -> None:
    root_model = make_model()
    other = torch.nn.Sequential(*list(make_model().children())[:2])  # no layer '2'
    other.register_buffer("running", torch.zeros(2))
    other.register_buffer("count", torch.zeros(1))
    with pytest.raises(lampdist.MismatchError) as caught:
        await run(entries(2, models=[root_model, other]))
    message = str(caught.value)
    assert "rank 1: no parameter '2.weight' (the root: shape (1, 6), torch.float64" in message
    assert "no parameter '2.bias' (the root: shape (1,)" in message
    assert "buffer 'running': shape (2,), torch.float32 (the root has none)" in message
    assert "; and 1 more)" in message  # the buffer 'count': three differences are shown
    assert message.count("rank 1:") == 1


async def test_validation_on_some_ranks_only_is_a_mismatch() -> None:
    streams = entries(2)
    streams[1] = attrs.evolve(streams[1], validation_batches=None)
    with pytest.raises(
        lampdist.MismatchError,
        match=r"rank 1: validation_batches given: False \(the root: True\)",
    ):
        await run(streams)


@pytest.mark.parametrize("step_on", ["root", "sharded"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
async def test_non_finite_loss_raises_naming_epoch_and_step(
    value: float, step_on: lampdist._options.StepOn
) -> None:
    def poisoned(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return mse(output, target) * value

    streams = entries(2)
    streams[1] = with_loss(streams[1], poisoned)
    with pytest.raises(lampdist.NonFiniteLoss, match="epoch 0, step 0"):
        await run(streams, step=lampdist.StepOptions(step_on=step_on))


@pytest.mark.parametrize("step_on", ["root", "sharded"])
async def test_non_finite_loss_can_skip_the_step(step_on: lampdist._options.StepOn) -> None:
    calls = 0

    def sometimes_nan(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return mse(output, target) * (math.nan if calls == 2 else 1.0)

    streams = entries(2)
    before = [p.detach().clone() for p in streams[0].model.module.parameters()]
    streams[1] = with_loss(streams[1], sometimes_nan)
    state = await run(
        streams,
        lampdist.LoopOptions(max_epochs=1),
        lampdist.StepOptions(non_finite_loss="skip", step_on=step_on),
    )
    assert math.isfinite(state.learning_curve[0].training_loss)
    after = list(streams[0].model.module.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


async def test_cancelling_the_loop_from_outside_ends_every_rank() -> None:
    yielded = 0
    training = anyio.Event()  # every rank has taken a few batches

    async def slow() -> Any:
        nonlocal yielded
        for batch in make_shards([[4] * 1000], seed=8)[0]:
            await anyio.sleep(0.01)
            yielded += 1
            if yielded >= 3 * 5:
                training.set()
            yield batch

    ended: list[str] = []

    async def run_and_note() -> None:
        try:
            await run(streams)
        finally:
            ended.append("loop")

    streams = entries(3)
    streams = [attrs.evolve(entry, train_batches=slow) for entry in streams]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(run_and_note)
            await training.wait()
            assert len(_lampdist_threads(prefix="lampdist-compute-")) == 3  # every rank runs
            group.cancel_scope.cancel()
    assert group.cancel_scope.cancelled_caught
    assert ended == ["loop"]
    # Every rank ended: their compute threads, and every other thread lampdist started.
    assert _lampdist_threads() == []


def _lampdist_threads(prefix: str = "lampdist") -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


@pytest.mark.parametrize(
    ("options", "kwargs", "match"),
    [
        (lampdist.LoopOptions, {"max_epochs": -1}, "max_epochs"),
        (lampdist.LoopOptions, {"max_epochs": 1, "validation_frequency": 0}, "frequency"),
        (
            lampdist.LoopOptions,
            {"max_epochs": 1, "validation_loss_exponential_smoothing_factor": 0.0},
            "smoothing",
        ),
        (lampdist.StepOptions, {"accumulate_gradient_over_n_batches": 0}, "accumulate"),
        (lampdist.StepOptions, {"autocast_dtype": torch.float64}, "autocast_dtype"),
        (lampdist.Timeouts, {"collective": 0}, "Timeouts.collective"),
    ],
)
def test_invalid_options_are_config_errors(
    options: type[Any], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(lampdist.ConfigError, match=match):
        options(**kwargs)
