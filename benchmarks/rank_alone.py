"""A rank alone in one process against the plain loop, in the same process, interleaved.

    python benchmarks/rank_alone.py                          # CPU, the small model
    python benchmarks/rank_alone.py --device cuda --steps 1000 --repeats 5 --json out.json
    python benchmarks/rank_alone.py --tree before=/path/to/other/src   # another lampdist too

Where ``throughput.py --nranks 1`` starts a process per run and goes through ``lampdist.train``
over TCP, this measures what a rank alone costs the host per step with nothing else around:
``local_data_parallel_training_loop`` with one entry, beside the plain loop of
``_loops.training_step``, on the same model, optimizer and batches, in one process (the
configurations take turns, the order rotating each repeat). Both are timed from the first timed
batch's forward (a device synchronization first) to the end: the plain loop's last step
synchronized, lampdist's pass's last progress event. ``--tree NAME=PATH`` adds the lampdist
of another source tree (``PATH/lampdist``) as configuration ``NAME``, to compare two versions
in one run. The table gives the median samples/s and its ratio to the plain loop's median.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import torch

import lampdist
from _loops import batch_source, create_optimizer, synchronize, training_step
from _models import MODELS, Workload, build_workload


def load_tree(name: str, path: str) -> ModuleType:
    """``path/lampdist`` imported as ``lampdist_<name>`` (its imports are relative)."""
    copy = tempfile.mkdtemp()
    shutil.copytree(Path(path) / "lampdist", Path(copy) / f"lampdist_{name}")
    sys.path.insert(0, copy)
    return importlib.import_module(f"lampdist_{name}")


class StartMark:
    """A forward pre-hook that notes when the first timed batch's forward begins, after the
    warm-up steps' device work, and then removes itself."""

    def __init__(self, module: torch.nn.Module, warmup: int, device: torch.device) -> None:
        self.forwards, self.warmup, self.device = 0, warmup, device
        self.started: float | None = None
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module: torch.nn.Module, inputs: Any) -> None:
        if self.forwards == self.warmup:
            synchronize(self.device)
            self.started = time.perf_counter()
            self.handle.remove()
        self.forwards += 1


def run_plain(work: Workload, device: torch.device, warmup: int, steps: int) -> float:
    step = training_step(
        work.module, work, create_optimizer(work.module.parameters(), device), device
    )
    mark = StartMark(work.module, warmup, device)
    for index in range(warmup + steps):
        step(work.batch(index))
    synchronize(device)
    assert mark.started is not None
    return time.perf_counter() - mark.started


def run_lampdist(
    work: Workload, device: torch.device, warmup: int, steps: int, library: ModuleType
) -> float:
    ends: list[float] = []

    async def on_event(event: Any) -> None:
        if event.kind == "train" and event.done:
            synchronize(device)  # a no-op: the pass has waited for its last step
            ends.append(time.perf_counter())

    async def train() -> None:
        await library.local_data_parallel_training_loop(
            models_with_data_streams=[
                library.ModelWithData(
                    model=library.SupervisedModel(work.module, work.spec.loss_fn),
                    train_batches=batch_source(work, warmup + steps),
                )
            ],
            optimizer_factory=lambda parameters: create_optimizer(parameters, device),
            loop=library.LoopOptions(max_epochs=1, on_event=on_event),
            step=library.StepOptions(autocast_dtype=work.spec.autocast_dtype),
        )

    mark = StartMark(work.module, warmup, device)
    anyio.run(train)
    if mark.started is None or len(ends) != 1:
        raise RuntimeError(f"expected one timed pass, got {len(ends)} ends")
    return ends[0] - mark.started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device(
            "cuda", torch.cuda.current_device() if device.index is None else device.index
        )
        torch.cuda.set_device(device)
    libraries: dict[str, ModuleType] = {"lampdist": lampdist}
    for item in args.tree:
        name, _, path = item.partition("=")
        if not name or not path or name in ("plain", "lampdist"):
            parser.error(f"--tree {item!r}: expected NAME=PATH with a new name")
        libraries[name] = load_tree(name, path)
    configs = ["plain", *libraries]
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for repeat in range(args.repeats):
        for name in configs[repeat % len(configs) :] + configs[: repeat % len(configs)]:
            work = build_workload(args.model, device, rank=0)
            if name == "plain":
                seconds = run_plain(work, device, args.warmup, args.steps)
            else:
                seconds = run_lampdist(work, device, args.warmup, args.steps, libraries[name])
            rate = args.steps * work.spec.batch_size / seconds
            rates[name].append(rate)
            print(f"[{repeat + 1}/{args.repeats}] {name}: {rate:.1f} samples/s", flush=True)
    plain = statistics.median(rates["plain"])
    summary: dict[str, Any] = {
        "device": str(device),
        "model": args.model,
        "steps": args.steps,
        "torch": torch.__version__,
        "configs": {},
    }
    print(f"\n{args.model} on {device}, {args.steps} timed steps, {args.repeats} repeats")
    print(f"{'config':12s} {'samples/s':>10s} {'of plain':>9s}  runs")
    for name in configs:
        median = statistics.median(rates[name])
        summary["configs"][name] = {
            "samples_per_s": median,
            "samples_per_s_runs": rates[name],
            "of_plain": median / plain,
        }
        runs = " / ".join(f"{rate:.0f}" for rate in rates[name])
        print(f"{name:12s} {median:10.1f} {median / plain:9.3f}  {runs}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
