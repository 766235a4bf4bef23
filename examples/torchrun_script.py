"""One script for every rank, started by torchrun (or srun):

    export LAMPDIST_SECRET=$(openssl rand -hex 16)
    torchrun --nproc-per-node 2 examples/torchrun_script.py [--epochs 5]

``lampdist.train`` reads the rank and the root's address from torchrun's variables, opens
the control channel (on a free port published in torchrun's store), and runs the root on
rank 0 and a follower on the others: the script has no rank branch. The progress (the
``on_event`` effect) reports on the root only. Every rank prints its final weights' checksum
and the final loop state's validation losses: they are the same everywhere. Ctrl-C (or
SIGTERM) stops the run after the epoch in progress: the root exits with 128 + the signal's
number, the followers with 0 (before training began, every rank stops at once and exits with
128 + the signal's number). Bad settings and ranks that
disagree exit 2; any other failure exits 1 with a traceback whose last line names the rank
and phase where the run failed (docs/reliability.md lists the exit codes).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable

import anyio
import torch

import lampdist
import lampdist.launch


def make_shard(
    rank: int, nranks: int, examples: int = 256, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share (every nranks-th example) of a noisy linear problem, in batches."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(examples, 8, generator=generator)
    weights = torch.arange(1.0, 9.0).reshape(8, 1) / 8
    targets = inputs @ weights + 0.01 * torch.randn(examples, 1, generator=generator)
    inputs, targets = inputs[rank::nranks], targets[rank::nranks]
    return [(inputs[i : i + 16], targets[i : i + 16]) for i in range(0, len(targets), 16)]


def sgd(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


async def report(event: lampdist.PassEvent) -> None:
    """The progress, one line per training pass, on stderr (called on the root only)."""
    if event.kind == "train" and event.done:
        print(f"epoch {event.epoch}: training loss {event.loss:.5f}", file=sys.stderr, flush=True)


async def main(epochs: int) -> None:
    env = lampdist.launch.from_env()
    torch.manual_seed(env.rank)  # any start: the root's weights reach every rank first
    module = torch.nn.Linear(8, 1)
    train = make_shard(env.rank, env.nranks)
    valid = make_shard(env.rank, env.nranks, examples=64, seed=1)
    state = await lampdist.train(
        data=lampdist.ModelWithData(
            model=lampdist.SupervisedModel(module, torch.nn.functional.mse_loss),
            train_batches=lambda: train,
            validation_batches=lambda: valid,
        ),
        launch=env,
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(max_epochs=epochs, on_event=report),
    )
    checksum = sum(float(p.detach().double().sum()) for p in module.parameters())
    result = {
        "rank": env.rank,
        "checksum": checksum,
        "validation_losses": [p.validation_loss for p in state.learning_curve],  # every rank's
    }
    # one write per line: the ranks share torchrun's stdout, and a single write is not split
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    epochs = parser.parse_args().epochs
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # lampdist's warnings
    try:
        anyio.run(main, epochs)
    except lampdist.Interrupted as stopped:  # Ctrl-C or SIGTERM: the run ended in order
        print(f"{type(stopped).__name__}: {stopped}", file=sys.stderr)
        raise SystemExit(128 + stopped.signum) from None
    except lampdist.ConfigError as error:  # bad settings, or ranks that disagree (MismatchError)
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
