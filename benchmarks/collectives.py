"""Collective bandwidth through the clique against raw torch.distributed on the same devices.

One process per rank (``--nranks``, default: every CUDA device, or 2 CPU ranks), fresh for
each measurement: a set of processes either opens a clique or builds a plain process group
of the same backend the way torch.distributed builds one, never both (neither shares its
process with the other's communicator), and times
``all_reduce``, ``reduce`` and ``broadcast`` of one flat float32 buffer allocated before the
group. The clique awaits each collective on an event loop (``await
clique.all_reduce([buffer])``); the raw group calls ``work.wait()``. On CUDA both only order
the stream per call and synchronise the device once per timed batch. The two alternate
``--repeats`` times (the order flips each repeat) and the medians are compared.

The issue columns give the time per call until the last call returned, before the final
synchronisation: on CUDA a call returns once its collective is queued, so an issue time close
to the total means the host, not the GPU, set the pace.

Bus bandwidth follows nccl-tests: ``size / time`` for broadcast and reduce, times
``2 (n - 1) / n`` for all_reduce. The ratio column is clique / raw (target: 0.95 or more).

    python benchmarks/collectives.py                      # CUDA if present, else CPU (Gloo)
    python benchmarks/collectives.py --mode cpu --size-mib 16 --json out.json
    python benchmarks/collectives.py --mode cuda --size-mib 256 --iters 50 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from lampdist.clique import Clique, CliqueId, open_clique, serve_rendezvous

__all__ = ["main"]

OPS = ("all_reduce", "reduce", "broadcast")
IMPLEMENTATIONS = ("raw", "clique")
SOURCE = Path(__file__).resolve().parents[1] / "src"  # this checkout's lampdist, for the ranks


def _bus_factor(op: str, nranks: int) -> float:
    return 2 * (nranks - 1) / nranks if op == "all_reduce" else 1.0


def _raw_group(clique_id: CliqueId, name: str, rank: int, device: torch.device) -> tuple[Any, Any]:
    """A plain process group: torch.distributed's own construction, on the launcher's store."""
    store = TCPStore(clique_id.host, clique_id.port, None, False, timeout=timedelta(seconds=120))
    prefixed = PrefixStore(f"{clique_id.prefix}/{name}", store)
    timeout = timedelta(seconds=120)
    group: Any
    if device.type == "cuda":
        nccl: Any = dist.ProcessGroupNCCL  # present in CUDA builds only
        nccl_options = nccl.Options()
        nccl_options._timeout = timeout
        group = nccl(prefixed, rank, clique_id.nranks, nccl_options)
        group.eager_connect_single_device(device)
    else:
        gloo_options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # stubs: Options
        gloo_options._devices = [ProcessGroupGloo.create_device(hostname=clique_id.host)]
        gloo_options._timeout = timeout
        group = ProcessGroupGloo(prefixed, rank, clique_id.nranks, gloo_options)
    return group, store


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raw_issue(group: Any, op: str, buffer: torch.Tensor) -> Any:
    if op == "all_reduce":
        return group.allreduce([buffer])
    if op == "reduce":
        reduce_options = dist.ReduceOptions()
        reduce_options.rootRank = 0
        return group.reduce([buffer], reduce_options)
    broadcast_options = dist.BroadcastOptions()
    broadcast_options.rootRank = 0
    return group.broadcast([buffer], broadcast_options)


async def _clique_issue(clique: Clique, op: str, buffer: torch.Tensor) -> None:
    if op == "all_reduce":
        await clique.all_reduce([buffer])
    elif op == "reduce":
        await clique.reduce([buffer], root=0)
    else:
        await clique.broadcast([buffer], root=0)


# (seconds per call, seconds per call until the last call returned): on CUDA a call returns
# once its collective is queued, so when the second is close to the first the host, not the
# GPU, set the pace.
Timing = tuple[float, float]


async def _time_clique(clique: Clique, op: str, buffer: torch.Tensor, iters: int) -> Timing:
    await clique.barrier()
    _sync(clique.device)
    start = time.perf_counter()
    for _ in range(iters):
        await _clique_issue(clique, op, buffer)
    issued = time.perf_counter()
    _sync(clique.device)
    return (time.perf_counter() - start) / iters, (issued - start) / iters


def _time_raw(group: Any, op: str, buffer: torch.Tensor, iters: int) -> Timing:
    group.barrier().wait()
    _sync(buffer.device)
    start = time.perf_counter()
    for _ in range(iters):
        _raw_issue(group, op, buffer).wait()
    issued = time.perf_counter()
    _sync(buffer.device)
    return (time.perf_counter() - start) / iters, (issued - start) / iters


async def _worker(config: dict[str, Any]) -> dict[str, Any]:
    clique_id = CliqueId.from_json(config["clique_id"])
    rank = int(config["rank"])
    device = torch.device(config["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    numel = int(config["size_mib"]) * (1 << 20) // 4
    buffer = torch.ones(numel, dtype=torch.float32, device=device)
    iters, warmup = int(config["iters"]), int(config["warmup"])
    times: dict[str, float] = {}
    issue: dict[str, float] = {}
    if config["implementation"] == "raw":

        def measure() -> None:
            group, store = _raw_group(clique_id, f"raw/{config['launch']}", rank, device)
            try:
                for op in OPS:  # warm up: NCCL channels, allocator, Gloo buffers
                    _time_raw(group, op, buffer, warmup)
                for op in OPS:
                    times[op], issue[op] = _time_raw(group, op, buffer, iters)
                group.barrier().wait()
                _sync(device)
            finally:
                if device.type == "cuda":
                    group.shutdown()
                del group, store

        await anyio.to_thread.run_sync(measure)
    else:
        async with open_clique(
            nranks=clique_id.nranks,
            rank=rank,
            device=device,
            clique_id=clique_id,
            setup_timeout=120.0,
            collective_timeout=120.0,
        ) as clique:
            for op in OPS:
                await _time_clique(clique, op, buffer, warmup)
            for op in OPS:
                times[op], issue[op] = await _time_clique(clique, op, buffer, iters)
            await clique.barrier()
    return {"rank": rank, "times": times, "issue": issue}


def _summarise(
    runs: dict[str, list[list[dict[str, Any]]]], nranks: int, size_mib: int
) -> dict[str, Any]:
    """``runs[implementation]`` holds one list of rank results per repeat."""
    size = size_mib * (1 << 20)
    table: dict[str, Any] = {}
    for op in OPS:
        row: dict[str, Any] = {}
        for implementation in IMPLEMENTATIONS:
            # Per repeat, the slowest rank's time; then the median over the repeats.
            per_repeat = [
                max(result["times"][op] for result in results) for results in runs[implementation]
            ]
            seconds = statistics.median(per_repeat)
            issue = statistics.median(
                max(result["issue"][op] for result in results) for results in runs[implementation]
            )
            row[implementation] = {
                "time_ms": 1e3 * seconds,
                "issue_ms": 1e3 * issue,
                "busbw_gbps": size * _bus_factor(op, nranks) / seconds / 1e9,
                "time_ms_runs": [1e3 * each for each in per_repeat],
            }
        row["ratio"] = row["clique"]["busbw_gbps"] / row["raw"]["busbw_gbps"]
        table[op] = row
    return table


async def _launch(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.mode == "cuda" or (args.mode == "auto" and torch.cuda.device_count() > 0)
    nranks = args.nranks or (torch.cuda.device_count() if cuda else 2)
    size_mib = args.size_mib or (256 if cuda else 16)
    env = dict(os.environ)
    source = str(SOURCE)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    runs: dict[str, list[list[dict[str, Any]]]] = {i: [] for i in IMPLEMENTATIONS}

    async def measure(implementation: str, launch: int) -> list[dict[str, Any]]:
        outputs: list[bytes] = [b""] * nranks
        async with serve_rendezvous(nranks=nranks) as clique_id:

            async def run(rank: int) -> None:
                config = {
                    "clique_id": clique_id.to_json(),
                    "implementation": implementation,
                    "launch": launch,
                    "rank": rank,
                    "device": f"cuda:{rank}" if cuda else "cpu",
                    "size_mib": size_mib,
                    "iters": args.iters,
                    "warmup": args.warmup,
                }
                command = [sys.executable, __file__, "--worker", json.dumps(config)]
                done = await anyio.run_process(command, env=env, stderr=None, check=False)
                if done.returncode != 0:
                    raise RuntimeError(
                        f"{implementation} rank {rank} exited with {done.returncode}"
                    )
                outputs[rank] = done.stdout

            async with anyio.create_task_group() as tg:
                for rank in range(nranks):
                    tg.start_soon(run, rank)
        return [json.loads(output.decode().strip().splitlines()[-1]) for output in outputs]

    launch = 0
    for repeat in range(args.repeats):
        for implementation in IMPLEMENTATIONS[:: 1 if repeat % 2 else -1]:
            runs[implementation].append(await measure(implementation, launch))
            launch += 1
    return {
        "backend": "nccl" if cuda else "gloo",
        "nranks": nranks,
        "size_mib": size_mib,
        "iters": args.iters,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "results": _summarise(runs, nranks, size_mib),
    }


def _print_table(report: dict[str, Any]) -> None:
    print(
        f"{report['backend']}, {report['nranks']} ranks, {report['size_mib']} MiB float32, "
        f"{report['iters']} iterations x {report['repeats']} repeats (medians), "
        f"torch {report['torch']}"
    )
    print(
        f"{'collective':<12}{'raw ms':>10}{'raw GB/s':>11}{'clique ms':>11}"
        f"{'clique GB/s':>13}{'ratio':>8}{'raw issue ms':>14}{'clique issue ms':>17}"
    )
    for op, row in report["results"].items():
        print(
            f"{op:<12}{row['raw']['time_ms']:>10.2f}{row['raw']['busbw_gbps']:>11.2f}"
            f"{row['clique']['time_ms']:>11.2f}{row['clique']['busbw_gbps']:>13.2f}"
            f"{row['ratio']:>8.3f}{row['raw']['issue_ms']:>14.2f}"
            f"{row['clique']['issue_ms']:>17.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark (or, with ``--worker``, one rank of it) and print the table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--nranks", type=int, default=0, help="default: all GPUs, or 2 on CPU")
    parser.add_argument("--size-mib", type=int, default=0, help="default: 256 CUDA, 16 CPU")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(anyio.run(_worker, json.loads(args.worker))), flush=True)
        return
    report = anyio.run(_launch, args)
    _print_table(report)
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
