"""One rank of a step-based run over TCP, for the tests: windows of steps over a shuffled
torchdata ``StatefulDataLoader``, a model with dropout (so every rank's RNG matters), every
rank stepping, checkpoints to a directory, and a crash or a resume on request.

    python -m tests.roles.steps_rank --rank R --nranks N --out DIR --checkpoints DIR
        [--port P] [--crash-after K] [--resume] [--step-on every_rank|fsdp]

The root prints ``PORT <n>`` once it listens. Each rank that ends normally writes its weights
to ``DIR/rank<r>.pt``. ``--crash-after K``: rank 1's source raises after K batches.
``--resume``: start from other weights and the latest checkpoint, RNG states included.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import torch

import lampdist
from lampdist import checkpoint, control, schedules

from .reference import make_model, make_shards, mse
from .tcp_rank import local_parts

SIZES = [[4] * 5, [5] * 4]
STEPS_PER_EPOCH = 2
EPOCHS = 4


class Crash(Exception):
    pass


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def source(rank: int, crash_after: int | None) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]

    shard = make_shards(SIZES, seed=4)[rank]
    dataset = torch.utils.data.TensorDataset(
        torch.cat([b[0] for b in shard]), torch.cat([b[1] for b in shard])
    )
    drawn = 0

    class Loader:
        def __init__(self, context: lampdist.PassContext) -> None:
            self.loader = StatefulDataLoader(
                dataset, batch_size=3, shuffle=True, generator=context.generator()
            )

        def state_dict(self) -> Any:
            return self.loader.state_dict()

        def load_state_dict(self, state: Any) -> None:
            self.loader.load_state_dict(state)

        def __iter__(self) -> Iterator[Any]:
            nonlocal drawn
            for batch in self.loader:
                drawn += 1
                if crash_after is not None and drawn > crash_after:
                    raise Crash(f"rank {rank} crashes after {crash_after} batches")
                yield batch

    return Loader


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nranks", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--crash-after", type=int, default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--step-on", default="every_rank", choices=["every_rank", "fsdp"])
    args = parser.parse_args(argv)
    secret = os.environ["LAMPDIST_SECRET"]
    seed = (0 if args.rank == 0 else 10 + args.rank) + (500 if args.resume else 0)
    torch.manual_seed(1234 + args.rank + (77 if args.resume else 0))  # dropout's generator
    module = torch.nn.Sequential(torch.nn.Dropout(0.3), make_model(seed=seed))
    data = lampdist.ModelWithData(
        model=lampdist.SupervisedModel(module, mse),
        train_batches=source(args.rank, args.crash_after if args.rank == 1 else None),
    )
    step = lampdist.StepOptions(
        steps_per_epoch=STEPS_PER_EPOCH,
        step_on=args.step_on,
        learning_rate_per_step=schedules.warmup_cosine_steps(2, STEPS_PER_EPOCH * EPOCHS),
    )
    if args.rank == 0:
        resumed = None
        if args.resume:
            resumed = checkpoint.load_latest(args.checkpoints, restore_rng=True)
            assert resumed is not None
        async with control.tcp_root(
            "127.0.0.1", args.port, nranks=args.nranks, secret=secret
        ) as root:
            print(f"PORT {root.address[1]}", flush=True)
            await lampdist.drive_distributed_training(
                data=data,
                nranks=args.nranks,
                device="cpu",
                control=root,
                optimizer_factory=sgd,
                loop=lampdist.LoopOptions(
                    max_epochs=EPOCHS, checkpoint_state=checkpoint.to_directory(args.checkpoints)
                ),
                step=step,
                resume=resumed,
                timeouts=lampdist.Timeouts(join=30),
            )
    else:
        async with control.tcp_follower(
            "127.0.0.1", args.port, rank=args.rank, secret=secret
        ) as follower:
            await lampdist.follow_distributed_training(
                data=data,
                rank=args.rank,
                nranks=args.nranks,
                device="cpu",
                control=follower,
                optimizer_factory=sgd,
                step=step,
                timeouts=lampdist.Timeouts(join=30),
            )
    torch.save(local_parts(module), args.out / f"rank{args.rank}.pt")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
