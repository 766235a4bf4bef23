"""Plain PyTorch references for the metrics tests: the outputs a single process sees when it
trains on the concatenation of every rank's batches of each step, and the metrics on them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

import lampdist

from .reference import Batch, Shards, mse

Output = tuple[torch.Tensor, torch.Tensor]
"""A forward's output and the targets it was computed for."""


def plain_outputs(
    module: torch.nn.Module,
    optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    train: Shards,
    valid: Shards | None,
    *,
    epochs: int,
    accumulate: int = 1,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse,
) -> tuple[torch.nn.Module, list[list[Output]], list[Output]]:
    """Train one process on the concatenation of every rank's batches of each step (as
    :func:`.reference.reference_training` does) and return the trained module, each epoch's
    training outputs (one per step, before the step) and each epoch's validation output on
    all the validation batches."""
    module = copy.deepcopy(module)
    optimizer = optimizer_factory(list(module.parameters()))
    steps = max((len(shard) + accumulate - 1) // accumulate for shard in train)
    training: list[list[Output]] = []
    validation: list[Output] = []
    for _ in range(epochs):
        module.train()
        outputs = []
        for step in range(steps):
            window = [
                batch
                for shard in train
                for batch in shard[step * accumulate : (step + 1) * accumulate]
                if len(batch[1]) > 0
            ]
            if not window:
                continue
            x = torch.cat([b[0] for b in window])
            y = torch.cat([b[1] for b in window])
            optimizer.zero_grad()
            out = module(x)
            loss(out, y).backward()  # type: ignore[no-untyped-call]  # torch's is untyped
            optimizer.step()
            outputs.append((out.detach(), y))
        training.append(outputs)
        if valid is not None:
            module.eval()
            with torch.no_grad():
                batches: list[Batch] = [b for shard in valid for b in shard if len(b[1]) > 0]
                x = torch.cat([b[0] for b in batches])
                y = torch.cat([b[1] for b in batches])
                validation.append((module(x), y))
    return module, training, validation


def metric_of(metric: lampdist.Metric, outputs: Sequence[Output]) -> Any:
    """``metric`` over ``outputs``: the sum of its sums over the sum of its counts, in
    float64 (a float, or a tuple for a vector-valued metric)."""
    sums = torch.zeros(metric.shape, dtype=torch.float64)
    counts = torch.zeros(metric.shape, dtype=torch.float64)
    for out, y in outputs:
        s, c = metric.function(out, y)
        sums += torch.as_tensor(s, dtype=torch.float64).cpu()
        counts += torch.as_tensor(c, dtype=torch.float64).cpu()
    ratio = sums / counts
    return float(ratio) if metric.shape == () else tuple(ratio.tolist())
