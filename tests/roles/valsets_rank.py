"""One rank of a two-process run with two validation sets, through :func:`lampdist.train` or
:func:`lampdist.evaluate` (one script, every rank alike), for the tests.

    python -m tests.roles.valsets_rank --rank R --port P --out DIR train|evaluate

``train`` validates before training, trains 2 epochs and checkpoints into ``DIR/ckpt``; the
root writes its learning curve to ``DIR/curve.json``. ``evaluate`` evaluates the checkpoint
in ``DIR/ckpt``; each rank writes its :class:`lampdist.Evaluation` to ``DIR/eval<R>.json``.
The secret comes from ``LAMPDIST_SECRET``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import anyio
import attrs

import lampdist
from lampdist import checkpoint
from lampdist.launch import LaunchEnv

from .test_local_valsets import entries, fresh_modules, sgd


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("mode", choices=["train", "evaluate"])
    args = parser.parse_args()
    launch = LaunchEnv(
        rank=args.rank, nranks=2, port=args.port, secret=os.environ["LAMPDIST_SECRET"]
    )
    data = entries(fresh_modules())[args.rank]
    timeouts = lampdist.Timeouts(join=30)
    if args.mode == "evaluate":
        evaluation = await lampdist.evaluate(
            data=data,
            optimizer_factory=sgd,
            resume=max((args.out / "ckpt").glob("epoch-*")),  # the newest checkpoint
            launch=launch,
            timeouts=timeouts,
        )
        (args.out / f"eval{args.rank}.json").write_text(json.dumps(attrs.asdict(evaluation)))
        return
    loop = lampdist.LoopOptions(
        max_epochs=2,
        validate_before_training=True,
        checkpoint_state=checkpoint.to_directory(args.out / "ckpt"),
    )
    state = await lampdist.train(
        data=data, optimizer_factory=sgd, loop=loop, launch=launch, timeouts=timeouts
    )
    if state is not None:
        curve = [[p.epoch, p.validation_loss, dict(p.metrics)] for p in state.learning_curve]
        (args.out / "curve.json").write_text(json.dumps(curve))


if __name__ == "__main__":
    anyio.run(main)
