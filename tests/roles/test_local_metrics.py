"""Metrics over in-process ranks equal the metric of one process on the concatenated data:
lampdist's (sum, count) metrics and torchmetrics metrics, uneven and empty shards included."""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import anyio
import pytest
import torch

import lampdist
import lampdist._options

from .metrics_reference import metric_of, plain_outputs
from .reference import Batch, make_model, make_shards, mse

torchmetrics = pytest.importorskip("torchmetrics")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _absolute_error(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    return (out - y).abs().sum(), y.numel()  # a count on the host


def _squared_error_by_sign(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class (the target's sign): the squared errors and the examples of the class."""
    classes = (y.reshape(-1) > 0).long()
    errors = ((out - y) ** 2).reshape(-1)
    return (
        torch.bincount(classes, weights=errors, minlength=2),
        torch.bincount(classes, minlength=2),
    )


def _above(out: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    return float((out > y).sum()), torch.tensor(y.numel())  # a sum on the host


METRICS = {
    "mae": lampdist.Metric(_absolute_error),
    "mse_by_sign": lampdist.Metric(_squared_error_by_sign, shape=(2,)),
    "above": lampdist.Metric(_above),
}

CASES = {
    "uneven-3": ([[5, 7, 3, 9, 2], [6, 6], []], 1),
    "uneven-3-acc3": ([[5, 7, 3, 9, 2], [6, 6], []], 3),
    "empty-batches-2": ([[4, 0, 6, 0], [0, 0, 3]], 1),
    "one-rank": ([[8, 8, 5]], 1),
}
VALID_SIZES = [[5, 0, 3], [4], []]


def source(batches: Sequence[Batch], *, sized: bool = True) -> lampdist.BatchSource:
    if sized:
        return functools.partial(list, batches)
    return lambda: iter(list(batches))


@pytest.mark.parametrize(
    ("step_on", "sized"),
    [("root", True), ("every_rank", False), ("sharded", True), ("root", False)],
)
@pytest.mark.parametrize("case", sorted(CASES))
async def test_metrics_equal_the_metric_of_the_concatenated_data(
    case: str, step_on: lampdist._options.StepOn, sized: bool
) -> None:
    sizes, accumulate = CASES[case]
    nranks = len(sizes)
    train = make_shards(sizes, seed=1)
    valid = make_shards(VALID_SIZES[:nranks], seed=2)
    initial = make_model()
    expected, training, validation = plain_outputs(
        initial, sgd, train, valid, epochs=2, accumulate=accumulate
    )
    modules = [make_model(seed=10 + rank) for rank in range(nranks)]
    modules[0].load_state_dict(initial.state_dict())
    events: list[lampdist.PassEvent] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        events.append(event)

    with anyio.fail_after(60):
        state = await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(module, mse, metrics=METRICS),
                    train_batches=source(t, sized=sized or rank > 0),
                    validation_batches=source(v),
                )
                for rank, (module, t, v) in enumerate(zip(modules, train, valid, strict=True))
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=2, on_event=on_event),
            step=lampdist.StepOptions(
                accumulate_gradient_over_n_batches=accumulate, step_on=step_on
            ),
        )
    for name, tensor in expected.state_dict().items():  # the metrics changed no step
        torch.testing.assert_close(modules[0].state_dict()[name], tensor, rtol=0, atol=1e-9)
    for epoch, point in enumerate(state.learning_curve):
        want = {}
        for name, metric in METRICS.items():
            want[f"training_{name}"] = metric_of(metric, training[epoch])
            want[f"validation_{name}"] = metric_of(metric, [validation[epoch]])
        assert point.metrics.keys() == want.keys()
        for key, value in want.items():
            assert point.metrics[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # on_event: the pass's metrics on its last event (by their bare names), none before
    done = [event for event in events if event.done]
    assert [(e.epoch, e.kind) for e in done] == [
        (0, "train"),
        (0, "valid"),
        (1, "train"),
        (1, "valid"),
    ]
    for event in done:
        prefix = "training_" if event.kind == "train" else "validation_"
        point = state.learning_curve[event.epoch]
        assert {prefix + k: v for k, v in event.metrics.items()} == {
            k: v for k, v in point.metrics.items() if k.startswith(prefix)
        }
    assert all(not event.metrics for event in events if not event.done)


def _classifier(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)
    ).double()


def _classes(shards: list[list[Batch]]) -> list[list[Batch]]:
    """The regression shards as a 4-class problem: the class is a bucket of the target."""
    return [
        [(x, torch.bucketize(y.reshape(-1), torch.tensor([-0.5, 0.0, 0.5]))) for x, y in shard]
        for shard in shards
    ]


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("kind", ["accuracy", "mean_squared_error"])
async def test_torchmetrics_equal_one_object_updated_on_all_the_data(
    nranks: int, kind: str
) -> None:
    sizes = [[5, 7, 3, 9, 2], [6, 0, 6], []][:nranks]
    valid_sizes = [[5, 3], [4, 0], []][:nranks]
    train, valid = make_shards(sizes, seed=3), make_shards(valid_sizes, seed=4)
    make: Callable[[int], torch.nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    if kind == "accuracy":
        train, valid = _classes(train), _classes(valid)
        make, loss = _classifier, _cross_entropy

        def create() -> Any:
            return torchmetrics.classification.MulticlassAccuracy(num_classes=4)

    else:
        make, loss = make_model, mse

        def create() -> Any:
            return torchmetrics.MeanSquaredError().set_dtype(torch.float64)

    initial = make(0)
    _, training, validation = plain_outputs(initial, sgd, train, valid, epochs=2, loss=loss)
    modules = [make(10 + rank) for rank in range(nranks)]
    modules[0].load_state_dict(initial.state_dict())
    objects = [create() for _ in range(nranks)]
    state = await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, loss, metrics={"m": metric}),
                train_batches=source(t),
                validation_batches=source(v),
            )
            for module, metric, t, v in zip(modules, objects, train, valid, strict=True)
        ],
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(max_epochs=2),
    )
    for epoch, point in enumerate(state.learning_curve):
        for key, outputs in (
            ("training_m", training[epoch]),
            ("validation_m", [validation[epoch]]),
        ):
            one = create()
            for out, y in outputs:
                one.update(out, y)
            want = float(one.compute())
            assert point.metrics[key] == pytest.approx(want, rel=1e-9, abs=1e-12), key
    # lampdist computed without torchmetrics' own sync; the objects sync as before after it
    assert [m._to_sync for m in objects] == [m.sync_on_compute for m in objects]
    if kind == "accuracy":  # macro accuracy, not the fraction right: the states were summed
        out, y = validation[-1]
        assert state.learning_curve[-1].metrics["validation_m"] != pytest.approx(
            float((out.argmax(1) == y).double().mean()), rel=1e-6
        )


async def test_a_root_without_batches_reports_the_clique_s_torchmetrics() -> None:
    """The root's own metric saw no batch; its value is the other ranks' (no warning)."""
    shards = make_shards([[], [4, 5]], seed=5)
    shards[0] = []
    modules = [make_model(), make_model(seed=6)]
    state = await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(
                    m,
                    mse,
                    metrics={"mse": torchmetrics.MeanSquaredError().set_dtype(torch.float64)},
                ),
                train_batches=source(s),
                validation_batches=source(make_shards([[3], [2]], seed=7)[rank]),
            )
            for rank, (m, s) in enumerate(zip(modules, shards, strict=True))
        ],
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(max_epochs=1),
    )
    point = state.learning_curve[0]
    assert point.metrics["training_mse"] == pytest.approx(point.training_loss, rel=1e-9)
    assert point.metrics["validation_mse"] == pytest.approx(point.validation_loss, rel=1e-9)


def test_metrics_that_cannot_be_summed_are_refused_naming_them() -> None:
    module = make_model()
    for name, metric in [
        ("auroc", torchmetrics.classification.BinaryAUROC()),  # its states are concatenated
        ("top", torchmetrics.MaxMetric()),  # a max
        (
            "per_sample",
            torchmetrics.classification.MulticlassAccuracy(3, multidim_average="samplewise"),
        ),
    ]:
        with pytest.raises(
            lampdist.ConfigError, match=f"metric '{name}' .* does not reduce by sum"
        ):
            lampdist.SupervisedModel(module, mse, metrics={name: metric})
    with pytest.raises(lampdist.ConfigError, match="metric 'f' is a function"):
        lampdist.SupervisedModel(module, mse, metrics={"f": _absolute_error})
    with pytest.raises(lampdist.ConfigError, match="other than 'loss'"):
        lampdist.SupervisedModel(module, mse, metrics={"loss": METRICS["mae"]})
    with pytest.raises(lampdist.ConfigError, match="shape must be a tuple"):
        lampdist.Metric(_absolute_error, shape=(2.5,))
    summed = torchmetrics.aggregation.MeanMetric()  # a mean of sums: its states are sums
    assert lampdist.SupervisedModel(module, mse, metrics={"mean": summed}).metrics["mean"] is summed


async def _two_ranks(metrics: Sequence[dict[str, Any]]) -> lampdist.LoopState:
    shards = make_shards([[4, 4], [4]], seed=8)
    return await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(make_model(), mse, metrics=m),
                train_batches=source(s),
            )
            for m, s in zip(metrics, shards, strict=True)
        ],
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(max_epochs=1),
        timeouts=lampdist.Timeouts(collective=20),  # metrics of other sizes would wait
    )


async def test_a_metric_of_the_wrong_shape_fails_the_run_naming_it() -> None:
    wrong = lampdist.Metric(_squared_error_by_sign)  # declared scalar, returns 2 values
    with pytest.raises(lampdist.TrainingError, match="metric 'w' returned a sum of shape"):
        await _two_ranks([{"w": wrong}, {"w": wrong}])


async def test_ranks_with_other_metrics_disagree_before_training() -> None:
    with pytest.raises(lampdist.MismatchError, match="metric 'mae'"):
        await _two_ranks([{"mae": METRICS["mae"]}, {}])


async def test_a_nan_metric_for_a_count_of_zero() -> None:
    never = lampdist.Metric(lambda out, y: (torch.zeros(()), 0))
    state = await _two_ranks([{"never": never}, {"never": never}])
    assert math.isnan(state.learning_curve[0].metrics["training_never"])  # type: ignore[arg-type]


def test_the_forward_runs_once_for_the_loss_and_the_metrics() -> None:
    calls = []

    class Counting(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(3, 1).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(len(x))
            return self.linear(x)  # type: ignore[no-any-return]

    model = lampdist.SupervisedModel(Counting(), mse, metrics=METRICS)
    batch = make_shards([[5]], seed=9)[0][0]
    loss, output = model.forward_loss_and_output(*batch)
    assert calls == [5]
    assert torch.equal(loss, mse(output, batch[1]))
    assert torch.equal(model.forward_loss(*batch), loss)
    shards = make_shards([[4, 4], [4]], seed=8)
    copies = [copy.deepcopy(model.module), Counting()]
    calls.clear()
    anyio.run(
        functools.partial(
            lampdist.local_data_parallel_training_loop,
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(m, mse, metrics=METRICS),
                    train_batches=source(s),
                    validation_batches=source(s),
                )
                for m, s in zip(copies, shards, strict=True)
            ],
            optimizer_factory=sgd,
            loop=lampdist.LoopOptions(max_epochs=1),
        )
    )
    assert len(calls) == 6  # 3 training and 3 validation batches, one forward each


async def test_two_ranks_may_not_share_a_torchmetrics_object() -> None:
    shared = torchmetrics.MeanSquaredError()
    with pytest.raises(lampdist.ConfigError, match="ranks 0 and 1 share the metric object 'mse'"):
        await _two_ranks([{"mse": shared}, {"mse": shared}])
