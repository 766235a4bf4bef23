"""One rank of a clique in a subprocess of its own, for the multi-process tests.

Usage: ``python _worker.py '<json>'`` with the clique id (``host``, ``port``, ``prefix``,
``nranks``), ``rank``, ``device`` and ``mode``:

- ``check``: run every collective check ``cycles`` times, each in a fresh clique opening of
  the same id, then print ``ok``;
- ``allreduce``: print ``ready``, then sit in an all_reduce that the peers never finish;
- ``idle``: print ``ready``, wait for a line on stdin, then try an all_reduce and print
  ``raised <error class>`` or ``ok``.
"""

from __future__ import annotations

import json
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import anyio
import anyio.to_thread
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # for ``tests.clique``

from lampdist.clique import Clique, CliqueId, open_clique
from tests.clique.checks import check_collectives, check_started_collectives


def say(line: str) -> None:
    print(line, flush=True)


async def main(config: dict[str, object]) -> None:
    clique_id = CliqueId.from_json(config)
    rank = int(str(config["rank"]))
    mode = str(config["mode"])
    device = str(config.get("device", "cpu"))
    collective_timeout = float(str(config.get("collective_timeout", 60.0)))

    def opening() -> AbstractAsyncContextManager[Clique]:
        return open_clique(
            nranks=clique_id.nranks,
            rank=rank,
            device=device,
            clique_id=clique_id,
            setup_timeout=60.0,
            collective_timeout=collective_timeout,
        )

    if mode == "check":
        for _ in range(int(str(config.get("cycles", 1)))):
            async with opening() as clique:
                await check_collectives(clique)
                await check_started_collectives(clique)
        say("ok")
    elif mode == "allreduce":
        async with opening() as clique:
            tensor = torch.ones(4, device=clique.device)
            pending = clique.start_all_reduce([tensor])
            say("ready")
            await pending
            await clique.barrier()
            say("ok")
    elif mode == "idle":
        async with opening() as clique:
            say("ready")
            await anyio.to_thread.run_sync(sys.stdin.readline)
            try:
                await clique.all_reduce([torch.ones(4, device=clique.device)])
                await clique.barrier()
            except Exception as exc:
                say(f"raised {type(exc).__name__}")
                raise
            say("ok")
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    try:
        anyio.run(main, json.loads(sys.argv[1]))
    except Exception as exc:  # the parent reads the outcome from stdout and the exit code
        say(f"error {type(exc).__name__}: {exc}")
        sys.exit(3)
