"""Side-by-side training throughput: a plain single-device loop, torch DDP, torch FSDP2 and
lampdist.

    python benchmarks/throughput.py                      # CPU: Gloo, 2 ranks, the small model
    python benchmarks/throughput.py --mode gpu --repeats 3 --json results.json
    python benchmarks/throughput.py --mode gpu --configs fsdp,lampdist-fsdp   # FSDP2 both ways

Every configuration trains the same model, with the same optimizer, batch size per device and
data, in fresh processes (one per rank); the configurations are interleaved and the whole
round is repeated. The table (stdout) and the JSON (``--json PATH``) give the median samples/s,
the scaling efficiency against n times the single-device loop, the ratio to DDP, the peak
memory of each rank and the bytes of parameters, gradients and optimizer state each rank
holds. See docs/performance.md for the method.

``fsdp`` is a plain loop over a model sharded with FSDP2 (``fully_shard`` on each of the
model's blocks, then the root), its gradients summed over the ranks as lampdist's
``step_on="fsdp"`` sums them and each batch's mean loss divided by the ranks; ``lampdist-fsdp``
is lampdist's ``step_on="fsdp"`` with ``FsdpPolicy(shard_modules=<the model's blocks>)``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from _launch import BenchmarkError, Config, Settings, launch
from _loops import Kind, RankResult
from _models import MODELS, count_parameters

BUILT_IN: dict[str, Config] = {
    "single": Config(name="single", kind="single"),
    "independent": Config(name="independent", kind="independent"),
    "ddp": Config(name="ddp", kind="ddp"),
    "fsdp": Config(name="fsdp", kind="fsdp"),
    "lampdist": Config(name="lampdist", kind="lampdist"),
    "lampdist-every": Config(
        name="lampdist-every", kind="lampdist", kwargs={"step_on": "every_rank"}
    ),
    "lampdist-sharded": Config(
        name="lampdist-sharded", kind="lampdist", kwargs={"step_on": "sharded"}
    ),
    # fsdp_blocks: the harness turns it into FsdpPolicy(shard_modules=<the model's blocks>)
    "lampdist-fsdp": Config(
        name="lampdist-fsdp", kind="lampdist", kwargs={"step_on": "fsdp", "fsdp_blocks": True}
    ),
}
DEFAULT_CONFIGS = ("single", "ddp", "lampdist", "lampdist-every", "lampdist-sharded")
CPU_RANKS = 2


def parse_value(text: str) -> Any:
    """A variant's value: true/false, none, an int, a float, or else the string itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_configs(items: Sequence[str]) -> list[Config]:
    """``--configs`` items: built-in names (comma-separated or not) and variants
    ``name=key:value,key:value``. A variant whose name starts with ``ddp`` passes its keywords
    to DistributedDataParallel; one whose name starts with ``fsdp`` passes its keywords to
    ``fully_shard`` (and ``blocks:false`` shards the root module alone); any other variant is a
    lampdist one (``fsdp_blocks:true`` gives it ``FsdpPolicy(shard_modules=<the model's
    blocks>)``). Raises ValueError."""
    configs: list[Config] = []
    for item in items:
        if "=" in item:
            name, _, body = item.partition("=")
            if not name or name in BUILT_IN:
                raise ValueError(f"variant {item!r}: give it a name of its own, not {name!r}")
            kwargs: dict[str, Any] = {}
            for pair in filter(None, body.split(",")):
                key, colon, value = pair.partition(":")
                if not key or not colon:
                    raise ValueError(f"variant {name!r}: expected key:value, got {pair!r}")
                kwargs[key] = parse_value(value)
            kind: Kind = "lampdist"
            if name.startswith("ddp"):
                kind = "ddp"
            elif name.startswith("fsdp"):
                kind = "fsdp"
            configs.append(Config(name=name, kind=kind, kwargs=kwargs))
            continue
        for name in filter(None, item.split(",")):
            if name not in BUILT_IN:
                raise ValueError(
                    f"unknown configuration {name!r}: use one of {', '.join(BUILT_IN)} "
                    "or a variant name=key:value,..."
                )
            configs.append(BUILT_IN[name])
    names = [config.name for config in configs]
    if not configs or len(set(names)) != len(names):
        raise ValueError(f"--configs needs distinct configurations, got {names}")
    return configs


def summarize(
    configs: Sequence[Config], runs: dict[str, list[list[RankResult]]]
) -> dict[str, dict[str, Any]]:
    """Per configuration: samples/s of each repeat and their median, scaling efficiency
    (median / (ranks x the single loop's median)), the ratio to DDP (``vs_ddp``: this median
    over DDP's median; ``vs_ddp_paired``: the median of the per-repeat ratios, each repeat
    against the DDP run beside it), each rank's peak memory and the bytes of the parameters,
    gradients and optimizer state it held (each the largest over the repeats)."""
    throughput: dict[str, list[float]] = {}
    summary: dict[str, dict[str, Any]] = {}
    for config in configs:
        per_repeat = []
        for results in runs[config.name]:
            timed = [result for result in results if result.seconds is not None]
            samples = sum(result.samples or 0 for result in timed)
            per_repeat.append(samples / max(result.seconds or 0.0 for result in timed))
        throughput[config.name] = per_repeat
        ranks = len(runs[config.name][0])
        summary[config.name] = {
            "kind": config.kind,
            "ranks": ranks,
            "kwargs": config.kwargs,
            "samples_per_s": statistics.median(per_repeat),
            "samples_per_s_runs": per_repeat,
            "seconds_runs": [
                max(result.seconds for result in results if result.seconds is not None)
                for results in runs[config.name]
            ],
            "peak_memory_bytes": [
                max(results[rank].peak_memory_bytes for results in runs[config.name])
                for rank in range(ranks)
            ],
            **{
                field: [
                    max(getattr(results[rank], field) for results in runs[config.name])
                    for rank in range(ranks)
                ]
                for field in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")
            },
        }
    for name, entry in summary.items():
        single = summary.get("single")
        efficient = single is not None and name != "single"
        entry["scaling_efficiency"] = (
            entry["samples_per_s"] / (entry["ranks"] * single["samples_per_s"])
            if efficient and single is not None
            else None
        )
        compared = "ddp" in summary and name != "ddp"
        entry["vs_ddp"] = (
            entry["samples_per_s"] / summary["ddp"]["samples_per_s"] if compared else None
        )
        entry["vs_ddp_paired"] = (
            statistics.median(
                mine / theirs
                for mine, theirs in zip(throughput[name], throughput["ddp"], strict=True)
            )
            if compared
            else None
        )
    return summary


def format_table(meta: dict[str, Any], summary: dict[str, dict[str, Any]]) -> str:
    """The human-readable report."""
    lines = [
        f"model {meta['model']}: {meta['model_description']}; {meta['parameters']:,} parameters; "
        f"batch {meta['batch_size_per_rank']} per rank",
        f"{meta['device']} x {meta['nranks']} ranks ({meta['backend']}), {meta['steps']} timed "
        f"steps after {meta['warmup']} warm-up steps, {meta['repeats']} repeat(s), medians; "
        f"torch {meta['torch']}",
        "",
    ]
    header = (
        "config",
        "ranks",
        "samples/s",
        "runs",
        "efficiency",
        "vs DDP",
        "paired",
        "peak MiB per rank",
        "params / grads / optimizer MiB per rank",
    )
    rows = [header]
    for name, entry in summary.items():
        efficiency, ratio, paired = (
            entry["scaling_efficiency"],
            entry["vs_ddp"],
            entry["vs_ddp_paired"],
        )
        rows.append(
            (
                name,
                str(entry["ranks"]),
                f"{entry['samples_per_s']:.1f}",
                " / ".join(f"{value:.0f}" for value in entry["samples_per_s_runs"]),
                "-" if efficiency is None else f"{100 * efficiency:.1f}%",
                "-" if ratio is None else f"{ratio:.3f}",
                "-" if paired is None else f"{paired:.3f}",
                " / ".join(f"{peak / 2**20:.0f}" for peak in entry["peak_memory_bytes"]),
                " | ".join(
                    " / ".join(f"{size / 2**20:.1f}" for size in sizes)
                    for sizes in zip(
                        entry["parameter_bytes"],
                        entry["gradient_bytes"],
                        entry["optimizer_state_bytes"],
                        strict=True,
                    )
                ),
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    for row in rows:
        cells = [
            cell.ljust(width) if column in (0, 3, 7, 8) else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[Config]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--mode", choices=("cpu", "gpu"), default=None)
    parser.add_argument("--model", choices=sorted(MODELS), default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--nranks", type=int, default=None)
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds allowed to each configuration run"
    )
    args = parser.parse_args(argv)
    if args.mode is None:
        args.mode = "gpu" if torch.cuda.is_available() else "cpu"
    if args.model is None:
        args.model = "gpt" if args.mode == "gpu" else "small"
    if args.mode == "gpu":
        if not torch.cuda.is_available():
            parser.error("--mode gpu needs CUDA; use --mode cpu")
        if args.nranks is None:
            args.nranks = torch.cuda.device_count()
        if args.nranks > torch.cuda.device_count():
            parser.error(f"--nranks {args.nranks}: only {torch.cuda.device_count()} GPUs")
    elif args.nranks is None:
        args.nranks = CPU_RANKS
    for flag in ("steps", "warmup", "repeats", "nranks"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    try:
        configs = parse_configs(args.configs)
    except ValueError as exc:
        parser.error(str(exc))
    return args, configs


def main(argv: Sequence[str] | None = None) -> int:
    args, configs = parse_args(argv)
    gpu = args.mode == "gpu"
    settings = Settings(
        device_type="cuda" if gpu else "cpu",
        model=args.model,
        nranks=args.nranks,
        steps=args.steps,
        warmup=args.warmup,
        threads=0 if gpu else max(1, (os.cpu_count() or 1) // args.nranks),
        timeout=args.timeout,
    )
    spec = MODELS[args.model]
    meta: dict[str, Any] = {
        "mode": args.mode,
        "device": torch.cuda.get_device_name(0) if gpu else platform.processor() or "cpu",
        "backend": "nccl" if gpu else "gloo",
        "nranks": args.nranks,
        "model": args.model,
        "model_description": spec.describe,
        "parameters": count_parameters(args.model),
        "batch_size_per_rank": spec.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "cpu_threads_per_rank": settings.threads or None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    print(f"{args.model}: {meta['parameters']:,} parameters", file=sys.stderr)
    runs: dict[str, list[list[RankResult]]] = {config.name: [] for config in configs}
    with tempfile.TemporaryDirectory(prefix="lampdist-bench-") as scratch:
        for repeat in range(args.repeats):
            shift = repeat % len(configs)
            for config in [*configs[shift:], *configs[:shift]]:
                try:
                    results = launch(config, settings, Path(scratch) / f"{repeat}-{config.name}")
                except BenchmarkError as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 1
                runs[config.name].append(results)
                rate = summarize([config], {config.name: [results]})
                print(
                    f"[{repeat + 1}/{args.repeats}] {config.name}: "
                    f"{rate[config.name]['samples_per_s']:.1f} samples/s",
                    file=sys.stderr,
                )
    summary = summarize(configs, runs)
    print(format_table(meta, summary))
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "configs": summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
