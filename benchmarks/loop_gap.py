"""How long the host's event loop goes unserved while lampdist trains in the same process.

    python benchmarks/loop_gap.py                 # 2 in-process CPU ranks, 3 runs
    python benchmarks/loop_gap.py --runs 1 --json gaps.json

A ticker task sleeps ``--tick`` seconds in a loop on the event loop that also runs
``local_data_parallel_training_loop`` over two CPU ranks whose steps take tens of
milliseconds; every wake-up later than the tick by more than the loop's own jitter is a gap
in which the loop served nothing. The first run in the process is measured apart: it is the
one that imports what training needs. Each run reports the largest gap, the 99th percentile
and the number of gaps over 20 ms, beside the training step's duration. The target is no
gap over 20 ms (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch
from torch import nn

import lampdist

WIDTH = 1024  # a 4 x 1024 MLP, batch 512: tens of milliseconds a step on two cores
DEPTH = 4
BATCH = 512
STEPS = 60
LIMIT = 0.020


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


def batches(rank: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        yield (
            torch.randn(BATCH, WIDTH, generator=generator),
            torch.randint(0, 10, (BATCH,), generator=generator),
        )


async def one_run(tick: float) -> dict[str, Any]:
    """Train once while the ticker runs; the ticker's late wake-ups and the step times."""
    late: list[float] = []
    steps: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await anyio.sleep(tick)
            late.append(time.perf_counter() - before - tick)

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.kind == "train" and event.done and event.step:
            steps.append(event.seconds / event.step)

    entries = [
        lampdist.ModelWithData(
            model=lampdist.SupervisedModel(build(0), nn.functional.cross_entropy),
            train_batches=lambda rank=rank: batches(rank),
        )
        for rank in range(2)
    ]
    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=entries,
            optimizer_factory=lambda params: torch.optim.AdamW(params, lr=1e-4),
            loop=lampdist.LoopOptions(max_epochs=1, on_event=on_event),
        )
        done.set()
    return {
        "seconds": time.perf_counter() - started,
        "step_ms": 1e3 * statistics.median(steps) if steps else None,
        "ticks": len(late),
        "max_gap_ms": 1e3 * max(late),
        "p99_gap_ms": 1e3 * sorted(late)[int(0.99 * (len(late) - 1))],
        "gaps_over_20ms": sum(1 for gap in late if gap > LIMIT),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=3, help="runs after the first one")
    parser.add_argument("--tick", type=float, default=0.005, help="the ticker's sleep, seconds")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    async def all_runs() -> list[dict[str, Any]]:
        return [await one_run(args.tick) for _ in range(1 + args.runs)]

    results = anyio.run(all_runs)
    print(f"2 in-process CPU ranks, {STEPS} steps of a {DEPTH} x {WIDTH} MLP, batch {BATCH}")
    print("run     step ms  ticks  max gap ms  p99 gap ms  gaps > 20 ms")
    for index, result in enumerate(results):
        name = "first" if index == 0 else f"{index + 1}"
        print(
            f"{name:<6} {result['step_ms'] or 0:>8.1f}  {result['ticks']:>5}  "
            f"{result['max_gap_ms']:>10.1f}  {result['p99_gap_ms']:>10.1f}  "
            f"{result['gaps_over_20ms']:>12}"
        )
    if args.json is not None:
        meta = {"torch": torch.__version__, "python": sys.version.split()[0], "tick": args.tick}
        args.json.write_text(json.dumps({"meta": meta, "runs": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
