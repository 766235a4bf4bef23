"""Telemetry of training passes, through the in-process loop over real Gloo cliques: the
gradient norm against ``clip_grad_norm_``, the step split against the pass's time, the
straggler's name and part, tokens and MFU."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anyio
import pytest
import torch

import lampdist
from lampdist._epoch import DESIGNS
from lampdist._epoch._clock import DATA, FORWARD_BACKWARD, OPTIMIZER, HostClock
from lampdist._epoch._telemetry import STRAGGLER_PASSES, Stragglers, straggler

from ..roles.reference import Batch, make_model, make_shards, mse


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


async def _run(
    modules: Sequence[torch.nn.Module],
    sources: Sequence[lampdist.BatchSource],
    step: lampdist.StepOptions,
    *,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse,
    epochs: int = 1,
    model: Callable[[torch.nn.Module], lampdist.SupervisedModel] | None = None,
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] = sgd,
) -> list[lampdist.PassEvent]:
    """The root's last event of each training pass."""
    events: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.done and event.kind == "train":
            events.append(event)

    def supervised(module: torch.nn.Module) -> lampdist.SupervisedModel:
        return lampdist.SupervisedModel(module, loss) if model is None else model(module)

    with anyio.fail_after(120):
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(model=supervised(module), train_batches=source)
                for module, source in zip(modules, sources, strict=True)
            ],
            optimizer_factory=optimizer_factory,
            loop=lampdist.LoopOptions(max_epochs=epochs, on_event=on_event),
            step=step,
        )
    return events


def _listed(batches: Sequence[Batch]) -> lampdist.BatchSource:
    return lambda: list(batches)


# -- the gradient norm ------------------------------------------------------------------------


def _reference_norm(initial: torch.nn.Module, shards: Sequence[Sequence[Batch]]) -> float:
    """``clip_grad_norm_``'s return value for one step on the concatenation of every rank's
    batches (their mean loss over all their examples)."""
    module = copy.deepcopy(initial)
    batches = [batch for shard in shards for batch in shard]
    inputs = torch.cat([x for x, _ in batches])
    target = torch.cat([y for _, y in batches])
    mse(module(inputs), target).backward()  # type: ignore[no-untyped-call]
    return float(torch.nn.utils.clip_grad_norm_(module.parameters(), float("inf")))


IN_PROCESS = sorted(name for name, design in DESIGNS.items() if not design.own_process)


@pytest.mark.parametrize("clip", [None, 0.01], ids=["measured", "clipped"])
@pytest.mark.parametrize(
    ("step_on", "nranks"),
    [(name, 3) for name in IN_PROCESS] + [("root", 1)],
    ids=[f"{name}-3" for name in IN_PROCESS] + ["alone"],
)
async def test_gradient_norm_is_clip_grad_norm_of_the_concatenated_batches(
    step_on: lampdist._options.StepOn, nranks: int, clip: float | None
) -> None:
    """One step of two accumulated batches a rank (uneven sizes): the pass's gradient norm
    is the norm before clipping of the averaged gradients, as ``clip_grad_norm_`` returns it
    on one process that steps on every rank's batches at once (float64, 1e-9)."""
    shards = make_shards([[5, 7], [3, 9], [6, 2]][:nranks], seed=4)
    initial = make_model(seed=3)
    modules = [copy.deepcopy(initial) for _ in shards]
    step = lampdist.StepOptions(
        step_on=step_on,
        accumulate_gradient_over_n_batches=2,
        grad_norm=clip is None,
        max_grad_norm=clip,
    )
    events = await _run(modules, [_listed(shard) for shard in shards], step)
    want = _reference_norm(initial, shards)
    assert want > 0.01  # clipping would change the weights: the norm is before it
    (event,) = events
    assert event.grad_norm == pytest.approx(want, rel=0, abs=1e-9)
    assert event.grad_norm_max == pytest.approx(want, rel=0, abs=1e-9)


async def test_the_gradient_norm_is_off_by_default() -> None:
    shards = make_shards([[4, 4], [4, 4]], seed=4)
    events = await _run(
        [make_model(seed=3) for _ in shards],
        [_listed(s) for s in shards],
        lampdist.StepOptions(step_on="every_rank"),
    )
    assert events[0].grad_norm is None


def _plain_loop_norms(initial: torch.nn.Module, batches: Sequence[Batch]) -> list[float]:
    """Each step's ``clip_grad_norm_`` (before any clipping) of a plain loop over
    ``batches``, one batch a step, with the tests' SGD."""
    norms: list[float] = []
    module = copy.deepcopy(initial)
    optimizer = sgd(module.parameters())
    for x, y in batches:
        mse(module(x), y).backward()  # type: ignore[no-untyped-call]
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
    return norms


async def test_the_gradient_norm_is_the_mean_and_the_largest_of_the_pass_steps() -> None:
    """Over several steps: the mean and the largest of the steps' norms, which differ."""
    shards = make_shards([[4] * 6], seed=5)
    initial = make_model(seed=3)
    norms = _plain_loop_norms(initial, shards[0])
    (event,) = await _run(
        [copy.deepcopy(initial)], [_listed(shards[0])], lampdist.StepOptions(grad_norm=True)
    )
    assert max(norms) > min(norms) * 1.01
    assert event.grad_norm == pytest.approx(sum(norms) / len(norms), rel=1e-9)
    assert event.grad_norm_max == pytest.approx(max(norms), rel=1e-9)


async def test_the_gradient_norm_of_every_third_step() -> None:
    """``grad_norm_every=3``: the steps 0 and 3 of each pass of 5 are measured."""
    shards = make_shards([[4] * 5], seed=5)
    initial = make_model(seed=3)
    norms = _plain_loop_norms(initial, shards[0])
    (event,) = await _run(
        [copy.deepcopy(initial)],
        [_listed(shards[0])],
        lampdist.StepOptions(grad_norm=True, grad_norm_every=3),
    )
    measured = [norms[0], norms[3]]
    assert event.grad_norm == pytest.approx(sum(measured) / 2, rel=1e-9)
    assert event.grad_norm_max == pytest.approx(max(measured), rel=1e-9)


# -- the step split ---------------------------------------------------------------------------


class Paced:
    """A batch source that sleeps ``delay`` seconds before each batch (a slow loader)."""

    def __init__(self, batches: Sequence[Batch], delay: float) -> None:
        self.batches, self.delay = list(batches), delay

    def __call__(self) -> Iterator[Batch]:
        for batch in self.batches:
            time.sleep(self.delay)
            yield batch


def _wide(seed: int, sizes: Sequence[int], width: int = 64) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, width, generator=generator), torch.randn(n, 1, generator=generator))
        for n in sizes
    ]


def _wide_model(width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )


@pytest.mark.parametrize("nranks", [1, 2])
async def test_the_step_split_sums_to_the_pass_time(nranks: int) -> None:
    """Every rank's parts add up to the pass's seconds within 5% and 5 ms (the pass also holds
    its set-up and its end's reduce, which are no step's: a few milliseconds on a loaded
    machine, against a pass of about 0.2 s)."""
    sources = [Paced(_wide(rank, [32] * 30), 0.006) for rank in range(nranks)]
    step = lampdist.StepOptions(step_on="every_rank")
    events = await _run([_wide_model() for _ in sources], sources, step, epochs=2)
    for event in events:
        assert len(event.step_split) == nranks
        for split in event.step_split:
            assert split.steps == 30
            assert split.seconds == pytest.approx(event.seconds, rel=0.05, abs=0.005)
            assert split.data > 0 and split.forward_backward > 0 and split.optimizer > 0
            if nranks > 1:
                assert split.exchange > 0


async def test_the_step_split_can_be_off() -> None:
    sources = [_listed(_wide(rank, [8] * 3)) for rank in range(2)]
    events = await _run(
        [_wide_model() for _ in sources], sources, lampdist.StepOptions(step_split=False)
    )
    assert events[0].step_split == ()
    assert events[0].slowest is None


def _stragglers(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]


async def test_a_rank_slow_to_load_is_named_a_straggler_waiting_for_data(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 1's loader sleeps 15 ms a batch: it is the slowest, its slow part is data, and the
    log names it once its third pass in a row counted against it."""
    sources = [Paced(_wide(rank, [16] * 12), 0.015 if rank == 1 else 0.0) for rank in range(3)]
    with caplog.at_level(logging.WARNING, logger="lampdist"):
        events = await _run(
            [_wide_model() for _ in sources],
            sources,
            lampdist.StepOptions(step_on="root"),
            epochs=STRAGGLER_PASSES,
        )
    for event in events:
        slowest = event.slowest
        assert slowest is not None and slowest.rank == 1
        assert slowest.data > 10 * max(s.data for s in event.step_split if s.rank != 1)
    (message,) = _stragglers(caplog)
    assert message.startswith(f"epoch {STRAGGLER_PASSES - 1}: rank 1 is a straggler in 3 ")
    assert "slow part is data" in message


async def test_a_rank_with_bigger_batches_is_named_a_straggler_in_forward_backward(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Rank 0's batches are 32 times rank 1's: its slow part is forward and backward, and rank
    1 waits for it in the exchange."""
    sources = [_listed(_wide(rank, [4096 if rank == 0 else 128] * 8, 256)) for rank in range(2)]
    with caplog.at_level(logging.WARNING, logger="lampdist"):
        events = await _run(
            [_wide_model(256) for _ in sources],
            sources,
            lampdist.StepOptions(step_on="every_rank"),
            epochs=STRAGGLER_PASSES,
        )
    slowest = events[-1].slowest
    assert slowest is not None and slowest.rank == 0
    fast = events[-1].step_split[1]
    assert slowest.forward_backward > 1.5 * fast.forward_backward
    assert fast.exchange > slowest.exchange
    messages = _stragglers(caplog)
    assert messages and "rank 0 is a straggler" in messages[0]
    assert "slow part is forward_backward" in messages[0]


async def test_a_healthy_run_of_the_default_design_names_no_straggler(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two even ranks under ``step_on="root"``: only the root steps, which is no straggler's
    doing (the followers wait for it in the exchange), and two ranks' passes that differ now
    and then are no straggler either.

    Both ranks share this process's cores with whatever else the machine runs: a loaded
    machine can slow one rank's passes for three in a row (seen once, under two CPU-bound
    jobs beside the test suite), so one run of up to three that names no straggler passes.
    The root's optimizer step takes 4 ms more than its forward and backward (a big model's
    AdamW): counted against it, it would name the root in every run."""

    class HeavySGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            time.sleep(0.004)
            return super().step(closure)

    named: list[list[str]] = []
    for _ in range(3):
        caplog.clear()
        sources = [_listed(_wide(rank, [256] * 20, 256)) for rank in range(2)]
        with caplog.at_level(logging.WARNING, logger="lampdist"):
            events = await _run(
                [_wide_model(256) for _ in sources],
                sources,
                lampdist.StepOptions(),
                epochs=6,
                optimizer_factory=lambda params: HeavySGD(params, lr=0.05),
            )
        assert len(events) == 6
        root_split = [event.step_split[0] for event in events]
        assert all(split.optimizer > 0.004 * split.steps for split in root_split)  # it steps
        named.append(_stragglers(caplog))
        if not named[-1]:
            break
    assert not named[-1], named


async def test_a_rank_slowed_a_fifth_in_its_data_is_named_within_a_few_passes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every rank's loader takes 10 ms a batch, rank 2's 12 ms: its own work is about 20%
    longer, and it is named, with its data, within a few passes."""
    delays = [0.010, 0.010, 0.012]
    sources = [Paced(_wide(rank, [32] * 20), delay) for rank, delay in enumerate(delays)]
    with caplog.at_level(logging.WARNING, logger="lampdist"):
        await _run(
            [_wide_model() for _ in sources],
            sources,
            lampdist.StepOptions(),
            epochs=STRAGGLER_PASSES + 2,
        )
    messages = _stragglers(caplog)
    assert messages, "no straggler named"
    assert "rank 2 is a straggler" in messages[0] and "slow part is data" in messages[0]


def _split(
    rank: int, data: float, forward_backward: float, optimizer: float = 0.02
) -> lampdist.StepSplit:
    return lampdist.StepSplit(
        rank=rank,
        steps=10,
        data=data,
        forward_backward=forward_backward,
        exchange=0.01,
        optimizer=optimizer,
        idle=0.001,
    )


def test_a_straggler_is_more_than_the_margin_slower_than_the_others() -> None:
    """The rule on given splits (timings of real ranks on a loaded machine vary by more than
    the margin between even ranks): within 10% of the other ranks' own work, no straggler;
    beyond it, the slowest rank and its part furthest above the others'."""
    even = (_split(0, 0.01, 0.1), _split(1, 0.012, 0.105), _split(2, 0.011, 0.1))
    assert straggler(even) is None
    slow = (_split(0, 0.01, 0.1), _split(1, 0.01, 0.125), _split(2, 0.011, 0.1))
    found = straggler(slow)
    assert found is not None and found[0] == 1
    assert found[1].startswith("its own work took 1.19x the other ranks' median")
    assert "its slow part is forward_backward (12.50 ms a step" in found[1]
    assert straggler(even[:1]) is None  # a rank alone has no others to be slower than


def test_with_two_ranks_a_straggler_is_compared_with_the_other_rank() -> None:
    """Two ranks: the slower is compared with the other, not with the mean of both (which
    would halve its excess)."""
    pair = (_split(0, 0.01, 0.1), _split(1, 0.01, 0.123))
    found = straggler(pair)
    assert found is not None and found[0] == 1


def test_under_the_root_design_the_roots_optimizer_is_no_straggler() -> None:
    """Only the root steps: its optimizer time is not held against it."""
    root_steps = (_split(0, 0.01, 0.1, optimizer=0.1), _split(1, 0.01, 0.1, optimizer=0.0))
    assert straggler(root_steps, every_rank_steps=False) is None
    assert straggler(root_steps, every_rank_steps=True) is not None


def test_a_straggler_is_named_after_passes_in_a_row_only() -> None:
    """One pass against a rank is no straggler; :data:`STRAGGLER_PASSES` in a row are, and
    another rank's pass in between starts the count again."""
    slow = (_split(0, 0.01, 0.1), _split(1, 0.01, 0.125), _split(2, 0.011, 0.1))
    even = (_split(0, 0.01, 0.1), _split(1, 0.01, 0.1), _split(2, 0.01, 0.1))
    judged = Stragglers(every_rank_steps=True)
    said = [judged.judge(split) for split in (slow, even, slow, slow, slow, slow, slow, slow)]
    assert [i for i, message in enumerate(said) if message] == [4, 7]
    assert said[4] is not None and said[4].startswith("rank 1 is a straggler in 3 training")


# -- tokens and MFU ---------------------------------------------------------------------------


class Tagger(torch.nn.Module):
    """A sequence tagger: 4 classes a position, 6 positions an example."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(16, 6 * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.linear(x).view(-1, 6, 4)
        return output


def tag_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.reshape(-1, 4), target.reshape(-1))


def _tagged(seed: int, sizes: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, 16, generator=generator), torch.randint(0, 4, (n, 6), generator=generator))
        for n in sizes
    ]


async def test_tokens_are_the_integer_targets_elements_over_every_rank() -> None:
    shards = [_tagged(0, [5, 3]), _tagged(1, [7])]
    events = await _run(
        [Tagger() for _ in shards],
        [_listed(s) for s in shards],
        lampdist.StepOptions(),
        loss=tag_loss,
    )
    (event,) = events
    assert event.tokens == (5 + 3 + 7) * 6
    assert event.tokens_per_second == pytest.approx(event.tokens / event.seconds)


async def test_tokens_are_unknown_for_float_targets_and_counted_by_a_function() -> None:
    shards = [_wide(0, [4, 4]), _wide(1, [4])]
    (plain,) = await _run(
        [_wide_model() for _ in shards], [_listed(s) for s in shards], lampdist.StepOptions()
    )
    assert plain.tokens is None and plain.tokens_per_second is None

    def counted(module: torch.nn.Module) -> lampdist.SupervisedModel:
        return lampdist.SupervisedModel(module, mse, token_count=lambda target: 10 * len(target))

    (event,) = await _run(
        [_wide_model() for _ in shards],
        [_listed(s) for s in shards],
        lampdist.StepOptions(),
        model=counted,
    )
    assert event.tokens == 10 * 12


async def test_mfu_from_counted_flops_and_a_peak_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The root counts the model's FLOPs on its first batch (a linear layer of 16 x 24 on an
    input that needs no gradient: 2 * 16 * 24 forward and as many for the weight's gradient
    per example); MFU is the FLOPs per second over the peak times the ranks. Without a peak
    (a CPU) there is no MFU."""
    shards = [_tagged(0, [5, 3]), _tagged(1, [7, 2])]

    def counted(module: torch.nn.Module) -> lampdist.SupervisedModel:
        return lampdist.SupervisedModel(module, tag_loss, flops_per_example="count")

    (no_peak,) = await _run(
        [Tagger() for _ in shards],
        [_listed(s) for s in shards],
        lampdist.StepOptions(),
        model=counted,
    )
    assert no_peak.flops_per_example == 2 * (2 * 16 * 24)
    assert no_peak.mfu is None and no_peak.peak_flops is None

    monkeypatch.setenv("LAMPDIST_PEAK_FLOPS", "1e9")
    (event,) = await _run(
        [Tagger() for _ in shards],
        [_listed(s) for s in shards],
        lampdist.StepOptions(),
        model=counted,
    )
    assert event.peak_flops == 2e9
    assert event.mfu == pytest.approx(2 * 16 * 24 * 2 * event.examples_per_second / 2e9)


async def test_given_flops_need_no_count() -> None:
    shards = [_tagged(0, [5])]

    def given(module: torch.nn.Module) -> lampdist.SupervisedModel:
        return lampdist.SupervisedModel(module, tag_loss, flops_per_example=1234.0)

    (event,) = await _run(
        [Tagger()], [_listed(shards[0])], lampdist.StepOptions(), model=given, loss=tag_loss
    )
    assert event.flops_per_example == 1234.0


def test_flops_per_example_is_checked() -> None:
    with pytest.raises(lampdist.ConfigError, match="flops_per_example"):
        lampdist.SupervisedModel(Tagger(), tag_loss, flops_per_example=-1)
    with pytest.raises(lampdist.ConfigError, match="flops_per_example"):
        lampdist.SupervisedModel(Tagger(), tag_loss, flops_per_example="counted")  # type: ignore[arg-type]


def test_the_host_clock_gives_every_stretch_to_a_part() -> None:
    """Each stretch between marks goes to the part that closes it, and the stretch from a
    step's last mark to the next step's start is idle: the parts add up to the wall time."""
    clock = HostClock()
    started = time.perf_counter()
    for _ in range(2):
        clock.start_step()
        time.sleep(0.01)
        clock.mark(DATA)
        time.sleep(0.02)
        clock.mark(FORWARD_BACKWARD)
        time.sleep(0.015)  # between this step's last mark and the next step: idle
    clock.start_step()
    clock.mark(OPTIMIZER)
    wall = time.perf_counter() - started
    data, forward_backward, exchange, optimizer, idle = clock.finish()
    assert clock.steps == 3
    # a sleep never ends early (and may end late: no upper bound)
    assert data >= 0.02 and forward_backward >= 0.04 and idle >= 0.03
    assert exchange == 0
    assert data + forward_backward + exchange + optimizer + idle == pytest.approx(wall, abs=1e-3)
