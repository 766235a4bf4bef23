"""The state held by ``data/format-1``: a checkpoint written by lampdist's format-1 writer.

The fixture was written once, by the last commit that wrote format 1 (c077671), with
``write_fixture`` below; it stays in the repository so that every later lampdist is tested
against bytes that an earlier one really wrote.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from lampdist import CurvePoint, LoopState, TrainingState

__all__ = ["FIXTURE", "Format1ScheduleState", "expected", "seed", "write_fixture"]

FIXTURE = Path(__file__).with_name("data") / "format-1"
SEED = 1234


@attrs.frozen(kw_only=True)
class Format1ScheduleState:
    step: int
    factor: float


def seed() -> None:
    """Seed every global generator as they were when the fixture was written."""
    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)


def expected() -> tuple[TrainingState, Format1ScheduleState]:
    """Every value of the fixture, built from literals (no training, no randomness)."""
    model: OrderedDict[str, torch.Tensor] = OrderedDict(
        [
            ("0.weight", torch.arange(20, dtype=torch.float32).reshape(4, 5) / 7),
            ("0.bias", torch.tensor([0.5, -0.25, float("nan"), float("inf")])),
            ("1.running_mean", torch.arange(4, dtype=torch.float64) / 3),
            ("1.num_batches_tracked", torch.tensor(3)),
            ("2.half", torch.arange(6, dtype=torch.float16).reshape(2, 3)),
            ("2.bf16", (torch.arange(6, dtype=torch.float32) / 9).to(torch.bfloat16)),
            ("2.flags", torch.tensor([True, False, True])),
            ("2.empty", torch.zeros(0, 3)),
        ]
    )
    model._metadata = OrderedDict(  # type: ignore[attr-defined]  # set by nn.Module.state_dict
        [("", {"version": 1}), ("1", {"version": 2})]
    )
    optimizer: dict[str, Any] = {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.full((4, 5), 0.125)},
            1: {"step": torch.tensor(3.0), "exp_avg": torch.full((4,), -0.5)},
        },
        "param_groups": [
            {
                "lr": 0.01,
                "betas": (0.9, 0.999),
                "eps": 1e-08,
                "weight_decay": 0.1,
                "amsgrad": False,
                "foreach": None,
                "maximize": False,
                "params": [0, 1],
            }
        ],
    }
    best = OrderedDict([("0.weight", torch.ones(4, 5)), ("0.bias", torch.zeros(4))])
    loop_state = LoopState(
        epoch=7,
        last_validation_loss=0.123456789012345,
        min_validation_loss=0.1,
        min_validation_epoch=4,
        learning_curve=tuple(
            CurvePoint(
                epoch=i,
                training_loss=1 / (i + 3),
                validation_loss=None if i % 2 else 0.1 * i,
                smoothed_validation_loss=None if i % 2 else 0.2 * i,
            )
            for i in range(7)
        ),
    )
    state = TrainingState(
        loop_state=loop_state, model_state=model, optimizer_state=optimizer, best_model_state=best
    )
    return state, Format1ScheduleState(step=7, factor=0.25)


def write_fixture() -> None:  # pragma: no cover  (run once, by the format-1 writer)
    import anyio

    from lampdist import checkpoint

    state, lr_state = expected()
    seed()
    anyio.run(checkpoint.to_directory(FIXTURE), state, lr_state)
    (FIXTURE / ".lock").unlink()


if __name__ == "__main__":
    write_fixture()
