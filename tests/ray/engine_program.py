"""Cases of :func:`lampdist.ray.run` on a local Ray instance, for tests/ray/test_engine.py.

    python -m tests.ray.engine_program --out DIR CASE [CASE ...]

Each case trains the three ranks of :mod:`tests.roles.tcp_rank` (the same model, data,
optimizer and windows: its uninterrupted run is the reference) on three actors, and writes
``DIR/CASE/rank<r>.pt`` (each rank's final weights, returned to the driver) and
``DIR/CASE/curve.json`` (the root's learning curve, from the LoopState returned), as
tcp_rank does, plus ``DIR/CASE/report.json`` (what the driver saw) and the root's
``recovered.jsonl``. Cases:

- ``clean``: from an async driver, nothing lost;
- ``follower``: rank 2's process SIGKILLs itself at its third training batch;
- ``stall``: rank 2's process stops itself (SIGSTOP) at its third training batch;
- ``root``: the root's process SIGKILLs itself at its eighth batch (epoch 2), after the
  checkpoint of epoch 1; ``max_failures=1`` starts the job again, which resumes from it;
- ``exhausted``: rank 2 killed with ``max_restarts=0``: the driver raises RankFailed;
- ``cancel``: the async driver is cancelled once the first training pass is done; the
  report says whether the actors and the placement group were released.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import attrs
import torch

import lampdist
import lampdist.ray
from lampdist import checkpoint
from lampdist.launch import LaunchEnv
from tests.roles.reference import make_model, make_shards, mse
from tests.roles.tcp_rank import SIZES_3, VALID_SIZES_3, dying, local_parts, sgd

NRANKS = 3
EPOCHS = 3
NEVER = 1_000_000


@attrs.frozen
class Case:
    """One case's settings, handed to every rank's main."""

    out: str
    die_rank: int | None = None
    die_after: int = NEVER
    signum: int = signal.SIGKILL
    checkpoints: bool = False


async def rank_main(case: Case, env: LaunchEnv) -> tuple[lampdist.LoopState, dict[str, Any]]:
    """One rank of tests.roles.tcp_rank's run (``--epochs 3 --nranks 3``), as an actor's main."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    out = Path(case.out)
    context = lampdist.ray.run_context()
    where = f"{env.rank}-{context.attempt}-{context.start}"
    (out / f"pid-{where}").write_text(json.dumps([os.getpid(), time.time()]))
    train = make_shards(SIZES_3, seed=1)[env.rank]
    valid = make_shards(VALID_SIZES_3, seed=2)[env.rank]
    after = case.die_after if env.rank == case.die_rank else NEVER
    module = make_model(seed=0 if env.rank == 0 else 10 + env.rank)
    data = lampdist.ModelWithData(
        model=lampdist.SupervisedModel(module, mse),
        train_batches=dying(train, after, out / f"died-{env.rank}", case.signum),
        validation_batches=lambda: valid,
    )

    async def on_event(event: lampdist.PassEvent | lampdist.Recovered) -> None:
        if isinstance(event, lampdist.Recovered):
            with (out / "recovered.jsonl").open("a") as file:
                file.write(json.dumps(attrs.asdict(event)) + "\n")
        elif event.kind == "train" and event.done:
            (out / "trained").touch()

    store = out / "checkpoints"
    resume = None
    if case.checkpoints:
        resume = await anyio.to_thread.run_sync(checkpoint.load_latest, store)
    state = await lampdist.train(
        data=data,
        optimizer_factory=sgd,
        loop=lampdist.LoopOptions(
            max_epochs=EPOCHS,
            on_event=on_event,
            recovery=lampdist.Recovery(rejoin_timeout=60),
            checkpoint_state=checkpoint.to_directory(store) if case.checkpoints else None,
        ),
        step=lampdist.StepOptions(accumulate_gradient_over_n_batches=3),
        timeouts=lampdist.Timeouts(join=30),
        resume=resume,
        launch=env,
    )
    return state, local_parts(module)


CASES = {
    "clean": Case(out=""),
    "follower": Case(out="", die_rank=2, die_after=3),
    "stall": Case(out="", die_rank=2, die_after=3, signum=signal.SIGSTOP),
    "root": Case(out="", die_rank=0, die_after=8, checkpoints=True),
    "exhausted": Case(out="", die_rank=2, die_after=3),
}
OPTIONS: dict[str, dict[str, Any]] = {
    "root": {"max_failures": 1},
    "exhausted": {"max_restarts": 0},
}


def write(out: Path, results: list[tuple[lampdist.LoopState, dict[str, Any]]]) -> None:
    """tcp_rank's files from the results the driver got back."""
    for rank, (_, weights) in enumerate(results):
        torch.save(weights, out / f"rank{rank}.pt")
    state = results[0][0]
    curve = [[p.training_loss, p.validation_loss] for p in state.learning_curve]
    (out / "curve.json").write_text(json.dumps(curve))


def report(out: Path, **facts: Any) -> None:
    (out / "report.json").write_text(json.dumps(facts))


def run_case(name: str, out: Path) -> None:
    """``clean`` from an async driver, the others through run_sync, as a script would."""
    name = name.split(":", maxsplit=1)[0]  # follower:2, a second run of the case
    case = attrs.evolve(CASES[name], out=str(out))
    main = functools.partial(rank_main, case)
    options = {"nranks": NRANKS, **OPTIONS.get(name, {})}
    try:
        if name == "clean":
            results = anyio.run(functools.partial(lampdist.ray.run, main, **options))
        else:
            results = lampdist.ray.run_sync(main, **options)
    except lampdist.LampdistError as exc:
        report(out, error=type(exc).__name__, rank=exc.rank, phase=exc.phase, message=str(exc))
        return
    write(out, results)
    states = [state for state, _ in results]
    report(
        out,
        types=sorted({type(state).__name__ for state in states}),
        same_states=all(state == states[0] for state in states),
    )


async def cancel_case(out: Path) -> None:
    """The driver cancelled in the middle of training: then whether Ray got everything back."""
    from ray.util import placement_group_table

    import ray

    case = Case(out=str(out))
    total = ray.cluster_resources()["CPU"]  # type: ignore[no-untyped-call]  # Ray untyped
    started = time.monotonic()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: lampdist.ray.run(functools.partial(rank_main, case), nranks=3))
            while not (out / "trained").exists():  # noqa: ASYNC110  # written by an actor
                await anyio.sleep(0.1)
            scope.cancel()
    cancelled = time.monotonic() - started
    pids = _pids(out)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        free = ray.available_resources().get("CPU", 0.0)  # type: ignore[no-untyped-call]
        alive = [pid for pid in pids if _alive(pid)]
        groups = [g["state"] for g in placement_group_table().values()]
        if free == total and not alive and all(state == "REMOVED" for state in groups):
            break
        await anyio.sleep(0.2)
    report(
        out,
        cancelled_after=cancelled,
        free_cpus=free,
        total_cpus=total,
        alive=alive,
        groups=groups,
        trained=(out / "trained").exists(),
    )


def _pids(out: Path) -> list[int]:
    """The processes in which the ranks' mains started."""
    return [json.loads(path.read_text())[0] for path in out.glob("pid-*")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("cases", nargs="+", help=f"{', '.join([*CASES, 'cancel'])}; NAME:N again")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="driver %(name)s: %(message)s")
    import ray

    ray.init(num_cpus=NRANKS, include_dashboard=False, log_to_driver=True)
    try:
        for name in args.cases:
            out = args.out / name
            out.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            if name == "cancel":
                anyio.run(cancel_case, out)
            else:
                run_case(name, out)
            print(f"CASE {name} {time.monotonic() - started:.1f} s", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
