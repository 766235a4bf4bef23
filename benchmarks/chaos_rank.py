"""One rank of the chaos run (``benchmarks/chaos.py``): a small CPU job over TCP, trained in
windows of steps, checkpointed after every window, resumable, stopped gracefully by a signal.

    python benchmarks/chaos_rank.py --rank R --nranks N --out DIR [--port P]
        [--checkpoint CKPT] [--resume CKPT] [--epochs 10] [--no-recovery]
        [--step-on root|every_rank|sharded|fsdp] ...

The root listens on 127.0.0.1 (``--port``, 0: a free one) and prints ``PORT <n>`` once it
does; followers connect to ``--port``. The secret comes from ``LAMPDIST_SECRET``. Every epoch
is a window of ``--steps-per-window`` optimizer steps (``StepOptions(steps_per_epoch=...)``)
over the rank's own deterministic, shuffled data; the batch source sleeps ``--batch-sleep``
seconds per batch, so that a window takes a fraction of a second and faults land mid-pass
(with ``--batch-compute`` it spends them in torch operations, as a source that prepares its
batches with torch does).

The root checkpoints every window into ``--checkpoint`` (``checkpoint.to_directory``, keeping
every checkpoint so that a missing one is a lost one) and, with ``--resume``, resumes from
the newest one there (``load_latest(..., restore_rng=True)``; a new run when there is none
yet). It prints one ``EVENT <kind> <epoch> <step> <done>`` line per progress event to
stdout. Each rank that ends cleanly writes its final weights (under ``--step-on fsdp``, its
own shards) to ``DIR/rank<r>.pt`` and then
prints ``DONE``: its work is done, and it must exit 0 (the harness lists any other code).
Without ``--no-recovery`` the root recovers a lost follower in the job
(``LoopOptions(recovery=lampdist.Recovery(...))``): a follower started again with the same
command line takes its place.

``launched(args, env)`` is the same rank as an async function of a
:class:`~lampdist.launch.LaunchEnv` (``lampdist.train(..., launch=env)``), for launchers that
hand one: ``lampdist.ray.run`` (``chaos.py --engine ray``), torchrun and plain processes
(``benchmarks/recovery_time.py``).

Signals follow the README's convention (``lampdist.run_until_signal``): the first SIGTERM or
SIGINT stops the run gracefully (the root finishes the window in progress, checkpoints it and
stops the followers; a follower keeps following until the root's STOP, for up to
``--stop-timeout`` seconds), a second one stops at once.

Exit codes (docs/reliability.md): 0 done (a follower: the root's STOP ended it), 1 failed
(the last stderr line is ``chaos-rank: <Type>: rank R, phase 'P': ...``), 2 bad settings,
128 + N stopped by signal N.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch

import lampdist
from lampdist import checkpoint, control
from lampdist.launch import LaunchEnv

Batch = tuple[torch.Tensor, torch.Tensor]

EXIT_FAILED = 1
EXIT_CONFIG = 2
KEEP_EVERY_CHECKPOINT = 1_000_000  # a checkpoint that disappears is lost, never pruned
BATCH = 8
TRAIN_BATCHES = 24  # per rank and pass over its data
VALID_BATCHES = 2


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="chaos_rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nranks", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="DIR/rank<r>.pt: final weights")
    parser.add_argument("--checkpoint", type=Path, default=None, help="the root's directory")
    parser.add_argument("--resume", type=Path, default=None, help="resume from its newest")
    parser.add_argument("--epochs", type=int, default=10, help="windows to train")
    parser.add_argument("--steps-per-window", type=int, default=4)
    parser.add_argument("--batch-sleep", type=float, default=0.04, help="seconds per batch")
    parser.add_argument(
        "--batch-compute",
        action="store_true",
        help="spend --batch-sleep in torch operations instead of asleep",
    )
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument(
        "--step-on", default="root", choices=["root", "every_rank", "sharded", "fsdp"]
    )
    parser.add_argument("--no-recovery", action="store_true")
    parser.add_argument("--rejoin-timeout", type=float, default=20.0)
    parser.add_argument("--max-recoveries", type=int, default=3)
    parser.add_argument("--heartbeat-interval", type=float, default=0.25)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--join-timeout", type=float, default=20.0)
    parser.add_argument("--collective-timeout", type=float, default=10.0)
    parser.add_argument("--stop-timeout", type=float, default=3.0)
    return parser.parse_args(argv)


def make_model(rank: int, width: int) -> torch.nn.Module:
    """Each rank starts from other weights: the root's must reach every rank."""
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    return torch.nn.Sequential(
        torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    ).double()


def make_batches(rank: int, count: int, salt: int) -> list[Batch]:
    """Rank ``rank``'s batches of a noisy regression problem (the same in every process)."""
    generator = torch.Generator().manual_seed(1000 * salt + rank)
    batches = []
    for _ in range(count):
        x = torch.randn(BATCH, 4, generator=generator, dtype=torch.float64)
        y = (x @ torch.tensor([[0.5], [-1.0], [0.25], [2.0]], dtype=torch.float64)).sin()
        batches.append((x, y + 0.05 * torch.randn(BATCH, 1, generator=generator)))
    return batches


def compute_for(seconds: float) -> None:
    """Spend ``seconds`` in torch operations, as a source that prepares its batches with
    torch does (torch runs each one with the GIL released)."""
    deadline = time.monotonic() + seconds
    scratch = torch.ones(64, 64)
    while time.monotonic() < deadline:
        scratch = torch.tanh(scratch @ scratch / 64)


def sleeping_source(
    batches: list[Batch], sleep: float, shuffle: bool, *, compute: bool = False
) -> Any:
    """A pass-aware batch source: the batches (shuffled by the pass's generator), each after
    ``sleep`` seconds, asleep or, with ``compute``, in torch operations (the source runs on a
    loading thread: the event loop goes on)."""
    wait = compute_for if compute else time.sleep

    def source(context: lampdist.PassContext) -> Iterator[Batch]:
        order = (
            torch.randperm(len(batches), generator=context.generator()).tolist()
            if shuffle
            else range(len(batches))
        )
        for index in order:
            wait(sleep)
            yield batches[index]

    return source


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def local_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each tensor of ``module``'s state (under fsdp this rank's local part of it), copied."""
    return {
        name: (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
        for name, value in module.state_dict().items()
    }


def save_weights(module: torch.nn.Module, out: Path, rank: int) -> None:
    """The final weights, complete or absent (written aside, then renamed); under fsdp this
    rank's shards (each tensor's local part)."""
    state = local_weights(module)
    scratch = out / f".rank{rank}.pt.{os.getpid()}"
    torch.save(state, scratch)
    scratch.replace(out / f"rank{rank}.pt")


def recovery_options(args: argparse.Namespace) -> dict[str, Any]:
    """``LoopOptions``' ``recovery`` keyword (none with ``--no-recovery``)."""
    if args.no_recovery:
        return {}
    recovery = lampdist.Recovery(
        rejoin_timeout=args.rejoin_timeout, max_recoveries=args.max_recoveries
    )
    return {"recovery": recovery}


@dataclass(frozen=True)
class Parts:
    """What every rank of the job builds from its options, whatever launches it."""

    module: torch.nn.Module
    data: lampdist.ModelWithData
    step: lampdist.StepOptions
    timeouts: lampdist.Timeouts


def build(args: argparse.Namespace) -> Parts:
    """Rank ``args.rank``'s model, data, step and deadlines."""
    torch.set_num_threads(1)  # several ranks share two cores
    module = make_model(args.rank, args.width)
    model = lampdist.SupervisedModel(module, torch.nn.functional.mse_loss)
    data = lampdist.ModelWithData(
        model=model,
        train_batches=sleeping_source(
            make_batches(args.rank, TRAIN_BATCHES, salt=1),
            args.batch_sleep,
            shuffle=True,
            compute=args.batch_compute,
        ),
        validation_batches=sleeping_source(
            make_batches(args.rank, VALID_BATCHES, salt=2),
            args.batch_sleep / 4,
            shuffle=False,
            compute=args.batch_compute,
        ),
    )
    step = lampdist.StepOptions(step_on=args.step_on, steps_per_epoch=args.steps_per_window)
    timeouts = lampdist.Timeouts(
        join=args.join_timeout, collective=args.collective_timeout, stop=args.stop_timeout
    )
    return Parts(module, data, step, timeouts)


def event_line(event: lampdist.PassEvent) -> str:
    return f"EVENT {event.kind} {event.epoch} {event.step} {int(event.done)}"


async def run(args: argparse.Namespace) -> int:
    parts = build(args)
    module, data, step, timeouts = parts.module, parts.data, parts.step, parts.timeouts
    secret = os.environ["LAMPDIST_SECRET"]
    heartbeats = {
        "heartbeat_interval": args.heartbeat_interval,
        "heartbeat_timeout": args.heartbeat_timeout,
    }
    if args.rank == 0:
        resume = None
        if args.resume is not None:
            resume = await anyio.to_thread.run_sync(
                lambda: checkpoint.load_latest(args.resume, restore_rng=True)
            )
        save = (
            None
            if args.checkpoint is None
            else checkpoint.to_directory(args.checkpoint, keep=KEEP_EVERY_CHECKPOINT)
        )

        async def on_event(event: lampdist.PassEvent | lampdist.Recovered) -> None:
            if isinstance(event, lampdist.Recovered):
                return  # the root's "recovered" line says it
            print(event_line(event), flush=True)

        loop = lampdist.LoopOptions(
            max_epochs=args.epochs,
            checkpoint_state=save,
            on_event=on_event,
            **recovery_options(args),
        )
        async with control.tcp_root(
            "127.0.0.1", args.port, nranks=args.nranks, secret=secret, **heartbeats
        ) as root:
            print(f"PORT {root.address[1]}", flush=True)

            async def drive(stop: anyio.Event) -> None:
                await lampdist.drive_distributed_training(
                    nranks=args.nranks,
                    device="cpu",
                    control=root,
                    data=data,
                    optimizer_factory=sgd,
                    loop=loop,
                    step=step,
                    timeouts=timeouts,
                    resume=resume,
                    stop=stop,
                )

            await lampdist.run_until_signal(drive, rank=0)
        save_weights(module, args.out, 0)
        print("DONE", flush=True)
        return 0

    completed = False

    async def follow(stop: anyio.Event) -> None:
        nonlocal completed
        async with control.tcp_follower(
            "127.0.0.1",
            args.port,
            rank=args.rank,
            secret=secret,
            join_timeout=args.join_timeout,
            **heartbeats,
        ) as follower:
            await lampdist.follow_distributed_training(
                rank=args.rank,
                nranks=args.nranks,
                device="cpu",
                control=follower,
                data=data,
                optimizer_factory=sgd,
                step=step,
                timeouts=timeouts,
                stop=stop,
            )
        save_weights(module, args.out, args.rank)
        completed = True

    try:
        await lampdist.run_until_signal(follow, rank=args.rank)
    except lampdist.Interrupted:
        if not completed:
            raise
        # The root's STOP ended the run after this follower's signal: done, as lampdist.train
        # reports it (docs/reliability.md, exit codes).
    print("DONE", flush=True)
    return 0


async def launched(args: argparse.Namespace, env: LaunchEnv) -> dict[str, torch.Tensor]:
    """Rank ``env.rank`` of the same job under a launcher that hands each rank a
    :class:`~lampdist.launch.LaunchEnv` (``lampdist.ray.run``: benchmarks/_chaos_ray.py):
    ``lampdist.train(..., launch=env)`` with the same model, data, step and deadlines (the
    control channel's heartbeats at their defaults). Each start of a rank appends
    ``<pid> <time>`` to ``args.out/pids-<r>.txt``. The root resumes from the newest
    checkpoint in ``args.checkpoint`` (a new run when there is none), checkpoints every window
    there, and appends ``<time> EVENT ...`` for each progress event and ``<time> RECOVERED
    <ranks> <seconds>`` for each recovery to ``args.out/events.txt`` (``time.time()``).
    Returns this rank's final weights (under fsdp its own shards)."""
    args = argparse.Namespace(**{**vars(args), "rank": env.rank})
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / f"pids-{env.rank}.txt").open("a") as file:
        file.write(f"{os.getpid()} {time.time():.6f}\n")
    parts = build(args)
    events = args.out / "events.txt"

    async def on_event(event: lampdist.PassEvent | lampdist.Recovered) -> None:
        if isinstance(event, lampdist.Recovered):
            ranks = ",".join(str(rank) for rank in event.ranks)
            line = f"RECOVERED {ranks} {event.seconds:.3f}"
        else:
            line = event_line(event)
        with events.open("a") as file:
            file.write(f"{time.time():.6f} {line}\n")

    resume = None
    if env.rank == 0 and args.checkpoint is not None:
        resume = await anyio.to_thread.run_sync(
            lambda: checkpoint.load_latest(args.checkpoint, restore_rng=True)
        )
    save = None
    if args.checkpoint is not None:
        save = checkpoint.to_directory(args.checkpoint, keep=KEEP_EVERY_CHECKPOINT)
    loop = lampdist.LoopOptions(
        max_epochs=args.epochs,
        checkpoint_state=save,
        on_event=on_event,
        **recovery_options(args),
    )
    await lampdist.train(
        data=parts.data,
        optimizer_factory=sgd,
        loop=loop,
        step=parts.step,
        timeouts=parts.timeouts,
        resume=resume,
        launch=env,
    )
    return local_weights(parts.module)


def report(error: BaseException) -> BaseException:
    """Print the last stderr line of the exit-code convention; the error it names (the one
    error inside exception groups)."""
    leaf = error
    while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
        leaf = leaf.exceptions[0]
    print(f"chaos-rank: {type(leaf).__name__}: {leaf}", file=sys.stderr, flush=True)
    return leaf


def main(argv: list[str]) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness dumps a hung rank
    args = parse(argv)
    logging.basicConfig(
        level=os.environ.get("LAMPDIST_CHAOS_LOG", "INFO"),
        format=f"%(created).3f rank {args.rank} %(name)s %(levelname)s: %(message)s",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        return anyio.run(run, args)
    except lampdist.Interrupted as stopped:
        report(stopped)
        return 128 + stopped.signum
    except Exception as exc:
        logging.getLogger("chaos_rank").info("failed", exc_info=True)
        error = report(exc)
        return EXIT_CONFIG if isinstance(error, lampdist.ConfigError) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
