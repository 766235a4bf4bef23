"""The writer host of the checkpoint crash test, and the state each epoch's save holds.

Run as a script it imports torch once, prints ``ready`` and then serves lines on stdin:

- ``write DIRECTORY STOP_EPOCH SEED``: fork a writer that resumes from the newest
  checkpoint in DIRECTORY and saves every epoch up to STOP_EPOCH with small random pauses;
  answer with the writer's pid (the test SIGKILLs it at a random moment).
- ``reap PID``: wait for that writer and answer with its wait status.

It exits at the end of stdin. Forking from this single-threaded host makes each writer
start in milliseconds instead of re-importing torch.
"""

from __future__ import annotations

import os
import random
import sys
import traceback
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import torch

from lampdist import CurvePoint, LoopState, TrainingState, checkpoint

__all__ = ["CrashScheduleState", "expected_state", "seed_everything"]


@attrs.frozen(kw_only=True)
class CrashScheduleState:
    """The schedule state each save holds."""

    step: int
    factor: float


def expected_state(epoch: int) -> tuple[TrainingState, CrashScheduleState]:
    """Everything the save of ``epoch`` holds; every field is derived from ``epoch``."""
    value = float(epoch)
    curve = tuple(
        CurvePoint(
            epoch=i,
            training_loss=1.0 / (i + 1),
            validation_loss=None if i % 2 else i / 7,
            smoothed_validation_loss=None if i % 2 else i / 9,
        )
        for i in range(epoch)
    )
    loop_state = LoopState(
        epoch=epoch,
        last_validation_loss=value / 3,
        min_validation_loss=value / 5,
        min_validation_epoch=epoch // 2,
        learning_curve=curve,
    )
    model = {
        "w": torch.full((4, 8), value),
        "b": torch.arange(8, dtype=torch.int64) * epoch,
        "h": torch.full((3,), value, dtype=torch.float16),
    }
    optimizer: dict[str, Any] = {
        "state": {0: {"step": torch.tensor(value), "exp_avg": torch.full((4, 8), 2 * value)}},
        "param_groups": [
            {"lr": 1.0 / epoch, "betas": (0.9, 0.999), "flag": epoch % 2 == 0, "params": [0]}
        ],
    }
    best = None if epoch % 3 == 0 else {"w": torch.full((4, 8), value - 1)}
    state = TrainingState(
        loop_state=loop_state, model_state=model, optimizer_state=optimizer, best_model_state=best
    )
    return state, CrashScheduleState(step=epoch, factor=1.0 / epoch)


def seed_everything(epoch: int) -> None:
    """Seed every global generator from ``epoch`` (done before each save)."""
    torch.manual_seed(epoch)
    random.seed(epoch)
    np.random.seed(epoch)


async def _write_epochs(directory: str, stop_epoch: int, seed: int) -> None:
    pauses = random.Random(seed)
    resumed = checkpoint.load_latest(directory)
    start = 1 if resumed is None else resumed.epoch + 1
    save = checkpoint.to_directory(directory, keep=2)
    for epoch in range(start, stop_epoch + 1):
        state, lr_state = expected_state(epoch)
        seed_everything(epoch)
        await save(state, lr_state)
        await anyio.sleep(pauses.uniform(0, 0.004))


def _warm_up() -> None:
    """Run every code path once, without threads left behind, so forked writers start fast."""
    import tempfile
    import threading

    import anyio._backends._asyncio  # noqa: F401  (imported by anyio.run on first use)

    from lampdist._checkpoint._rng import capture_rng_states
    from lampdist._checkpoint._write import write_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        for epoch in (1, 2):
            state, lr_state = expected_state(epoch)
            write_checkpoint(
                Path(directory), state, lr_state, capture_rng_states(), keep=1,
                check=lambda: None,
            )  # fmt: skip
        checkpoint.load_latest(directory)
    assert threading.active_count() == 1, "fork needs a single-threaded host"


def _serve() -> None:
    _warm_up()
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "write":
            directory, stop_epoch, seed = args[0], int(args[1]), int(args[2])
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    anyio.run(_write_epochs, directory, stop_epoch, seed)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            print(pid, flush=True)
        elif command == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            print(status, flush=True)


if __name__ == "__main__":
    _serve()
