"""Checkpoint write throughput: lampdist.checkpoint.to_directory against a plain torch.save.

Writes a model state dict of ``--size-mb`` MB of float32 tensors to the same disk three
ways, ``--repeats`` times each, interleaved, after an untimed warm-up, with no dirty pages
in flight (``os.sync`` before every write, untimed):

- ``torch.save``: one file, no fsync (what most training scripts do; not crash safe);
- ``torch.save + fsync``: the same, made durable;
- ``to_directory``: lampdist's atomic checkpoint (a checksum of every byte, fsync of every
  file and directory, rename into place, fsync of the parent, pruning to ``keep=3``).

Prints a table (median and best of the repeats, each as GB/s and as a ratio to plain
``torch.save`` and to ``torch.save + fsync``, CPU seconds of all threads) and a JSON line,
also written to ``--json PATH``. The target is ``to_directory`` >= 0.8x the throughput of a
plain torch.save. Point ``--dir`` at the disk the checkpoints will go to::

    python benchmarks/checkpoint_write.py --size-mb 1024 --repeats 5 --dir /mnt/nvme --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import torch

from lampdist import LoopState, TrainingState, checkpoint


def make_model_state(size_mb: int, tensors: int) -> dict[str, torch.Tensor]:
    elements = size_mb * 2**20 // 4 // tensors
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(elements, generator=generator) for i in range(tensors)}


def plain_save(model_state: dict[str, torch.Tensor], path: Path, *, fsync: bool) -> None:
    torch.save(model_state, path)
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


KEEP = 3
TARGET = 0.8
"""The goal: to_directory at >= this fraction of a plain torch.save's throughput."""


def warm_up(model_state: dict[str, torch.Tensor], root: Path) -> None:
    """Fill and free as much page cache as the measurements will use, untimed.

    On a virtual machine the first write into never-touched memory is several times
    slower (the host backs guest pages lazily), which would penalise whichever method
    happens to grow the page cache first.
    """
    paths = [root / f"warm-up-{i}.pt" for i in range(KEEP + 2)]
    for path in paths:
        torch.save(model_state, path)
    for path in paths:
        path.unlink()
    os.sync()


def timed(write: Callable[[], None]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (all threads of this process) of one write."""
    os.sync()  # start each write with no dirty pages of the previous one in flight
    started, cpu_started = time.perf_counter(), time.process_time()
    write()
    return time.perf_counter() - started, time.process_time() - cpu_started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="model size in MB (2**20 B)")
    parser.add_argument("--tensors", type=int, default=16, help="number of tensors")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir",
        "--directory",
        dest="directory",
        type=Path,
        default=None,
        help="write into a scratch directory made here (default: the system's temp dir)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()

    model_state = make_model_state(args.size_mb, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in model_state.values())
    root = Path(tempfile.mkdtemp(prefix="lampdist-bench-", dir=args.directory))
    seconds: dict[str, list[tuple[float, float]]] = {"torch.save": [], "torch.save + fsync": []}
    seconds["to_directory"] = []
    save = checkpoint.to_directory(root / "checkpoints", keep=KEEP)
    try:
        warm_up(model_state, root)
        for repeat in range(-1, args.repeats):  # repeat -1 warms up, untimed
            path = root / f"plain-{repeat}.pt"
            seconds["torch.save"].append(
                timed(functools.partial(plain_save, model_state, path, fsync=False))
            )
            path.unlink()
            path = root / f"durable-{repeat}.pt"
            seconds["torch.save + fsync"].append(
                timed(functools.partial(plain_save, model_state, path, fsync=True))
            )
            path.unlink()
            state = TrainingState(
                loop_state=LoopState(epoch=repeat + 1),
                model_state=model_state,
                optimizer_state={"state": {}, "param_groups": []},
            )
            seconds["to_directory"].append(timed(functools.partial(anyio.run, save, state, None)))
        for measured in seconds.values():
            del measured[0]  # the warm-up round
        loaded = checkpoint.load_latest(root / "checkpoints")  # untimed: is it intact?
        if loaded is None or loaded.epoch != args.repeats:
            raise SystemExit("the last checkpoint did not load back")
        del loaded
    finally:
        shutil.rmtree(root)

    def walls(method: str) -> list[float]:
        return [wall for wall, _ in seconds[method]]

    base_median = statistics.median(walls("torch.save"))
    base_best = min(walls("torch.save"))
    durable_median = statistics.median(walls("torch.save + fsync"))
    durable_best = min(walls("torch.save + fsync"))
    rows = []
    for method, measured in seconds.items():
        wall = walls(method)
        rows.append(
            {
                "method": method,
                "median_s": round(statistics.median(wall), 4),
                "best_s": round(min(wall), 4),
                "median_gb_per_s": round(nbytes / statistics.median(wall) / 1e9, 3),
                "best_gb_per_s": round(nbytes / min(wall) / 1e9, 3),
                "median_vs_torch_save": round(base_median / statistics.median(wall), 3),
                "best_vs_torch_save": round(base_best / min(wall), 3),
                "median_vs_durable_save": round(durable_median / statistics.median(wall), 3),
                "best_vs_durable_save": round(durable_best / min(wall), 3),
                "median_cpu_s": round(statistics.median(cpu for _, cpu in measured), 4),
                "all_s": [round(w, 4) for w in wall],
            }
        )
    print(f"{nbytes / 1e9:.3f} GB in {args.tensors} tensors, {args.repeats} repeats, {root.parent}")
    print(f"{'':<20} {'---------- median ----------':>36} {'----------- best -----------':>36}")
    header = f"{'s':>7} {'GB/s':>6} {'x save':>7} {'x save+fsync':>13}"
    print(f"{'method':<20} {header}  {header} {'cpu s':>6}")
    for row in rows:
        cells = [
            f"{row[f'{kind}_s']:>7.3f} {row[f'{kind}_gb_per_s']:>6.2f} "
            f"{row[f'{kind}_vs_torch_save']:>7.2f} {row[f'{kind}_vs_durable_save']:>13.2f}"
            for kind in ("median", "best")
        ]
        print(f"{row['method']:<20} {cells[0]}  {cells[1]} {row['median_cpu_s']:>6.2f}")
    ours_ratio = base_median / statistics.median(walls("to_directory"))
    report = {
        "benchmark": "checkpoint_write",
        "bytes": nbytes,
        "tensors": args.tensors,
        "repeats": args.repeats,
        "directory": str(root.parent),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "target_vs_torch_save": TARGET,
        "target_met_median": ours_ratio >= TARGET,
        "results": rows,
    }
    print(json.dumps(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
