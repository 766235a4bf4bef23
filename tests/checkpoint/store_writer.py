"""The writer of the object-store crash test: run as ``python -m tests.checkpoint.store_writer
URL MEGABYTES`` (the store's environment inherited), it writes checkpoint epoch 1 to URL,
prints ``1``, writes a checkpoint of epoch 2 holding a MEGABYTES model in 5 MiB parts (many
of them), prints ``2``; the test SIGKILLs it somewhere in between."""

from __future__ import annotations

import sys

import attrs
import torch

from lampdist import TrainingState
from lampdist._checkpoint import _object_store, _store_client
from lampdist._checkpoint._rng import capture_rng_states

from .checkpoint_writer import CrashScheduleState, expected_state

__all__ = ["PART_BYTES", "large_state"]

PART_BYTES = 5 << 20
"""S3's smallest part: the most parts for the size."""


def large_state(megabytes: int) -> tuple[TrainingState, CrashScheduleState]:
    """The state of epoch 2: a model of ``megabytes`` MB of float32 noise (seeded)."""
    state, lr_state = expected_state(2)
    noise = torch.randn(megabytes * 250_000, generator=torch.Generator().manual_seed(2))
    return attrs.evolve(state, model_state={**state.model_state, "noise": noise}), lr_state


def _main(url: str, megabytes: int) -> None:
    _store_client.PART_BYTES = PART_BYTES  # small parts: many of them to be killed between
    first = expected_state(1)
    second = large_state(megabytes)
    for epoch, (state, lr_state) in enumerate((first, second), start=1):
        _object_store.write_to_store(
            url,
            state,
            lr_state,
            capture_rng_states(),
            keep=2,
            check=lambda: None,
            options=None,
        )
        print(epoch, flush=True)


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]))
