"""n in-process CPU ranks train exactly like one process on the concatenated batches."""

from __future__ import annotations

import copy
import math
import typing
from collections.abc import Callable, Iterable, Sequence

import anyio
import pytest
import torch

import lampdist
import lampdist._options
from lampdist._epoch import DESIGNS

from .reference import Batch, make_model, make_shards, mse, reference_training


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def source(batches: Sequence[Batch], *, sized: bool = True) -> lampdist.BatchSource:
    """A batch source; an unsized one (a plain iterator) makes every step carry a flag."""
    if sized:
        return lambda: list(batches)
    return lambda: iter(list(batches))


CASES = {
    "one-rank": ([[8, 8, 5]], 1),
    "even-2": ([[8, 8, 8, 8], [8, 8, 8, 8]], 1),
    "even-3-acc3": ([[4] * 6, [4] * 6, [4] * 6], 3),
    "uneven-3": ([[5, 7, 3, 9, 2], [6, 6], []], 1),
    "uneven-3-acc3": ([[5, 7, 3, 9, 2], [6, 6], []], 3),
    "empty-batches-2": ([[4, 0, 6, 0], [0, 0, 3]], 1),
    "empty-batches-2-acc3": ([[4, 0, 6, 0, 5], [0, 0, 3]], 3),
}


ONE_PARAMETER_PER_BUCKET = 1e-9  # megabytes: every parameter gets a bucket of its own


@pytest.mark.parametrize(
    ("optimizer_factory", "step_on", "sized", "bucket_cap_mb"),
    [
        (sgd, "root", True, 25.0),
        (adamw, "root", True, ONE_PARAMETER_PER_BUCKET),
        (adamw, "every_rank", True, ONE_PARAMETER_PER_BUCKET),
        (sgd, "root", False, None),
        (adamw, "every_rank", False, 25.0),
        (adamw, "sharded", True, None),
        (adamw, "sharded", True, ONE_PARAMETER_PER_BUCKET),
        (sgd, "sharded", False, 25.0),
    ],
    ids=[
        "sgd",
        "adamw-buckets",
        "adamw-every-rank-buckets",
        "sgd-unsized-unbucketed",
        "adamw-every-rank-unsized",
        "adamw-sharded",
        "adamw-sharded-buckets",
        "sgd-sharded-unsized",
    ],
)
@pytest.mark.parametrize("case", sorted(CASES))
async def test_matches_single_process_reference(
    case: str,
    optimizer_factory: OptimizerFactory,
    step_on: lampdist._options.StepOn,
    sized: bool,
    bucket_cap_mb: float | None,
) -> None:
    sizes, accumulate = CASES[case]
    nranks = len(sizes)
    train = make_shards(sizes, seed=1)
    valid = make_shards([[5, 3]] * nranks, seed=2)
    initial = make_model()
    expected, train_losses, valid_losses = reference_training(
        initial,
        optimizer_factory,
        train,
        valid,
        epochs=2,
        accumulate=accumulate,
    )
    modules = [make_model(seed=10 + rank) for rank in range(nranks)]
    modules[0].load_state_dict(initial.state_dict())  # followers start from other weights
    with anyio.fail_after(60):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse),
                    # one rank unsized is enough to need the flags
                    train_batches=source(t, sized=sized or rank > 0),
                    validation_batches=source(v),
                )
                for rank, (module, t, v) in enumerate(zip(modules, train, valid, strict=True))
            ],
            optimizer_factory=optimizer_factory,
            loop=lampdist.LoopOptions(max_epochs=2),
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
            torch.testing.assert_close(got, want, rtol=0, atol=1e-9, msg=name)
    assert [p.training_loss for p in state.learning_curve] == pytest.approx(train_losses, rel=1e-9)
    assert [p.validation_loss for p in state.learning_curve] == pytest.approx(
        valid_losses, rel=1e-9
    )
    assert state.epoch == 2


async def test_validation_runs_in_eval_mode_without_grad_and_training_in_train_mode() -> None:
    seen: list[tuple[str, bool, bool]] = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 1).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(("forward", self.training, torch.is_grad_enabled()))
            return self.linear(x)  # type: ignore[no-any-return]

    shards = make_shards([[4, 4], [4]], seed=3)
    modules = [Probe(), Probe()]
    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(m, mse),
                train_batches=source(s),
                validation_batches=source(s),
            )
            for m, s in zip(modules, shards, strict=True)
        ],
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(max_epochs=1),
    )
    train_calls = [s for s in seen if s[1]]
    eval_calls = [s for s in seen if not s[1]]
    assert train_calls and all(grad for _, _, grad in train_calls)
    assert eval_calls and not any(grad for _, _, grad in eval_calls)
    assert len(train_calls) == 3 and len(eval_calls) == 3


async def test_best_model_is_restored_on_every_rank() -> None:
    """With a learning rate that diverges after epoch 1, the best model is the early one."""
    shards = make_shards([[8, 8], [8, 8]], seed=4)
    modules = [make_model(), make_model(seed=5)]
    snapshots: list[dict[str, torch.Tensor]] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.kind == "valid":
            snapshots.append(copy.deepcopy(modules[0].state_dict()))

    schedule = lampdist.schedules.from_epoch_count(lambda epoch: 1.0 if epoch < 2 else 40.0)
    state = await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(m, mse),
                train_batches=source(s),
                validation_batches=source(s),
            )
            for m, s in zip(modules, shards, strict=True)
        ],
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(
            max_epochs=5,
            learning_rate_schedule=schedule,
            return_min_validation_loss_model=range(5),
            on_event=on_event,
        ),
    )
    assert state.min_validation_epoch is not None
    losses = [p.smoothed_validation_loss for p in state.learning_curve]
    assert state.min_validation_epoch == losses.index(min(losses))  # type: ignore[type-var]
    assert state.min_validation_epoch < 4
    best = snapshots[state.min_validation_epoch]
    for module in modules:
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, best[name]), name


async def test_progress_events_count_the_whole_clique() -> None:
    shards = make_shards([[4, 4, 4], [4, 4]], seed=6)
    events: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        events.append(event)

    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(make_model(), mse),
                train_batches=source(s),
                validation_batches=source(s),
            )
            for s in shards
        ],
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(max_epochs=1, on_event=on_event),
    )
    train = [e for e in events if e.kind == "train"]
    # The first step's event and the last one always arrive; those between are coalesced
    # when they come faster than the progress interval. Each carries the totals so far.
    assert (train[0].step, train[0].examples) == (1, 8)
    assert (train[-1].step, train[-1].examples) == (3, 20)
    assert all((e.step, e.examples) in {(1, 8), (2, 16), (3, 20)} for e in train)
    assert [e.step for e in train] == sorted({e.step for e in train})
    assert train[-1].done and not any(e.done for e in train[:-1])
    assert train[-1].total_batches == 3
    (valid,) = [e for e in events if e.kind == "valid"]
    assert valid.examples == 20 and valid.done


async def test_progress_events_count_steps_and_batches_apart() -> None:
    """With two batches a step, each event's step and the root's batches so far differ."""
    shards = make_shards([[4, 4, 4, 4], [4, 4, 4, 4]], seed=6)
    events: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        events.append(event)

    await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(make_model(), mse), train_batches=source(s)
            )
            for s in shards
        ],
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(max_epochs=1, on_event=on_event),
        step=lampdist.StepOptions(accumulate_gradient_over_n_batches=2),
    )
    assert (events[0].step, events[0].batches, events[0].examples) == (1, 2, 16)
    assert (events[-1].step, events[-1].batches, events[-1].examples) == (2, 4, 32)
    assert all(e.batches == 2 * e.step and e.total_batches == 4 for e in events)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
async def test_mixed_precision_trains_and_keeps_ranks_equal(
    dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    """fp16 with a loss this large overflows at the initial loss scale: the root must skip
    those steps and lower the scale, and training still moves the weights."""

    def big_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return mse(output, target) * 1e4

    caplog.set_level("INFO", logger="lampdist._epoch")
    shards = make_shards([[8] * 10, [8] * 10], seed=9)
    modules = [make_model().float() for _ in shards]
    before = [p.detach().clone() for p in modules[0].parameters()]
    state = await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(m, big_loss),
                train_batches=source(_as_float(s)),
                validation_batches=None,
            )
            for m, s in zip(modules, shards, strict=True)
        ],
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=1e-6),
        loop=lampdist.LoopOptions(max_epochs=2),
        step=lampdist.StepOptions(autocast_dtype=dtype),
    )
    assert all(math.isfinite(p.training_loss) for p in state.learning_curve)
    overflowed = [r for r in caplog.records if "overflowed" in r.getMessage()]
    assert bool(overflowed) == (dtype == torch.float16)
    after = list(modules[0].parameters())
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    for a, b in zip(modules[0].parameters(), modules[1].parameters(), strict=True):
        assert torch.equal(a, b)


def _as_float(batches: Sequence[Batch]) -> list[Batch]:
    return [(x.float(), y.float()) for x, y in batches]


async def _train_in_process(
    shards: Sequence[Sequence[Batch]],
    initial: torch.nn.Module,
    optimizer_factory: OptimizerFactory,
    step: lampdist.StepOptions,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse,
) -> list[torch.nn.Module]:
    """The ranks' modules after two epochs on ``shards``; followers start from other weights."""
    modules = [copy.deepcopy(initial)] + [
        make_model(seed=10 + rank).to(next(initial.parameters()).dtype)
        for rank in range(1, len(shards))
    ]
    with anyio.fail_after(60):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, loss), train_batches=source(shard)
                )
                for module, shard in zip(modules, shards, strict=True)
            ],
            optimizer_factory=optimizer_factory,
            loop=lampdist.LoopOptions(max_epochs=2),
            step=step,
        )
    return modules


def _assert_weights(
    modules: Sequence[torch.nn.Module], want: torch.nn.Module, *, rtol: float, atol: float
) -> None:
    for module in modules:
        for (name, got), expected in zip(
            module.state_dict().items(), want.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=name)


def test_every_step_on_value_has_a_design() -> None:
    """A design added to ``DESIGNS`` is a ``step_on`` value, and the reverse."""
    assert set(DESIGNS) == set(typing.get_args(lampdist._options.StepOn))


IN_PROCESS = sorted(step_on for step_on, design in DESIGNS.items() if not design.own_process)
"""The designs the in-process loop runs (fsdp's exactness is in test_fsdp.py, in processes)."""


@pytest.mark.parametrize("step_on", IN_PROCESS)
@pytest.mark.parametrize("bucket_cap_mb", [None, ONE_PARAMETER_PER_BUCKET])
async def test_every_design_matches_the_single_process_reference(
    step_on: lampdist._options.StepOn, bucket_cap_mb: float | None
) -> None:
    """Every design, including one added later: uneven ranks, an empty batch, accumulation,
    AdamW; the update equals one process stepping on the concatenated batches."""
    train = make_shards([[5, 7, 3], [6, 0, 6, 2]], seed=11)
    initial = make_model()
    expected, _, _ = reference_training(initial, adamw, train, None, epochs=2, accumulate=2)
    options = lampdist.StepOptions(
        step_on=step_on, bucket_cap_mb=bucket_cap_mb, accumulate_gradient_over_n_batches=2
    )
    modules = await _train_in_process(train, initial, adamw, options)
    _assert_weights(modules, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("step_on", IN_PROCESS)
@pytest.mark.parametrize("sizes", [[[5, 7, 3], [6, 6]], [[5, 7, 3], [6, 6], [4, 0, 8]]])
async def test_clipping_matches_clip_grad_norm_in_a_plain_loop(
    sizes: list[list[int]], step_on: lampdist._options.StepOn
) -> None:
    train = make_shards(sizes, seed=3)
    initial = make_model()
    expected, _, _ = reference_training(initial, sgd, train, None, epochs=2, max_grad_norm=0.05)
    unclipped, _, _ = reference_training(initial, sgd, train, None, epochs=2)
    weight = expected.state_dict()["0.weight"]
    assert not torch.allclose(weight, unclipped.state_dict()["0.weight"], atol=1e-3)  # it clips
    modules = await _train_in_process(
        train, initial, sgd, lampdist.StepOptions(max_grad_norm=0.05, step_on=step_on)
    )
    _assert_weights(modules, expected, rtol=0, atol=1e-9)


def big_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Large enough that float16 gradients overflow at GradScaler's initial scale (2**16)
    for the first steps, which both loops must skip while the scale backs off."""
    return mse(output, target) * 1e3


@pytest.mark.parametrize(
    ("dtype", "nranks", "step_on"),
    [
        (torch.bfloat16, 1, "root"),
        (torch.bfloat16, 2, "root"),
        (torch.bfloat16, 2, "sharded"),
        (torch.float16, 1, "root"),
        (torch.float16, 2, "root"),
        (torch.float16, 2, "every_rank"),
        (torch.float16, 2, "sharded"),
    ],
    ids=[
        "bf16-1",
        "bf16-2",
        "bf16-2-sharded",
        "fp16-1",
        "fp16-2",
        "fp16-2-every",
        "fp16-2-sharded",
    ],
)
async def test_mixed_precision_matches_autocast_and_grad_scaler_in_a_plain_loop(
    dtype: torch.dtype, nranks: int, step_on: lampdist._options.StepOn
) -> None:
    """The same updates, bitwise, as ``torch.autocast`` (and, for float16, a default
    ``GradScaler``, which skips the overflowing steps and backs off as lampdist must) in a
    plain loop that runs each rank's batch through forward and backward on its own.

    float16 on several ranks: a rank weights its batch's loss by its share of the nominal
    step (the clique's largest step so far, here every step's 16 examples) times the scale,
    as the plain loop weights it by its share of the step's examples, so the scaled
    gradients are ``GradScaler``'s and overflow where they do. The clique's first step, which
    no step before told its size, weights by example counts alone (docs/reliability.md,
    Limits): here it overflows in both loops at the initial scale."""
    train = [_as_float(shard) for shard in make_shards([[8] * 6] * nranks, seed=9)]
    initial = make_model().float()

    def sgd_small(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-5)

    expected, _, _ = reference_training(
        initial, sgd_small, train, None, epochs=2, autocast_dtype=dtype, loss=big_loss
    )
    in_float32, _, _ = reference_training(initial, sgd_small, train, None, epochs=2, loss=big_loss)
    modules = await _train_in_process(
        train,
        initial,
        sgd_small,
        lampdist.StepOptions(autocast_dtype=dtype, step_on=step_on),
        big_loss,
    )
    _assert_weights(modules, expected, rtol=0, atol=0)
    # The comparison can tell: the weights moved, and full float32 ends elsewhere.
    weight = expected.state_dict()["0.weight"]
    assert not torch.equal(weight, initial.state_dict()["0.weight"])
    assert not torch.allclose(weight, in_float32.state_dict()["0.weight"], rtol=1e-5, atol=1e-6)


async def test_sharded_fp16_loss_scaling_sees_an_overflow_in_any_slice() -> None:
    """Sharded, each rank checks only its own slice for an fp16 overflow; the ranks sum their
    counts, so they skip the same steps and back off alike: the same weights, bitwise, as
    every rank checking the whole gradient."""
    train = [_as_float(shard) for shard in make_shards([[8] * 6] * 2, seed=9)]
    initial = make_model().float()

    def sgd_small(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1e-5)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return mse(output, target) * 30  # the first steps overflow, the later ones do not

    runs = {
        step_on: await _train_in_process(
            train,
            initial,
            sgd_small,
            lampdist.StepOptions(autocast_dtype=torch.float16, step_on=step_on),
            loss,
        )
        for step_on in ("every_rank", "sharded")
    }
    _assert_weights(runs["sharded"], runs["every_rank"][0], rtol=0, atol=0)
    weight = runs["sharded"][0].state_dict()["0.weight"]
    assert not torch.equal(weight, initial.state_dict()["0.weight"])
