"""Gradient buckets: their plan, their start order during backward, and training with them."""

from __future__ import annotations

import copy
import itertools
from collections.abc import AsyncIterator, Iterable, Sequence

import anyio
import pytest
import torch

import lampdist
import lampdist._options
from lampdist import StepOptions
from lampdist._epoch import FlatParameters
from lampdist._epoch._buckets import GradientBuckets, plan_buckets
from lampdist.clique import Clique, PendingCollective, open_clique, serve_rendezvous

from ..roles.reference import make_shards, mse, reference_training

MB = 2**20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def mlp(widths: Sequence[int], seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(widths):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def covered(flat: FlatParameters, cap_bytes: int) -> list[list[int]]:
    return [list(bucket.parameters) for bucket in plan_buckets(flat, cap_bytes)]


def test_buckets_run_backwards_cover_every_parameter_once_and_respect_the_cap() -> None:
    flat = FlatParameters.create(mlp([4, 8, 8, 2]), torch.device("cpu"))
    sizes = [p.numel() * 4 for p in flat.parameters]  # float32
    for cap in (1, 40, 100, 300, 10 * MB):
        buckets = plan_buckets(flat, cap)
        order = [index for bucket in buckets for index in bucket.parameters]
        assert order == list(reversed(range(len(flat.parameters))))
        for bucket in buckets:
            nbytes = sum(sizes[i] for i in bucket.parameters)
            assert nbytes <= cap or len(bucket.parameters) == 1
            # the bucket's tensor is exactly its parameters' gradient views, back to back
            first = min(bucket.parameters)
            assert bucket.gradients.data_ptr() == flat.gradient_views[first].data_ptr()
            assert bucket.gradients.numel() * 4 == nbytes
            assert bucket.gradients.is_contiguous()
    assert len(plan_buckets(flat, 10 * MB)) == 1
    assert len(plan_buckets(flat, 1)) == len(flat.parameters)


def test_a_bucket_never_spans_two_dtypes() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3).double())
    flat = FlatParameters.create(module, torch.device("cpu"))
    assert len(flat.gradient_buffers) == 2
    buckets = plan_buckets(flat, 10 * MB)
    assert [b.gradients.dtype for b in buckets] == [torch.float64, torch.float32]
    assert [list(b.parameters) for b in buckets] == [[3, 2], [1, 0]]


@pytest.fixture
async def clique() -> AsyncIterator[Clique]:
    async with (
        serve_rendezvous(nranks=1) as clique_id,
        open_clique(nranks=1, rank=0, device="cpu", clique_id=clique_id) as clique,
    ):
        yield clique


class Recorder:
    """Starts real all-reduces and records, for each, how many gradients were complete."""

    def __init__(self, clique: Clique, flat: FlatParameters) -> None:
        self.clique = clique
        self.flat = flat
        self.started: list[tuple[int, int]] = []  # (data_ptr, gradients complete so far)
        self.complete = 0

    def hook(self, _: torch.Tensor) -> None:
        self.complete += 1

    def start(self, tensors: Sequence[torch.Tensor]) -> PendingCollective:
        self.started.append((tensors[0].data_ptr(), self.complete))
        return self.clique.start_all_reduce(tensors)


async def test_buckets_start_during_backward_in_their_fixed_order(clique: Clique) -> None:
    flat = FlatParameters.create(mlp([4, 16, 16, 16, 2]), torch.device("cpu"))
    recorder = Recorder(clique, flat)
    for parameter in flat.parameters:  # registered first: runs before the buckets' hook
        parameter.register_post_accumulate_grad_hook(recorder.hook)  # type: ignore[no-untyped-call]  # torch: unannotated
    buckets = GradientBuckets.create(0, flat, recorder.start, cap_bytes=1)
    with buckets.attached():
        buckets.arm()
        flat_input = torch.randn(5, 4)
        loss = mse(_forward(flat, flat_input), torch.zeros(5, 2))
        loss.backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        pending = buckets.start_remaining()
    assert len(pending) == len(buckets.buckets) == len(flat.parameters)
    for each in pending:
        await each
    assert [ptr for ptr, _ in recorder.started] == [b.gradients.data_ptr() for b in buckets.buckets]
    # all but the last bucket started while backward still had gradients to produce
    counts = [count for _, count in recorder.started]
    assert counts == sorted(counts)
    assert counts[0] < len(flat.parameters)


def _forward(flat: FlatParameters, x: torch.Tensor) -> torch.Tensor:
    weights = flat.parameters
    for i in range(0, len(weights), 2):
        x = torch.nn.functional.linear(x, weights[i], weights[i + 1])
        if i + 2 < len(weights):
            x = torch.tanh(x)
    return x


async def test_a_parameter_without_gradient_holds_later_buckets_until_backward_ends(
    clique: Clique,
) -> None:
    module = mlp([4, 8, 8, 2])
    flat = FlatParameters.create(module, torch.device("cpu"))
    recorder = Recorder(clique, flat)
    buckets = GradientBuckets.create(0, flat, recorder.start, cap_bytes=1)
    with buckets.attached():
        buckets.arm()
        # the last layer's bias (started first in the fixed order) gets no gradient
        x = torch.randn(3, 4)
        hidden = torch.tanh(module[0](x))
        last = module[4]
        assert isinstance(last, torch.nn.Linear)
        out = torch.nn.functional.linear(torch.tanh(module[2](hidden)), last.weight)
        mse(out, torch.zeros(3, 2)).backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        assert recorder.started == []  # bucket 0 waits, so nothing may start before it
        pending = buckets.start_remaining()
    for each in pending:
        await each
    assert [ptr for ptr, _ in recorder.started] == [b.gradients.data_ptr() for b in buckets.buckets]


async def test_a_second_gradient_after_its_bucket_left_is_an_error(clique: Clique) -> None:
    module = mlp([4, 8, 2])
    flat = FlatParameters.create(module, torch.device("cpu"))
    buckets = GradientBuckets.create(0, flat, clique.start_all_reduce, cap_bytes=1)
    with buckets.attached():
        buckets.arm()
        mse(module(torch.randn(3, 4)), torch.zeros(3, 2)).backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        with pytest.raises(lampdist.TrainingError, match=r"second gradient .* bucket_cap_mb=None"):
            mse(module(torch.randn(3, 4)), torch.zeros(3, 2)).backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        for each in buckets.start_remaining():
            await each


async def test_hooks_are_removed_when_the_pass_ends(clique: Clique) -> None:
    module = mlp([4, 8, 2])
    flat = FlatParameters.create(module, torch.device("cpu"))
    started: list[int] = []

    def start(tensors: Sequence[torch.Tensor]) -> PendingCollective:
        started.append(tensors[0].numel())
        return clique.start_all_reduce(tensors)

    buckets = GradientBuckets.create(0, flat, start, cap_bytes=1)
    with buckets.attached():
        pass
    buckets.arm()
    mse(module(torch.randn(3, 4)), torch.zeros(3, 2)).backward()  # type: ignore[no-untyped-call]  # torch: unannotated
    assert started == []
    assert all(not p._post_accumulate_grad_hooks for p in flat.parameters)


@pytest.mark.parametrize("cap", [0, -1.0, True, "25"])
def test_bucket_cap_must_be_positive_megabytes_or_none(cap: object) -> None:
    with pytest.raises(lampdist.ConfigError, match="bucket_cap_mb must be > 0"):
        StepOptions(bucket_cap_mb=cap)  # type: ignore[arg-type]  # the point of the test


def test_the_bucket_cap_is_a_setting_every_rank_must_share() -> None:
    assert ("bucket_cap_mb", "8") in StepOptions(bucket_cap_mb=8).agreed_fields()
    assert ("bucket_cap_mb", "None") in StepOptions(bucket_cap_mb=None).agreed_fields()


class WithUnused(torch.nn.Module):
    """A model whose ``spare`` parameter never gets a gradient and whose ``shared`` layer is
    applied twice (its gradient accumulates from both uses before its hook runs)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.first = torch.nn.Linear(3, 6).double()
        self.spare = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.shared = torch.nn.Linear(6, 6).double()
        self.last = torch.nn.Linear(6, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))
        out: torch.Tensor = self.last(h)
        return out


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("step_on", ["root", "every_rank", "sharded"])
async def test_unused_and_shared_parameters_train_exactly_with_tiny_buckets(
    step_on: lampdist._options.StepOn,
) -> None:
    train = make_shards([[5, 7, 3], [6, 2, 4]], seed=1)
    valid = make_shards([[5], [3]], seed=2)
    initial = WithUnused()
    expected, _, _ = reference_training(initial, sgd, train, valid, epochs=2)
    modules = [copy.deepcopy(initial) for _ in range(2)]
    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(m, mse),
                    train_batches=(lambda t=t: list(t)),
                    validation_batches=(lambda v=v: list(v)),
                )
                for m, t, v in zip(modules, train, valid, strict=True)
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=2),
            step=lampdist.StepOptions(step_on=step_on, bucket_cap_mb=1e-9),
        )
    for module in modules:
        for (name, got), want in zip(
            module.state_dict().items(), expected.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=name)
