"""A plain single-process PyTorch reference for the exactness tests, and their shared data."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.utils.data import DataLoader, TensorDataset

import lampdist

Batch = tuple[torch.Tensor, torch.Tensor]
Shards = Sequence[Sequence[Batch]]


def make_model(seed: int = 0, width: int = 6) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    ).double()


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def make_batch(generator: torch.Generator, size: int) -> Batch:
    x = torch.randn(size, 3, generator=generator, dtype=torch.float64)
    y = (x.sum(dim=1, keepdim=True) * 0.5).sin() + 0.1 * torch.randn(
        size, 1, generator=generator, dtype=torch.float64
    )
    return x, y


def make_shards(sizes: Sequence[Sequence[int]], seed: int = 1) -> list[list[Batch]]:
    """One list of batches per rank; ``sizes[r]`` are the batch sizes of rank r (0 = empty)."""
    generator = torch.Generator().manual_seed(seed)
    return [[make_batch(generator, size) for size in rank_sizes] for rank_sizes in sizes]


def reference_training(
    module: torch.nn.Module,
    optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    train: Shards,
    valid: Shards | None,
    *,
    epochs: int,
    accumulate: int = 1,
    max_grad_norm: float | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.nn.Module, list[float], list[float]]:
    """Train one process on the concatenation of every rank's batches of each step: plain
    PyTorch, with ``torch.nn.utils.clip_grad_norm_`` for ``max_grad_norm``, and
    ``torch.autocast`` (plus a default ``GradScaler`` for float16) for ``autocast_dtype``.

    Returns the trained module and the per-epoch mean training and validation losses.
    """
    loss_of = loss or mse
    module = copy.deepcopy(module)
    optimizer = optimizer_factory(list(module.parameters()))
    scaler = torch.amp.GradScaler("cpu", enabled=autocast_dtype == torch.float16)
    train_losses: list[float] = []
    valid_losses: list[float] = []
    steps = max((len(shard) + accumulate - 1) // accumulate for shard in train)
    for _ in range(epochs):
        module.train()
        loss_sum = 0.0
        count = 0
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
            if autocast_dtype is None:
                step_loss = loss_of(module(x), y)
                step_loss.backward()  # type: ignore[no-untyped-call]  # torch's is untyped
            else:
                # Each batch's forward on its own, as each rank runs it: low-precision matmuls
                # round differently on other batch shapes. The losses are weighted by their
                # share of the step's examples, as one loss over the concatenation would be.
                step_loss = torch.zeros((), dtype=torch.float64)
                for bx, by in window:
                    with torch.autocast("cpu", dtype=autocast_dtype):
                        batch_loss = loss_of(module(bx), by) * (len(by) / len(y))
                    scaler.scale(batch_loss).backward()  # type: ignore[no-untyped-call]
                    step_loss = step_loss + batch_loss.detach().double()
            if max_grad_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(module.parameters(), max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            loss_sum += float(step_loss.detach()) * len(y)
            count += len(y)
        train_losses.append(loss_sum / count)
        if valid is not None:
            module.eval()
            with torch.no_grad():
                batches = [b for shard in valid for b in shard if len(b[1]) > 0]
                x = torch.cat([b[0] for b in batches])
                y = torch.cat([b[1] for b in batches])
                valid_losses.append(float(loss_of(module(x), y)))
    return module, train_losses, valid_losses


def shuffled(shard: Sequence[Batch], batch_size: int = 4) -> lampdist.PassAwareBatchSource:
    """The documented shuffled loader over a shard's examples: a ``DataLoader`` per pass
    with ``shuffle=True`` and the pass's generator."""
    dataset = TensorDataset(torch.cat([b[0] for b in shard]), torch.cat([b[1] for b in shard]))

    def source(context: lampdist.PassContext) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(
            dataset, batch_size=batch_size, shuffle=True, generator=context.generator()
        )

    return source
