"""One rank of a multi-process run of :mod:`.lm_reference`'s language model over TCP.

    python -m tests.roles.lm_rank --rank 0 --nranks 3 --out DIR [--port 0]
        [--step-on root|every_rank|sharded|fsdp]

The root prints ``PORT <n>`` once it listens; followers take ``--port``. Each rank writes its
weights (an fsdp shard's local part) to ``DIR/rank<r>.pt``; the root its learning curve to
``DIR/curve.json``. The secret comes from ``LAMPDIST_SECRET``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import anyio

import lampdist
from lampdist import control

from . import lm_reference as lm
from .tcp_rank import local_parts


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nranks", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--step-on", default="root")
    args = parser.parse_args(argv)
    train = lm.make_shards(lm.TRAIN_SIZES[args.nranks], seed=1)[args.rank]
    valid = lm.make_shards(lm.VALID_SIZES[args.nranks], seed=2)[args.rank]
    module = lm.TinyLM(seed=0 if args.rank == 0 else 10 + args.rank)
    data = lampdist.ModelWithData(
        model=lm.lm_model(module),
        train_batches=lambda: list(train),
        validation_batches=lambda: list(valid),
    )
    step = lampdist.StepOptions(
        accumulate_gradient_over_n_batches=lm.ACCUMULATE, step_on=args.step_on
    )
    secret = os.environ["LAMPDIST_SECRET"]
    timeouts = lampdist.Timeouts(join=30)
    if args.rank == 0:
        async with control.tcp_root(
            "127.0.0.1", args.port, nranks=args.nranks, secret=secret
        ) as root:
            print(f"PORT {root.address[1]}", flush=True)
            state = await lampdist.drive_distributed_training(
                data=data,
                nranks=args.nranks,
                device="cpu",
                control=root,
                optimizer_factory=lm.sgd,
                loop=lampdist.LoopOptions(max_epochs=lm.EPOCHS),
                step=step,
                timeouts=timeouts,
            )
        curve = [[p.training_loss, p.validation_loss] for p in state.learning_curve]
        (args.out / "curve.json").write_text(json.dumps(curve))
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
                optimizer_factory=lm.sgd,
                step=step,
                timeouts=timeouts,
            )
    import torch

    torch.save(local_parts(module), args.out / f"rank{args.rank}.pt")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
