"""A step's meta and root values riding behind the flat buffers, on real Gloo cliques."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
import torch

import lampdist
import lampdist._options
from lampdist._epoch import FlatParameters
from lampdist._epoch._flat import META_SLOTS, ROOT_VALUES_BYTES
from lampdist._epoch._values import (
    read_meta,
    read_root_values,
    root_values_receiver,
    write_meta,
    write_root_values,
)
from lampdist.clique import Clique

from ..clique._helpers import run_ranks
from ..roles.reference import Batch, make_model, make_shards, mse, reference_training

CPU = torch.device("cpu")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def linear(fan_in: int, fan_out: int, *, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(fan_in, fan_out).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 1), (3, 3), (5, 4)], ids=["3", "12", "24"])
def test_tails_sit_behind_the_buffers_without_touching_the_parameters(
    dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    module = linear(*shape, dtype=dtype)
    before = [p.detach().clone() for p in module.parameters()]
    flat = FlatParameters.create(module, CPU)
    (storage,), (buffer,) = flat.parameter_storage, flat.parameter_buffers
    assert buffer.data_ptr() == storage.data_ptr()
    assert flat.root_values_tail is not None and flat.root_values_tail.dtype == torch.uint8
    assert flat.root_values_tail.numel() == ROOT_VALUES_BYTES
    offset = flat.root_values_tail.data_ptr() - storage.data_ptr()
    assert offset >= buffer.numel() * buffer.element_size() and offset % 8 == 0
    flat.root_values_tail.fill_(255)  # garbage behind the parameters changes none of them
    for parameter, want in zip(module.parameters(), before, strict=True):
        assert torch.equal(parameter, want)
    (grad_storage,), (grads,) = flat.gradient_storage, flat.gradient_buffers
    if dtype in (torch.float32, torch.float64):
        assert flat.meta_tail is not None and flat.meta_tail.dtype == dtype
        assert flat.meta_tail.numel() == META_SLOTS
        assert grad_storage.numel() == grads.numel() + META_SLOTS
    else:  # half precision cannot count examples: the meta values travel on their own
        assert flat.meta_tail is None and grad_storage.numel() == grads.numel()


def test_meta_rides_on_the_first_buffer_that_can_carry_it() -> None:
    module = torch.nn.Sequential(
        torch.nn.Linear(3, 2).to(torch.bfloat16), torch.nn.Linear(2, 2).to(torch.float32)
    )
    flat = FlatParameters.create(module, CPU)
    assert [b.dtype for b in flat.gradient_storage] == [torch.bfloat16, torch.float32]
    assert flat.meta_tail is not None and flat.meta_tail.dtype == torch.float32
    assert flat.meta_tail.data_ptr() == (
        flat.gradient_buffers[1].data_ptr() + flat.gradient_buffers[1].numel() * 4
    )
    assert flat.root_values_tail is not None  # the root values go behind the bf16 parameters


def test_zeroing_the_gradients_clears_the_meta_tail() -> None:
    flat = FlatParameters.create(linear(3, 3, dtype=torch.float32), CPU)
    write_meta(flat, 7, torch.tensor(1.5, dtype=torch.float64), True, tail=True)
    assert read_meta(flat, None).tolist() == [7.0, 1.5, 1.0]
    flat.zero_gradients()
    assert read_meta(flat, None).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
async def test_summed_meta_counts_examples_exactly_beyond_float32_precision(
    dtype: torch.dtype,
) -> None:
    # 2**30 + odd counts: far past the 2**24 integers float32 holds exactly
    examples = [2**30 + 4097, 3 * 2**28 + 1, 12345]
    losses = [0.1, 2.5e3, 7.25]

    async def body(clique: Clique) -> list[float]:
        flat = FlatParameters.create(linear(5, 4, dtype=dtype), CPU)
        loss = torch.tensor(losses[clique.rank], dtype=torch.float64)
        more = clique.rank == 1
        assert write_meta(flat, examples[clique.rank], loss, more, tail=True) is None
        await clique.all_reduce(flat.gradient_storage)
        return list(read_meta(flat, None).tolist())

    with anyio.fail_after(30):
        results = await run_ranks(3, body)
    for total_examples, loss_sum, more in results:
        assert total_examples == sum(examples)
        assert loss_sum == pytest.approx(sum(losses), rel=1e-7 if dtype == torch.float32 else 0)
        assert more == 1.0


async def test_meta_without_a_tail_travels_as_float64() -> None:
    flat = FlatParameters.create(linear(3, 3, dtype=torch.bfloat16), CPU)
    meta = write_meta(flat, 2**40 + 1, torch.tensor(0.25, dtype=torch.float64), False, tail=True)
    assert meta is not None and meta.dtype == torch.float64
    assert read_meta(flat, meta).tolist() == [2**40 + 1, 0.25, 0.0]
    flat32 = FlatParameters.create(linear(3, 3, dtype=torch.float32), CPU)
    assert (
        write_meta(flat32, 3, torch.tensor(0.5, dtype=torch.float64), True, tail=False) is not None
    )


@pytest.mark.parametrize("ask", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
async def test_root_values_reach_every_follower_bit_for_bit(dtype: torch.dtype, ask: bool) -> None:
    scale = 65536.0 + 2**-20  # not representable in bf16 or float32: a bit copy keeps it

    async def body(clique: Clique) -> tuple[list[float], bool]:
        flat = FlatParameters.create(linear(5, 3, dtype=dtype), CPU)
        parameters = [p.detach().clone() for p in flat.parameters]
        if clique.rank == 0:
            assert write_root_values(flat, False, scale, CPU, ask=ask, nominal=48) is None
            values = None
        else:
            for parameter in flat.parameters:
                parameter.data.zero_()  # the root's values must arrive
            values = root_values_receiver(flat, CPU)
            assert values is None
        await clique.broadcast(flat.parameter_storage, root=0)
        same = all(torch.equal(p, q) for p, q in zip(flat.parameters, parameters, strict=True))
        return list(read_root_values(flat, values).tolist()), same

    with anyio.fail_after(30):
        results = await run_ranks(3, body)
    for values, same in results:
        assert values == [0.0, scale, 1.0 if ask else 0.0, 48.0]
        assert same


def float32_shards(sizes: Sequence[Sequence[int]], seed: int) -> list[list[Batch]]:
    return [[(x.float(), y.float()) for x, y in shard] for shard in make_shards(sizes, seed=seed)]


@pytest.mark.parametrize("step_on", ["root", "every_rank", "sharded"])
async def test_float32_model_trains_like_one_process(step_on: lampdist._options.StepOn) -> None:
    sizes = [[5, 7, 3, 9, 2], [6, 6], []]
    train = float32_shards(sizes, seed=1)
    valid = float32_shards([[5, 3]] * 3, seed=2)
    initial = make_model().float()

    def adamw(params: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=0.01)  # type: ignore[arg-type]  # an iterable of parameters

    expected, train_losses, valid_losses = reference_training(
        initial, adamw, train, valid, epochs=2
    )
    modules = [make_model(seed=10 + rank).float() for rank in range(3)]
    modules[0].load_state_dict(initial.state_dict())
    with anyio.fail_after(60):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse),
                    train_batches=lambda t=t: list(t),
                    validation_batches=lambda v=v: list(v),
                )
                for module, t, v in zip(modules, train, valid, strict=True)
            ],
            optimizer_factory=adamw,
            loop=lampdist.LoopOptions(max_epochs=2),
            step=lampdist.StepOptions(step_on=step_on),
        )
    for module in modules:
        for (name, got), want in zip(
            module.state_dict().items(), expected.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(got, want, msg=name)
    assert [p.training_loss for p in state.learning_curve] == pytest.approx(train_losses, rel=1e-5)
    assert [p.validation_loss for p in state.learning_curve] == pytest.approx(
        valid_losses, rel=1e-5
    )
