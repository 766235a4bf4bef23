"""A rank alone in one process against the plain loop, in the same process, interleaved.

    python benchmarks/rank_alone.py                          # CPU, the small model
    python benchmarks/rank_alone.py --device cuda --steps 1000 --repeats 5 --json out.json
    python benchmarks/rank_alone.py --tree before=/path/to/other/src   # another lampdist too
    python benchmarks/rank_alone.py --variant off=measure_step_split:false \
        --variant all=measure_grad_norm:true,flops:count        # lampdist with other options

Where ``throughput.py --nranks 1`` starts a process per run and goes through ``lampdist.train``
over TCP, this measures what a rank alone costs the host per step with nothing else around:
``local_data_parallel_training_loop`` with one entry, beside the plain loop of
``_loops.training_step``, on the same model, optimizer and batches, in one process (the
configurations take turns, the order rotating each repeat). Both are timed from the first timed
batch's forward (a device synchronization first) to the end: the plain loop's last step
synchronized, lampdist's pass's last progress event. ``--tree NAME=PATH`` adds the lampdist of
another source tree (``PATH/lampdist``) as configuration ``NAME``, to compare two versions in
one run. ``--variant NAME=key:value,...`` adds this lampdist with other step options as
configuration ``NAME`` (``flops:count`` or ``flops:N`` sets the model's ``flops_per_example``
instead; ``model:loss`` runs the same forward and loss as a ``LossModel``). The table gives the
median samples/s and its ratio to the plain loop's median (and to ``--baseline``'s, a
configuration's name), and each lampdist configuration's telemetry of its last pass (MFU,
gradient norm, the step split in ms a step) goes into the JSON.
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
from throughput import parse_value


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
    work: Workload,
    device: torch.device,
    warmup: int,
    steps: int,
    library: ModuleType,
    options: dict[str, Any] | None = None,
    seen: list[Any] | None = None,
) -> float:
    """Seconds of the timed steps of lampdist (``library``) with the step options
    ``options`` (key ``flops``: the model's ``flops_per_example``); the pass's last event goes
    into ``seen``."""
    ends: list[float] = []
    kwargs = dict(options or {})
    flops = kwargs.pop("flops", None)
    kind = kwargs.pop("model", "supervised")
    model_options = {} if flops is None else {"flops_per_example": flops}
    if kind == "loss":  # the same forward and loss as a LossModel over (inputs, target)
        loss_fn = work.spec.loss_fn

        def loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
            inputs, target = batch
            return loss_fn(module(inputs), target)  # type: ignore[no-any-return]

        model = library.LossModel(work.module, loss, **model_options)
    else:
        model = library.SupervisedModel(work.module, work.spec.loss_fn, **model_options)

    async def on_event(event: Any) -> None:
        if event.kind == "train" and event.done:
            synchronize(device)  # a no-op: the pass has waited for its last step
            ends.append(time.perf_counter())
            if seen is not None:
                seen.append(event)

    async def train() -> None:
        await library.local_data_parallel_training_loop(
            models_with_data_streams=[
                library.ModelWithData(
                    model=model,
                    train_batches=batch_source(work, warmup + steps),
                )
            ],
            optimizer_factory=lambda parameters: create_optimizer(parameters, device),
            loop=library.LoopOptions(max_epochs=1, on_event=on_event),
            step=library.StepOptions(autocast_dtype=work.spec.autocast_dtype, **kwargs),
        )

    mark = StartMark(work.module, warmup, device)
    anyio.run(train)
    if mark.started is None or len(ends) != 1:
        raise RuntimeError(f"expected one timed pass, got {len(ends)} ends")
    return ends[0] - mark.started


def telemetry(event: Any) -> dict[str, Any] | None:
    """A pass's telemetry as JSON values (``None`` for a lampdist without it)."""
    values = getattr(event, "telemetry", None)
    if values is None:
        return None
    plain: dict[str, Any] = values()
    plain["flops_per_example"] = event.flops_per_example
    plain["peak_flops"] = event.peak_flops
    plain["examples_per_second"] = event.examples_per_second
    return plain


def describe(event: Any) -> str:
    """One line of a pass's telemetry."""
    if getattr(event, "telemetry", None) is None:
        return "(no telemetry)"
    text = "MFU -" if event.mfu is None else f"MFU {event.mfu:.1%}"
    if event.grad_norm is not None:
        text += f", grad norm {event.grad_norm:.3g}"
    slowest = event.slowest
    if slowest is not None:
        parts = ", ".join(f"{k} {v * 1000:.2f}" for k, v in slowest.per_step().items())
        text += f"; ms a step: {parts}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=KEY:VALUE,...")
    parser.add_argument("--baseline", default="plain", help="the configuration ratios are to")
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
    variants: dict[str, dict[str, Any]] = {}
    for item in args.variant:
        name, _, body = item.partition("=")
        if not name or name in ("plain", *libraries, *variants):
            parser.error(f"--variant {item!r}: expected NAME=KEY:VALUE,... with a new name")
        variants[name] = {}
        for pair in filter(None, body.split(",")):
            key, _, value = pair.partition(":")
            variants[name][key] = parse_value(value)
    configs = ["plain", *libraries, *variants]
    if args.baseline not in configs:
        parser.error(f"--baseline {args.baseline!r}: not one of {configs}")
    events: dict[str, list[Any]] = {name: [] for name in configs}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for repeat in range(args.repeats):
        for name in configs[repeat % len(configs) :] + configs[: repeat % len(configs)]:
            work = build_workload(args.model, device, rank=0)
            if name == "plain":
                seconds = run_plain(work, device, args.warmup, args.steps)
            elif name in variants:
                seconds = run_lampdist(
                    work, device, args.warmup, args.steps, lampdist, variants[name], events[name]
                )
            else:
                seconds = run_lampdist(
                    work, device, args.warmup, args.steps, libraries[name], None, events[name]
                )
            rate = args.steps * work.spec.batch_size / seconds
            rates[name].append(rate)
            print(f"[{repeat + 1}/{args.repeats}] {name}: {rate:.1f} samples/s", flush=True)
    plain = statistics.median(rates["plain"])
    baseline = statistics.median(rates[args.baseline])
    summary: dict[str, Any] = {
        "device": str(device),
        "model": args.model,
        "steps": args.steps,
        "torch": torch.__version__,
        "configs": {},
    }
    print(f"\n{args.model} on {device}, {args.steps} timed steps, {args.repeats} repeats")
    print(f"{'config':12s} {'samples/s':>10s} {'of plain':>9s} {'of ' + args.baseline:>9s}  runs")
    for name in configs:
        median = statistics.median(rates[name])
        summary["configs"][name] = {
            "samples_per_s": median,
            "samples_per_s_runs": rates[name],
            "of_plain": median / plain,
            f"of_{args.baseline}": median / baseline,
            "options": variants.get(name, {}),
            "telemetry": telemetry(events[name][-1]) if events[name] else None,
        }
        runs = " / ".join(f"{rate:.0f}" for rate in rates[name])
        print(f"{name:12s} {median:10.1f} {median / plain:9.3f} {median / baseline:9.3f}  {runs}")
        if events[name]:
            print(f"{'':12s} {describe(events[name][-1])}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
