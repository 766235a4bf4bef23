"""The README's rank script with one fault, for the tests under the real torchrun:

    torchrun --standalone --nproc-per-node 2 tests/reliability/torchrun_rank.py --out DIR \
        [--fault KIND] [--fault-rank R] [--checkpoints DIR] [--epochs N]

A 2-rank classifier trained with ``lampdist.train``: step windows, a metric, early stopping,
checkpoints and a tracker logging every 2 steps, in one call that every rank makes alike (no
rank branch but the faults'). The end of the script is the README's pattern, word for word.
Each rank writes the final loop state it got to ``state-R.json`` in ``--out``, and the
tracker (the root's) writes ``events.jsonl`` there. Faults:

- ``kill``: the fault rank SIGKILLs itself in epoch 1's training pass;
- ``stop``: the fault rank SIGSTOPs itself there (it stalls with its connections open);
- ``nan``: the fault rank's loss is NaN in epoch 1;
- ``bad-shape``: the fault rank's batches of epoch 1 have a column too many;
- ``secret``: the fault rank uses another secret (the root refuses it in the handshake);
- ``width``: the fault rank's model is wider (the agreement check refuses it);
- ``config``: the optimizer factory returns no optimizer (bad settings);
- ``slow-step``: every step sleeps 0.2 s (a run to signal while it trains).

``--fault-rank -1`` puts the fault on every rank. ``--slow-exit R`` makes rank R's
interpreter take 0.3 s more to exit (a loaded machine's).

Every rank writes ``started-R`` into ``--out`` once its training pass has begun, ``exit-R``
when its interpreter begins to exit, and ``fault.json`` (the wall-clock time) just before it
injects a fault.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

import lampdist
import lampdist.launch
from lampdist import checkpoint, trackers


def shard(rank: int, nranks: int, examples: int = 384, seed: int = 0) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(examples, 8, generator=generator)
    target = (inputs[:, 0] > 0).long()
    inputs, target = inputs[rank::nranks], target[rank::nranks]
    return [(inputs[i : i + 16], target[i : i + 16]) for i in range(0, len(target), 16)]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (output.argmax(1) == target).sum(), torch.tensor(target.numel())


def mark(out: Path, name: str) -> None:
    path = out / name
    if not path.exists():
        path.write_text(json.dumps({"time": time.time(), "pid": os.getpid()}))


async def main() -> None:
    args = ARGS
    env = lampdist.launch.from_env()
    faulty = args.fault is not None and args.fault_rank in (env.rank, -1)  # -1: every rank
    if faulty and args.fault == "secret":
        env = lampdist.launch.from_env({**os.environ, "LAMPDIST_SECRET": "not-the-secret"})
    torch.manual_seed(env.rank)
    width = 32 if faulty and args.fault == "width" else 16
    module = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 2)
    )
    train, valid = shard(env.rank, env.nranks), shard(env.rank, env.nranks, 64, seed=1)
    epoch = {"now": -1}

    def train_batches(context: lampdist.PassContext) -> Any:
        epoch["now"] = context.epoch
        mark(args.out, f"started-{env.rank}")
        if faulty and args.fault == "bad-shape" and context.epoch == 1:
            mark(args.out, "fault.json")
            return [(inputs[:, :7], target) for inputs, target in train]
        return train

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if args.fault == "slow-step":
            time.sleep(0.2)
        value = torch.nn.functional.cross_entropy(output, target)
        if faulty and epoch["now"] == 1:
            if args.fault == "kill":
                mark(args.out, "fault.json")
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "stop":
                mark(args.out, "fault.json")
                os.kill(os.getpid(), signal.SIGSTOP)
            if args.fault == "nan":
                mark(args.out, "fault.json")
                return value * float("nan")
        return value

    async with trackers.JsonLinesTracker(args.out / "events.jsonl") as tracker:
        await tracker.log_hyperparameters({"epochs": args.epochs})
        state = await run_training(env, module, train_batches, loss, faulty, valid, tracker)
        await tracker.log_summary(state)
    curve = [point.training_loss for point in state.learning_curve]
    (args.out / f"state-{env.rank}.json").write_text(json.dumps({"curve": curve}))


async def run_training(
    env: lampdist.launch.LaunchEnv,
    module: torch.nn.Module,
    train_batches: Any,
    loss: Any,
    faulty: bool,
    valid: Any,
    tracker: trackers.Tracker,
) -> lampdist.LoopState:
    args = ARGS
    return await lampdist.train(
        launch=env,
        data=lampdist.ModelWithData(
            model=lampdist.SupervisedModel(
                module, loss, metrics={"accuracy": lampdist.Metric(accuracy)}
            ),
            train_batches=train_batches,
            validation_batches=lambda: valid,
        ),
        optimizer_factory=(
            (lambda params: None)  # type: ignore[arg-type]  # no optimizer: bad settings
            if faulty and args.fault == "config"
            else lambda params: torch.optim.SGD(params, lr=0.05)
        ),
        loop=lampdist.LoopOptions(
            max_epochs=args.epochs,
            checkpoint_state=(
                checkpoint.to_directory(args.checkpoints) if args.checkpoints else None
            ),
            early_stopping=lampdist.EarlyStopping(
                monitor=lampdist.Monitor("validation_accuracy", mode="max"), patience=100
            ),
            on_event=tracker,
            log_every_n_steps=2,
        ),
        step=lampdist.StepOptions(steps_per_epoch=6, step_on=args.step_on),
        timeouts=lampdist.Timeouts(join=60, setup=60),
    )


parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--fault", default=None)
parser.add_argument("--fault-rank", type=int, default=1)
parser.add_argument("--checkpoints", type=Path, default=None)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--step-on", default="root")
parser.add_argument("--slow-exit", type=int, default=None)
ARGS = parser.parse_args()

if ARGS.slow_exit is not None and os.environ.get("RANK") == str(ARGS.slow_exit):
    atexit.register(time.sleep, 0.3)

atexit.register(lambda: mark(ARGS.out, f"exit-{os.environ.get('RANK')}"))

# The README's pattern from here on.
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # lampdist's warnings
try:
    anyio.run(main)
except lampdist.Interrupted as stopped:  # Ctrl-C or SIGTERM: stopped in order
    raise SystemExit(128 + stopped.signum) from None
except lampdist.ConfigError as error:  # bad settings, or ranks that disagree (MismatchError)
    print(f"{type(error).__name__}: {error}", file=sys.stderr)
    raise SystemExit(2) from None
