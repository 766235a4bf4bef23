"""The time to the first batch of a training stream resumed at a position, with the source's
state and without (a replay).

    python benchmarks/resume_position.py                        # position 1,000,000
    python benchmarks/resume_position.py --position 100000 --json out.json

The source is cheap on purpose: a :class:`lampdist.RandomBatches` whose ``sample`` draws one
random offset (``torch.randint``) and returns a 16-token window of a small tensor, as an LLM
loop samples windows of a token file. The position is reached once, by drawing
``--position`` batches (the setup, timed too); then each way opens lampdist's training stream
of one rank (the loading thread a run opens with ``steps_per_epoch``) at that position and
waits for its first batch:

- ``state``: the position carries the source's ``state_dict()``, which the stream loads;
- ``replay``: the same source without ``state_dict()`` (a plain generator over the same
  draws), which the stream draws and drops up to the position.

Both ways the first batch is checked to be the batch after the position. The goal is under
1 s with state at position 1,000,000 (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import lampdist
from lampdist._epoch._stream import StreamPosition, TrainStream, stream_context

TOKENS = torch.arange(4096)
WINDOW = 16
SEED = 0
"""``StepOptions.shuffle_seed``'s default: the stream's rank 0 generator."""


def sample(generator: torch.Generator) -> torch.Tensor:
    start = int(torch.randint(0, len(TOKENS) - WINDOW, (), generator=generator))
    return TOKENS[start : start + WINDOW]


class Replayed:
    """The same draws as a source without state: a plain generator over the pass."""

    def __init__(self, source: lampdist.RandomBatches[torch.Tensor]) -> None:
        self.source = source

    def __call__(self, context: lampdist.PassContext) -> Iterator[torch.Tensor]:
        yield from self.source(context)


def first_batch(source: Any, start: StreamPosition) -> tuple[float, torch.Tensor]:
    """Seconds from opening rank 0's stream at ``start`` to its first batch, and the batch."""
    model = lampdist.LossModel(torch.nn.Identity(), lambda m, batch: batch.float().mean())
    began = time.perf_counter()
    stream = TrainStream.open(
        source,
        model=model,
        device=torch.device("cpu"),
        rank=0,
        intra_op_threads=1,
        window=10**12,
        start=start,
        context=stream_context(SEED, 0, 1),
    )
    try:
        loaded = stream.feed.next()
        seconds = time.perf_counter() - began
    finally:
        stream.close()
    assert loaded is not None
    return seconds, loaded.data


def measure(position: int) -> dict[str, Any]:
    source = lampdist.RandomBatches(sample)
    context = stream_context(SEED, 0, 1)(0)
    draws = source(context)
    iterator = iter(draws)
    began = time.perf_counter()
    for _ in range(position):
        next(iterator)
    setup = time.perf_counter() - began
    state = draws.state_dict()
    want = next(iterator)
    with_state, got = first_batch(
        source, StreamPosition(data_pass=0, batches=position, state=state)
    )
    assert torch.equal(got, want), "with state: not the batch after the position"
    replay, got = first_batch(
        Replayed(source), StreamPosition(data_pass=0, batches=position, state=None)
    )
    assert torch.equal(got, want), "replay: not the batch after the position"
    return {
        "position": position,
        "setup_draw_seconds": setup,
        "first_batch_seconds_with_state": with_state,
        "first_batch_seconds_replay": replay,
        "replay_over_state": replay / with_state,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--position", type=int, default=1_000_000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = measure(args.position)
    report = {
        "benchmark": "resume_position",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        **result,
    }
    print(
        f"position {args.position:,}: first batch {result['first_batch_seconds_with_state']:.4f}"
        f" s with state, {result['first_batch_seconds_replay']:.2f} s replaying "
        f"(the draws themselves: {result['setup_draw_seconds']:.2f} s)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
