"""Metrics on a GPU rank (run on the GPU machine): sums on the device, counts on the host,
a vector-valued metric and a torchmetrics one, against a plain loop on the same GPU."""

from __future__ import annotations

import functools
from collections.abc import Iterable

import pytest
import torch

import lampdist

from .metrics_reference import metric_of, plain_outputs
from .reference import make_model, make_shards, mse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda:0"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _absolute_error(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    return (out - y).abs().sum(), y.numel()


def _squared_error_by_sign(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    classes = (y.reshape(-1) > 0).long()
    errors = ((out - y) ** 2).reshape(-1)
    return torch.bincount(classes, weights=errors, minlength=2), torch.bincount(
        classes, minlength=2
    )


METRICS = {
    "mae": lampdist.Metric(_absolute_error),
    "mse_by_sign": lampdist.Metric(_squared_error_by_sign, shape=(2,)),
}


async def test_a_gpu_rank_reports_the_metrics_of_a_plain_loop() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    train = [[(x.to(DEVICE), y.to(DEVICE)) for x, y in make_shards([[5, 7, 3, 0, 9]], seed=1)[0]]]
    valid = [[(x.to(DEVICE), y.to(DEVICE)) for x, y in make_shards([[5, 3]], seed=2)[0]]]
    initial = make_model().to(DEVICE)
    _, training, validation = plain_outputs(initial, sgd, train, valid, epochs=2)
    module = make_model().to(DEVICE)
    module.load_state_dict(initial.state_dict())
    squared = torchmetrics.MeanSquaredError().set_dtype(torch.float64)
    state = await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=[
            lampdist.ModelWithData(
                model=lampdist.SupervisedModel(module, mse, metrics={**METRICS, "mse": squared}),
                train_batches=functools.partial(list, train[0]),
                validation_batches=functools.partial(list, valid[0]),
            )
        ],
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(max_epochs=2),
    )
    for epoch, point in enumerate(state.learning_curve):
        for kind, outputs in (("training", training[epoch]), ("validation", [validation[epoch]])):
            for name, metric in METRICS.items():
                want = metric_of(metric, outputs)
                assert point.metrics[f"{kind}_{name}"] == pytest.approx(want, rel=1e-9), name
        assert point.metrics["validation_mse"] == pytest.approx(point.validation_loss, rel=1e-9)
        assert point.metrics["training_mse"] == pytest.approx(point.training_loss, rel=1e-9)
