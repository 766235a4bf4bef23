"""Control-plane latency: command broadcast round trips and follower joins over loopback TCP.

Everything runs in one process and one event loop, so the follower-side receipt times and the
root's clock are the same clock. ``broadcast`` is the time ``RootChannel.broadcast`` takes:
the command goes out, and every follower acknowledges it (a full round trip). ``receipt`` is
the time from the start of ``broadcast`` until the last follower's consumer task holds the
command. ``join`` is the time from starting N followers until all of them have joined. ``cpu/round``
is the CPU time of the root's process per broadcast (with followers in that process, all of
their work too): on a busy machine, wall-clock latency is this plus waiting for a core.

    python benchmarks/control_latency.py                 # asyncio, 1 and 8 followers
    python benchmarks/control_latency.py --backend trio --rounds 2000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import attrs

from lampdist import control as control_api
from lampdist._clique_id import CliqueId
from lampdist.control import Command, CommandKind, FollowerChannel, RootChannel

__all__ = ["main"]

SECRET = "benchmark-secret"


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "p50_ms": 1e3 * at(0.50),
        "p99_ms": 1e3 * at(0.99),
        "max_ms": 1e3 * ordered[-1],
        "mean_ms": 1e3 * statistics.fmean(ordered),
    }


async def _consume(channel: FollowerChannel, receipts: list[float]) -> None:
    send, receive = anyio.create_memory_object_stream[Command](16)
    async with channel, receive:
        await channel.join(send)
        async for _command in receive:
            receipts.append(time.perf_counter())


async def _broadcast_latency(
    transport: str, nfollowers: int, rounds: int, warmup: int, processes: int
) -> dict[str, Any]:
    nranks = nfollowers + 1
    root, make_follower = await _open(transport, nranks)
    receipts: list[list[float]] = [[] for _ in range(nfollowers)]
    starts: list[float] = []
    durations: list[float] = []
    async with root, anyio.create_task_group() as tg:
        follower: Callable[[int], FollowerChannel] = make_follower(root)
        await root.publish_clique_id(CliqueId.new("127.0.0.1", 1, nranks=nranks))
        if processes:
            host, port = root.address  # type: ignore[attr-defined]  # a TCP root
            ranks = list(range(1, nranks))
            for part in range(processes):
                tg.start_soon(_follower_process, host, port, ranks[part::processes], receipts)
        else:
            for rank in range(1, nranks):
                tg.start_soon(_consume, follower(rank), receipts[rank - 1])
        await root.wait_for_peers(nfollowers, timeout=60)
        cpu_start = 0.0
        for index in range(warmup + rounds):
            if index == warmup:
                cpu_start = time.process_time()
            command = Command(kind=CommandKind.TRAIN, epoch=0, pass_index=index, lr_factor=1.0)
            start = time.perf_counter()
            await root.broadcast(command)
            durations.append(time.perf_counter() - start)
            starts.append(start)
            if not processes:
                while min(len(r) for r in receipts) <= index:  # consumers catch up
                    await anyio.lowlevel.checkpoint()
            else:
                await anyio.sleep(0.001)  # let the follower processes' consumers catch up
        cpu = time.process_time() - cpu_start
        await root.broadcast(Command(kind=CommandKind.STOP, epoch=0, pass_index=warmup + rounds))
    receipt = [
        max(r[index] for r in receipts) - starts[index] for index in range(warmup, warmup + rounds)
    ]
    return {
        "transport": transport,
        "followers": nfollowers,
        "follower_processes": processes,
        "rounds": rounds,
        "broadcast": _percentiles(durations[warmup:]),
        "receipt": _percentiles(receipt),
        "root_process_cpu_ms_per_round": 1e3 * cpu / rounds,
    }


async def _follower_process(
    host: str, port: int, ranks: list[int], receipts: list[list[float]]
) -> None:
    """Run followers ``ranks`` in a child process; collect their receipt times (perf_counter
    is CLOCK_MONOTONIC on Linux, one clock for every process of the machine)."""
    command = [sys.executable, __file__, "--serve-followers", host, str(port)]
    result = await anyio.run_process([*command, *map(str, ranks)], check=True)
    for rank, times in json.loads(result.stdout).items():
        receipts[int(rank) - 1].extend(times)


async def _serve_followers(host: str, port: int, ranks: list[int]) -> None:
    times: dict[int, list[float]] = {rank: [] for rank in ranks}
    async with anyio.create_task_group() as tg:
        for rank in ranks:
            channel = control_api.tcp_follower(host, port, rank=rank, secret=SECRET)
            tg.start_soon(_consume, channel, times[rank])
    sys.stdout.write(json.dumps({rank: t[:-1] for rank, t in times.items()}))  # drop STOP


async def _open(
    transport: str, nranks: int
) -> tuple[RootChannel, Callable[[Any], Callable[[int], FollowerChannel]]]:
    if transport == "memory":
        root, followers = control_api.local_channels(nranks)
        return root, lambda _root: lambda rank: followers[rank - 1]
    tcp = control_api.tcp_root(nranks=nranks, secret=SECRET)

    def followers_of(entered: Any) -> Callable[[int], FollowerChannel]:
        host, port = entered.address
        return lambda rank: control_api.tcp_follower(host, port, rank=rank, secret=SECRET)

    return tcp, followers_of


async def _join_and_drain(address: tuple[str, int], rank: int, joins: _Joins) -> None:
    send, receive = anyio.create_memory_object_stream[Command](16)
    channel = control_api.tcp_follower(*address, rank=rank, secret=SECRET)
    async with channel, receive:
        await channel.join(send)
        joins.joined.append(rank)
        if len(joins.joined) == joins.expected:
            joins.all_joined.set()
        async for _command in receive:
            pass


@attrs.define(eq=False)
class _Joins:
    expected: int
    joined: list[int] = attrs.field(factory=list)
    all_joined: anyio.Event = attrs.field(factory=anyio.Event)


async def _join_time(nfollowers: int, repeats: int) -> dict[str, Any]:
    samples: list[float] = []
    nranks = nfollowers + 1
    for _ in range(repeats):
        async with control_api.tcp_root(nranks=nranks, secret=SECRET) as root:
            await root.publish_clique_id(CliqueId.new("127.0.0.1", 1, nranks=nranks))
            joins = _Joins(nfollowers)
            async with anyio.create_task_group() as tg:
                start = time.perf_counter()
                for rank in range(1, nranks):
                    tg.start_soon(_join_and_drain, root.address, rank, joins)
                await root.wait_for_peers(nfollowers, timeout=60)
                await joins.all_joined.wait()
                samples.append(time.perf_counter() - start)
                await root.broadcast(Command(kind=CommandKind.STOP, epoch=0, pass_index=0))
    return {
        "transport": "tcp",
        "followers": nfollowers,
        "repeats": repeats,
        "join_s": {"median": statistics.median(samples), "max": max(samples)},
    }


def _table(results: dict[str, Any]) -> str:
    lines = [
        f"{'transport':<9} {'followers':>9} {'processes':>9} {'broadcast p50':>14} {'p99':>9} "
        f"{'receipt p50':>12} {'p99':>9} {'cpu/round':>10}",
    ]
    for row in results["broadcast"]:
        b, r = row["broadcast"], row["receipt"]
        lines.append(
            f"{row['transport']:<9} {row['followers']:>9} {row['follower_processes']:>9} "
            f"{b['p50_ms']:>11.3f} ms "
            f"{b['p99_ms']:>6.3f} ms {r['p50_ms']:>9.3f} ms {r['p99_ms']:>6.3f} ms "
            f"{row['root_process_cpu_ms_per_round']:>7.3f} ms"
        )
    join = results["join"]
    lines.append(
        f"join of {join['followers']} followers over tcp: median {join['join_s']['median']:.3f} s,"
        f" max {join['join_s']['max']:.3f} s ({join['repeats']} runs)"
    )
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for transport in args.transports:
        for nfollowers in args.followers:
            for processes in args.follower_processes if transport == "tcp" else [0]:
                rows.append(
                    await _broadcast_latency(
                        transport, nfollowers, args.rounds, args.warmup, processes
                    )
                )
    return {
        "backend": args.backend,
        "python": sys.version.split()[0],
        "broadcast": rows,
        "join": await _join_time(args.joiners, args.join_repeats),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table, then the results as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--rounds", type=int, default=1000, help="timed broadcasts per setting")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--followers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--transports", nargs="+", choices=["tcp", "memory"], default=["tcp"])
    parser.add_argument("--joiners", type=int, default=32)
    parser.add_argument("--join-repeats", type=int, default=5)
    parser.add_argument(
        "--follower-processes",
        type=int,
        nargs="+",
        default=[0, 1],
        help="TCP followers in the root's process (0) or spread over N child processes",
    )
    parser.add_argument("--json", help="also write the JSON results to this file")
    parser.add_argument("--serve-followers", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_followers:  # a child process of --follower-processes
        host, port, *ranks = args.serve_followers
        anyio.run(_serve_followers, host, int(port), [int(r) for r in ranks], backend=args.backend)
        return 0
    results = anyio.run(_run, args, backend=args.backend)
    print(_table(results))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as file:
            file.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
