"""One rank of a run over TCP whose step schedule is a lambda, for the tests: every rank
steps, windows of :data:`STEPS_PER_EPOCH` steps, and each optimizer step's learning rate
recorded.

    python -m tests.roles.schedule_rank --rank R --out DIR --schedule NAME [--port P]

``NAME`` picks a lambda of :data:`SCHEDULES`, written here so that each process builds its
own (another object, at another address, than its peer's). The root prints ``PORT <n>`` once
it listens; each rank that ends writes the learning rates of its steps to
``DIR/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import anyio
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import lampdist
from lampdist import control

from .reference import make_model, make_shards, mse

SIZES = [[4, 5, 3], [5, 4]]
STEPS_PER_EPOCH = 2
EPOCHS = 3
BASE_LR = 0.05

SCHEDULES: dict[str, Callable[[int], float]] = {
    "warmup": lambda step: min(1.0, (step + 1) / 3) * 0.9 ** (step // 2),
    "warmup-again": lambda step: min(1.0, (step + 1) / 3) * 0.9 ** (step // 2),
    # the same as "warmup" over the first windows, another from step 700 on
    "late": lambda step: min(1.0, (step + 1) / 3) * 0.9 ** (step // 2) * (step < 700 or 0.5),
}


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=BASE_LR)


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), required=True)
    args = parser.parse_args(argv)
    secret = os.environ["LAMPDIST_SECRET"]
    shard = make_shards(SIZES, seed=3)[args.rank]
    data = lampdist.ModelWithData(
        model=lampdist.SupervisedModel(make_model(seed=10 * args.rank), mse),
        train_batches=lambda: list(shard),
    )
    step = lampdist.StepOptions(
        steps_per_epoch=STEPS_PER_EPOCH,
        step_on="every_rank",
        learning_rate_per_step=SCHEDULES[args.schedule],
    )
    rates: list[float] = []

    def record(optimizer: Any, *_: Any) -> None:
        rates.append(optimizer.param_groups[0]["lr"])

    register_optimizer_step_pre_hook(record)
    timeouts = lampdist.Timeouts(join=30)
    if args.rank == 0:
        async with control.tcp_root("127.0.0.1", args.port, nranks=2, secret=secret) as root:
            print(f"PORT {root.address[1]}", flush=True)
            await lampdist.drive_distributed_training(
                data=data,
                nranks=2,
                device="cpu",
                control=root,
                optimizer_factory=sgd,
                loop=lampdist.LoopOptions(max_epochs=EPOCHS),
                step=step,
                timeouts=timeouts,
            )
    else:
        async with control.tcp_follower(
            "127.0.0.1", args.port, rank=args.rank, secret=secret
        ) as follower:
            await lampdist.follow_distributed_training(
                data=data,
                rank=args.rank,
                nranks=2,
                device="cpu",
                control=follower,
                optimizer_factory=sgd,
                step=step,
                timeouts=timeouts,
            )
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(rates))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
