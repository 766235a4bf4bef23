"""What starting costs: import times, and the event loop's longest gap while a first run's
heavy import (``torch._dynamo``) is made.

    python benchmarks/start_up.py                       # 5 fresh interpreters per figure
    python benchmarks/start_up.py --before /tmp/old/src # also another checkout's src/

Import times, each in a fresh interpreter, the kinds interleaved: ``import torch``,
``import lampdist``, its first use (``lampdist.train``: the whole library), and
``lampdist --help``. Loop gaps: a ticker sleeps 1 ms in a loop on the event loop while
``torch._dynamo`` is imported on the loop itself, in a worker thread, or by lampdist's preload
(a worker thread, with the import's garbage collections deferred); the largest gap is the
longest the loop served nothing. Medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

TIMED = "import time\nt = time.perf_counter()\n{}\nprint(time.perf_counter() - t)"
IMPORTS = {
    "import torch": "import torch",
    "import lampdist": "import lampdist",
    "lampdist.train": "import lampdist; lampdist.train",
    "lampdist --help": (
        "import contextlib, io, lampdist.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    lampdist.cli.main(['--help'])"
    ),
}

GAP = """
import importlib, sys, time
import anyio, anyio.to_thread, torch

async def main(way):
    late, done = [], anyio.Event()

    async def ticker():
        while not done.is_set():
            before = time.perf_counter()
            await anyio.sleep(0.001)
            late.append(time.perf_counter() - before - 0.001)

    async with anyio.create_task_group() as group:
        group.start_soon(ticker)
        await anyio.sleep(0.2)
        late.clear()
        if way == "on the loop":
            importlib.import_module("torch._dynamo")
        elif way == "worker thread":
            await anyio.to_thread.run_sync(importlib.import_module, "torch._dynamo")
        else:
            from lampdist._preload import preload
            await preload()
        await anyio.sleep(0.05)
        done.set()
    print(max(late))

anyio.run(main, sys.argv[1])
"""
WAYS = ("on the loop", "worker thread", "preload")


def _run(src: Path, *args: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per figure")
    parser.add_argument("--before", type=Path, help="another checkout's src/ to time as well")
    args = parser.parse_args(argv)
    sources = {"": SRC, " (before)": args.before} if args.before else {"": SRC}
    times: dict[str, list[float]] = {}
    for _ in range(args.runs):
        for name, code in IMPORTS.items():
            for label, src in sources.items():
                if name == "import torch" and label:
                    continue
                key = f"{name}{label}"
                times.setdefault(key, []).append(_run(src, "-c", TIMED.format(code)))
    print(f"seconds, median of {args.runs} (min-max)")
    for key, values in times.items():
        print(f"  {key:<28} {statistics.median(values):6.3f} ({min(values):.3f}-{max(values):.3f})")
    gaps: dict[str, list[float]] = {}
    for _ in range(args.runs):
        for way in WAYS:
            gaps.setdefault(way, []).append(1e3 * _run(SRC, "-c", GAP, way))
    print(
        f"the event loop's largest gap while torch._dynamo is imported, ms, median of {args.runs}"
    )
    for way, values in gaps.items():
        print(f"  {way:<28} {statistics.median(values):6.1f} ({min(values):.1f}-{max(values):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
