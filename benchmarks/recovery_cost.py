"""What ``LoopOptions(recovery=...)`` costs a run that loses nothing: its snapshot per pass.

    python benchmarks/recovery_cost.py                       # CPU, the small model
    python benchmarks/recovery_cost.py --device cuda --model gpt --windows 10 --window-steps 100 \\
        --repeats 3 --json out.json
    python benchmarks/recovery_cost.py --snapshot-every-steps 1 5 20   # also with snapshots
                                                                        # every K steps

The root (alone, over its TCP channel as ``drive_distributed_training`` runs it) trains
``--windows`` windows of ``--window-steps`` steps (``StepOptions(steps_per_epoch=...)``)
without and with :class:`lampdist.Recovery`, taking turns in one process. With recovery the
root takes a snapshot after every window: every rank's stream position and RNG states (one
gather) and a copy of the model and the optimizer state. The run is timed from the first
window's first step to the end of the last window; the table gives each configuration's
median, and recovery's time over the time without it. ``--windows-only`` times only the
windows themselves (the sum of the passes' own times), which the snapshot leaves alone: the
steps cost the same either way. With ``--snapshot-every-steps K ...`` each K is one more
configuration, ``Recovery(snapshot_every_steps=K)``: a snapshot every K steps within the
windows too (named ``K<k>`` in the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch

import lampdist
from _loops import batch_source, create_optimizer, synchronize
from _models import MODELS, build_workload
from lampdist import control


async def run_once(
    model_name: str,
    device: torch.device,
    windows: int,
    steps: int,
    recovery: bool,
    every: int | None = None,
) -> dict[str, float]:
    """One run of ``windows`` windows: its seconds from the first step to the end, and the
    passes' own seconds summed."""
    work = build_workload(model_name, device, rank=0)
    marks: list[float] = []
    passes: list[float] = []

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.kind != "train":
            return
        if not marks:
            marks.append(time.perf_counter() - event.seconds)
        if event.done:
            passes.append(event.seconds)

    loop = lampdist.LoopOptions(
        max_epochs=windows,
        on_event=on_event,
        recovery=lampdist.Recovery(snapshot_every_steps=every) if recovery else None,
    )
    async with control.tcp_root("127.0.0.1", 0, nranks=1, secret="bench") as root:
        await lampdist.drive_distributed_training(
            data=lampdist.ModelWithData(
                model=lampdist.SupervisedModel(work.module, work.spec.loss_fn),
                train_batches=batch_source(work, steps),
            ),
            nranks=1,
            device=device,
            control=root,
            optimizer_factory=lambda parameters: create_optimizer(parameters, device),
            loop=loop,
            step=lampdist.StepOptions(
                steps_per_epoch=steps, autocast_dtype=work.spec.autocast_dtype
            ),
        )
    synchronize(device)
    end = time.perf_counter()
    if len(passes) != windows:
        raise RuntimeError(f"expected {windows} windows, got {len(passes)}")
    return {"run": end - marks[0], "windows": sum(passes)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--window-steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--snapshot-every-steps",
        type=int,
        nargs="*",
        default=[],
        help="also time Recovery(snapshot_every_steps=K) for each K",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    configs: dict[str, int | None] = {"off": None, "recovery": None}
    configs |= {f"K{every}": every for every in args.snapshot_every_steps}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for repeat in range(args.repeats):
        order = list(configs) if repeat % 2 == 0 else list(reversed(configs))
        for name in order:
            measured = anyio.run(
                run_once,
                args.model,
                device,
                args.windows,
                args.window_steps,
                name != "off",
                configs[name],
            )
            results[name].append(measured)
            print(f"repeat {repeat} {name:8} run {measured['run']:.3f} s", flush=True)
    summary: dict[str, Any] = {}
    for name, runs in results.items():
        summary[name] = {
            "run_median_s": statistics.median(r["run"] for r in runs),
            "windows_median_s": statistics.median(r["windows"] for r in runs),
        }
    off, on = summary["off"], summary["recovery"]
    ratio = on["run_median_s"] / off["run_median_s"]
    per_snapshot = (on["run_median_s"] - off["run_median_s"]) / args.windows
    print(f"{'config':10} {'run s':>9} {'windows s':>10}")
    for name, row in summary.items():
        print(f"{name:10} {row['run_median_s']:9.3f} {row['windows_median_s']:10.3f}")
    print(f"recovery / off: {ratio:.4f} (about {per_snapshot * 1e3:.1f} ms a window)")
    ratios = {name: row["run_median_s"] / off["run_median_s"] for name, row in summary.items()}
    for name in configs:
        if name.startswith("K"):
            print(f"{name} / off: {ratios[name]:.4f}")
    if args.json:
        meta = {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "model": args.model,
            "windows": args.windows,
            "window_steps": args.window_steps,
            "repeats": args.repeats,
        }
        with open(args.json, "w") as file:
            json.dump(
                {
                    "meta": meta,
                    "runs": results,
                    "summary": summary,
                    "ratio": ratio,
                    "ratios": ratios,
                    "per_window_s": per_snapshot,
                },
                file,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
