"""Train on two CPU ranks in one process, driven from ``anyio.run``.

    python examples/anyio_script.py [--epochs 20] [--backend trio]

Each rank is a copy of the model with its own share of the data; the root (the first entry)
drives the epochs, the other follows, and the gradients meet in an in-process clique.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import anyio
import torch

import lampdist

NRANKS = 2


def make_shard(rank: int, examples: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches of a noisy linear problem, y = x @ w + noise."""
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(examples, 8, generator=generator)
    weights = torch.arange(1.0, 9.0).reshape(8, 1) / 8
    targets = inputs @ weights + 0.01 * torch.randn(examples, 1, generator=generator)
    return [(inputs[i : i + 32], targets[i : i + 32]) for i in range(0, examples, 32)]


def sgd(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


async def main(epochs: int = 20) -> lampdist.LoopState:
    """Train and return the root's loop state (its learning curve, the best epoch)."""
    ranks = []
    for rank in range(NRANKS):
        torch.manual_seed(rank)  # the root's weights are copied to every rank at the start
        model = lampdist.SupervisedModel(torch.nn.Linear(8, 1), torch.nn.functional.mse_loss)
        train, valid = make_shard(rank), make_shard(100 + rank, examples=64)
        ranks.append(
            lampdist.ModelWithData(
                model=model,
                train_batches=lambda train=train: train,
                validation_batches=lambda valid=valid: valid,
            )
        )
    return await lampdist.local_data_parallel_training_loop(
        models_with_data_streams=ranks,
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(
            max_epochs=epochs, return_min_validation_loss_model=range(epochs)
        ),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    state = anyio.run(main, args.epochs, backend=args.backend)
    for point in state.learning_curve:
        print(
            f"epoch {point.epoch + 1:2d}: training loss {point.training_loss:.5f}, "
            f"validation loss {point.validation_loss:.5f}"
        )
    if state.min_validation_epoch is not None:
        print(f"best epoch: {state.min_validation_epoch + 1}")
