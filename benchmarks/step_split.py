"""Where each rank's steps spend their time, drawn as one chart: a run with a slow rank.

    python benchmarks/step_split.py --nranks 3 --slow-rank 2 --delay 0.01 \\
        --json results/step-split.json -o ../docs/images/step-split.png
    python benchmarks/step_split.py --from run/metrics.jsonl -o split.png   # the demo's

Runs ``local_data_parallel_training_loop`` over ``--nranks`` CPU ranks of one process (real
Gloo), every rank with the same model and batch size, and rank ``--slow-rank``'s batch source
sleeping ``--delay`` seconds before each batch (a slow loader), then draws the last training
pass's :attr:`lampdist.PassEvent.step_split`: one bar per rank, its milliseconds a step cut
into data, forward and backward, exchange, optimizer and idle. The slowest rank is marked.
``--from`` draws the last training line of a demo's ``metrics.jsonl`` instead. PNG or SVG,
drawn with matplotlib.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

import lampdist

__all__ = ["render"]

PARTS = ("data", "forward_backward", "exchange", "optimizer", "idle")
COLOURS = {
    "data": "#d62728",
    "forward_backward": "#1f77b4",
    "exchange": "#7f7f7f",
    "optimizer": "#2ca02c",
    "idle": "#bcbd22",
}
LABELS = {
    "data": "data",
    "forward_backward": "forward + backward",
    "exchange": "exchange",
    "optimizer": "optimizer",
    "idle": "idle",
}


def render(split: dict[str, Any], title: str, output: Path) -> None:
    """Draw ``split`` (:meth:`lampdist.PassEvent.telemetry`'s ``step_split``) into
    ``output`` (PNG or SVG, by its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = split["ranks"]
    slowest = split["slowest"]["rank"]
    figure, axes = plt.subplots(figsize=(8, 1.2 + 0.55 * len(ranks)))
    names = [f"rank {r['rank']}" + (" (slowest)" if r["rank"] == slowest else "") for r in ranks]
    left = [0.0] * len(ranks)
    for part in PARTS:
        values = [r[part] / max(r["steps"], 1) * 1000 for r in ranks]
        axes.barh(names, values, left=left, color=COLOURS[part], label=LABELS[part])
        left = [a + b for a, b in zip(left, values, strict=True)]
    for index, total in enumerate(left):
        axes.text(total, index, f" {total:.1f}", va="center", fontsize=9, color="#444")
    axes.invert_yaxis()
    axes.set_xlabel("milliseconds a step")
    axes.set_title(title, fontsize=10)
    axes.set_xlim(0, max(left) * 1.12)
    axes.legend(ncol=len(PARTS), fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    figure.tight_layout()
    figure.savefig(output, dpi=110, bbox_inches="tight")
    plt.close(figure)


class Paced:
    """A batch source that sleeps ``delay`` seconds before each batch."""

    def __init__(self, batches: Sequence[Any], delay: float) -> None:
        self.batches, self.delay = list(batches), delay

    def __call__(self) -> Iterator[Any]:
        for batch in self.batches:
            if self.delay:
                time.sleep(self.delay)
            yield batch


def run(nranks: int, slow_rank: int, delay: float, steps: int) -> lampdist.PassEvent:
    """The last training event of a run of two epochs (see the module docstring)."""
    width, size = 256, 128
    events: list[lampdist.PassEvent] = []

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width), torch.nn.ReLU()] * 3
        return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))

    def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(rank)
        return [
            (torch.randn(size, width, generator=generator), torch.randint(0, 10, (size,)))
            for _ in range(steps)
        ]

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.kind == "train" and event.done:
            events.append(event)

    async def main() -> None:
        await lampdist.local_data_parallel_training_loop(
            models_with_data_streams=[
                lampdist.ModelWithData(
                    model=lampdist.SupervisedModel(
                        model(), torch.nn.functional.cross_entropy, flops_per_example="count"
                    ),
                    train_batches=Paced(batches(rank), delay if rank == slow_rank else 0.0),
                )
                for rank in range(nranks)
            ],
            optimizer_factory=lambda p: torch.optim.AdamW(p, lr=1e-3),
            loop=lampdist.LoopOptions(max_epochs=2, on_event=on_event),
            step=lampdist.StepOptions(step_on="every_rank", measure_grad_norm=True),
        )

    anyio.run(main)
    return events[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nranks", type=int, default=3)
    parser.add_argument("--slow-rank", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--from", dest="source", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    if args.source is not None:
        lines = [json.loads(line) for line in args.source.read_text().splitlines() if line]
        line = [m for m in lines if m["kind"] == "train"][-1]
        split, title = line["step_split"], f"the demo, epoch {line['epoch'] + 1}: a step's parts"
    else:
        event = run(args.nranks, args.slow_rank, args.delay, args.steps)
        telemetry = event.telemetry()
        split = telemetry["step_split"]
        title = (
            f"{args.nranks} CPU ranks, rank {args.slow_rank}'s loader {args.delay * 1000:.0f} ms "
            "a batch slower: a step's parts"
        )
        if args.json is not None:
            report = {"nranks": args.nranks, "slow_rank": args.slow_rank, "delay": args.delay}
            args.json.write_text(json.dumps({**report, **telemetry}, indent=1) + "\n")
        print(json.dumps(telemetry["step_split"]["slowest"]))
    render(split, title, args.output)


if __name__ == "__main__":
    main()
