"""One rank of a training run over TCP, with deterministic fault injection, for the tests.

    python -m tests.reliability.rank --rank R --nranks N --out DIR [--port P] [--fault SPEC]

The root prints ``PORT <n>`` once its control channel listens; followers take ``--port``.
The secret comes from ``LAMPDIST_SECRET``. ``--fault KIND@PHASE[:EPOCH]`` injects one fault
(see ``_faults.py``); the root checkpoints into ``--checkpoints`` after every epoch and
resumes from it with ``--resume``. Each rank that ends cleanly writes its weights to
``DIR/rank<r>.pt``; the root writes its loop state to ``DIR/state.json``.

The root stops gracefully on SIGTERM or SIGINT: it lets the current epoch finish and
checkpoint within ``--stop-timeout`` seconds, tells the followers to stop, and exits with
128 + the signal number. A follower that gets the signal too (Ctrl-C reaches the whole
process group) keeps following until the root's STOP. A second signal abandons the work at
once, on any rank.

Exit codes (docs/reliability.md):

- 0: the run completed (root), or the root's STOP ended it (follower);
- 1: the run failed; the last line of stderr is ``lampdist-rank: <Type>: rank R, phase 'P': ...``;
- 2: bad arguments or settings, ranks that disagree (argparse, ``ConfigError``,
  ``MismatchError``);
- 128 + N (130 for SIGINT, 143 for SIGTERM): the root stopped on signal N (the last
  committed checkpoint resumes the run), or any rank was stopped by a second signal.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, NoReturn

import anyio
import torch
from anyio.abc import ObjectSendStream

import lampdist
from lampdist import checkpoint, control
from lampdist._checkpoint import _write
from lampdist._clique_id import CliqueId
from lampdist._errors import Phase
from lampdist.clique import _tether
from lampdist.control import USE_CHANNEL_DEFAULT, Command, UseChannelDefault

from ..roles.reference import make_model, make_shards, mse
from ._faults import Fault, Injector, kill_in_thread_when

BATCH = 4
TRAIN_BATCHES = 4
VALID_BATCHES = 2
EXIT_FAILED = 1
EXIT_CONFIG = 2


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def shards(nranks: int) -> tuple[list[list[Any]], list[list[Any]]]:
    """Every rank's training and validation batches (the tests rebuild them in-process)."""
    train = make_shards([[BATCH] * TRAIN_BATCHES] * nranks, seed=11)
    valid = make_shards([[BATCH] * VALID_BATCHES] * nranks, seed=12)
    return train, valid


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tests.reliability.rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nranks", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, help="the root's checkpoint directory")
    parser.add_argument("--resume", action="store_true", help="resume from --checkpoints")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--fault", type=Fault.parse, default=None)
    parser.add_argument("--sleep", type=float, default=30.0, help="seconds of a stall fault")
    parser.add_argument("--slow-checkpoint", type=float, default=0.0)
    parser.add_argument("--stop-timeout", type=float, default=10.0)
    parser.add_argument("--join-timeout", type=float, default=30.0)
    parser.add_argument("--collective-timeout", type=float, default=30.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    parser.add_argument(
        "--keep-unresponsive",
        action="store_true",
        help="Timeouts(end_unresponsive=False): the root does not end a stalled follower",
    )
    parser.add_argument("--width", type=int, default=6, help="model width (mismatch tests)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--non-finite", choices=["raise", "skip"], default="raise")
    return parser.parse_args(argv)


class WatchedFollower:
    """A follower channel whose ``join`` is an injection point (after it returns)."""

    def __init__(self, inner: control.TcpFollowerChannel, injector: Injector) -> None:
        self.inner, self.injector = inner, injector
        self.rank = inner.rank

    async def __aenter__(self) -> WatchedFollower:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self.inner.__aexit__(*exc)

    async def join(
        self,
        commands: ObjectSendStream[Command],
        *,
        timeout: float | UseChannelDefault | None = USE_CHANNEL_DEFAULT,  # noqa: ASYNC109
    ) -> CliqueId:
        clique_id = await self.inner.join(commands, timeout=timeout)
        await self.injector.at("join")
        self.injector.phase = "setup"
        return clique_id

    async def report_failure(self, phase: Phase, message: str) -> None:
        await self.inner.report_failure(phase, message)

    async def wait_until_root_left(self, timeout: float) -> None:  # noqa: ASYNC109
        await self.inner.wait_until_root_left(timeout)

    async def watch(self) -> NoReturn:
        await self.inner.watch()


class WatchedRoot:
    """A root channel whose ``wait_for_peers`` is an injection point (after it returns)."""

    def __init__(self, inner: control.TcpRootChannel, injector: Injector) -> None:
        self.inner, self.injector = inner, injector
        self.nranks = inner.nranks

    async def __aenter__(self) -> WatchedRoot:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self.inner.__aexit__(*exc)

    async def publish_clique_id(self, clique_id: CliqueId) -> None:
        await self.inner.publish_clique_id(clique_id)

    async def peers(self) -> int:
        return await self.inner.peers()

    async def wait_for_peers(self, n: int, timeout: float | None) -> None:  # noqa: ASYNC109
        await self.inner.wait_for_peers(n, timeout)
        await self.injector.at("join")
        self.injector.phase = "setup"

    async def broadcast(
        self,
        command: Command,
        *,
        timeout: float | UseChannelDefault | None = USE_CHANNEL_DEFAULT,  # noqa: ASYNC109
    ) -> None:
        await self.inner.broadcast(command, timeout=timeout)

    async def wait_until_left(self, ranks: Collection[int], timeout: float) -> None:  # noqa: ASYNC109
        await self.inner.wait_until_left(ranks, timeout)

    async def watch(self) -> NoReturn:
        await self.inner.watch()


def inject_into_clique_setup(injector: Injector) -> None:
    """Act once this rank's liveness tether is up, in the middle of clique setup."""
    original = _tether.Tether.connect

    def connect(cls: type[_tether.Tether], /, **kwargs: Any) -> _tether.Tether:
        tether = original(**kwargs)
        if injector.due("setup", ("kill", "raise")):
            injector.act_anywhere()
        return tether

    _tether.Tether.connect = classmethod(connect)  # type: ignore[method-assign,assignment]  # the injection point


def inject_into_checkpoint_write(injector: Injector) -> None:
    """Act in the middle of writing a checkpoint: its files are written, not yet committed."""
    name = "fsync_directory"  # what the writer calls before it commits by renaming
    original = vars(_write)[name]

    def fsync_directory(path: Path) -> None:
        if injector.due("checkpoint", ("kill", "stop")):
            injector.act_anywhere()
        original(path)

    setattr(_write, name, fsync_directory)


async def run(
    args: argparse.Namespace, stop: anyio.Event, signals: list[int], abandon: anyio.CancelScope
) -> int:
    injector = Injector(rank=args.rank, out=args.out, fault=args.fault, sleep_seconds=args.sleep)
    inject_into_clique_setup(injector)
    inject_into_checkpoint_write(injector)
    train, valid = shards(args.nranks)
    my_train, my_valid = train[args.rank], valid[args.rank]
    module = make_model(seed=0 if args.rank == 0 else 10 + args.rank, width=args.width)

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return injector.loss(mse(output, target))

    def train_source() -> Any:
        injector.enter("train")
        if args.fault is not None and args.fault.kind == "stall-loop":
            return injector.stalling_source(my_train)
        return injector.source("train", my_train)

    def valid_source() -> Any:
        injector.enter("valid")
        return injector.source("valid", my_valid)

    model = lampdist.SupervisedModel(module, loss)
    data = lampdist.ModelWithData(
        model=model, train_batches=train_source, validation_batches=valid_source
    )
    step = lampdist.StepOptions(
        accumulate_gradient_over_n_batches=args.accumulate, non_finite_loss=args.non_finite
    )
    timeouts = lampdist.Timeouts(
        join=args.join_timeout,
        collective=args.collective_timeout,
        stop=args.stop_timeout,
        end_unresponsive=not args.keep_unresponsive,
    )
    secret = os.environ["LAMPDIST_SECRET"]
    heartbeats = {"heartbeat_interval": 0.5, "heartbeat_timeout": args.heartbeat_timeout}
    if args.rank != 0:
        if args.fault is not None and args.fault.phase == "checkpoint":
            # The root's checkpoint: act as soon as the root says it started writing it.
            kill_in_thread_when(args.out / f"checkpointing-{args.fault.epoch}", injector)
        channel = control.tcp_follower(
            "127.0.0.1", args.port, rank=args.rank, secret=secret, **heartbeats
        )
        injector.control_port = args.port
        async with WatchedFollower(channel, injector) as follower:
            with abandon:
                await lampdist.follow_distributed_training(
                    rank=args.rank,
                    nranks=args.nranks,
                    device="cpu",
                    control=follower,
                    data=data,
                    step=step,
                    timeouts=timeouts,
                )
        if abandon.cancelled_caught:
            return abandoned(signals)
        torch.save(module.state_dict(), args.out / f"rank{args.rank}.pt")
        return 0

    resumed = None
    if args.resume:
        resumed = checkpoint.load_latest(args.checkpoints)
        assert resumed is not None, "nothing to resume from"
        injector.next_train_epoch = injector.epoch = resumed.epoch
    save = checkpoint.to_directory(args.checkpoints, keep=3) if args.checkpoints else None

    async def checkpoint_state(state: lampdist.TrainingState, lr: Any) -> None:
        assert save is not None
        epoch = state.loop_state.epoch - 1
        injector.phase, injector.epoch = "checkpoint", epoch
        (args.out / f"checkpointing-{epoch}").touch()
        await anyio.sleep(args.slow_checkpoint)
        if injector.due("checkpoint", ("raise",)):
            injector.act_anywhere()
        await save(state, lr)

    async def on_event(event: lampdist.PassEvent) -> None:
        if event.kind == "train" and event.step == 1:
            await injector.at("train")

    async with WatchedRoot(
        control.tcp_root("127.0.0.1", 0, nranks=args.nranks, secret=secret, **heartbeats),
        injector,
    ) as root:
        injector.control_port = root.inner.address[1]
        print(f"PORT {root.inner.address[1]}", flush=True)
        with abandon:
            injector.cancel_scope = abandon
            try:
                state = await lampdist.drive_distributed_training(
                    nranks=args.nranks,
                    device="cpu",
                    control=root,
                    data=data,
                    optimizer_factory=sgd,
                    loop=lampdist.LoopOptions(
                        max_epochs=args.epochs,
                        checkpoint_state=checkpoint_state if save is not None else None,
                        on_event=on_event,
                    ),
                    step=step,
                    timeouts=timeouts,
                    resume=resumed,
                    stop=stop,
                )
            except lampdist.LampdistTimeout as exc:
                if exc.phase == "stop" and signals:
                    print(f"lampdist-rank: {type(exc).__name__}: {exc}", file=sys.stderr)
                    return 128 + signals[0]
                raise
        if abandon.cancelled_caught:
            return abandoned(signals)
    torch.save(module.state_dict(), args.out / "rank0.pt")
    curve = [[p.training_loss, p.validation_loss] for p in state.learning_curve]
    (args.out / "state.json").write_text(json.dumps({"epoch": state.epoch, "curve": curve}))
    return 128 + signals[0] if signals else 0


def abandoned(signals: list[int]) -> int:
    """The exit code of a rank whose work was cancelled: by a second signal, or (root) by
    the test's fault."""
    if len(signals) > 1:
        print("lampdist-rank: stopped at once by a second signal", file=sys.stderr)
        return 128 + signals[0]
    print("lampdist-rank: the rank's task was cancelled", file=sys.stderr)
    return EXIT_FAILED


async def main(args: argparse.Namespace) -> int:
    stop = anyio.Event()
    signals: list[int] = []
    abandon = anyio.CancelScope()
    async with anyio.create_task_group() as group:

        async def on_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
                async for signum in received:
                    print(f"SIGNAL {signum}", flush=True)
                    signals.append(signum)
                    if stop.is_set():  # the second signal: abandon at once
                        abandon.cancel()
                    stop.set()  # the root stops after this epoch; followers wait for it

        group.start_soon(on_signals)
        code = await run(args, stop, signals, abandon)
        group.cancel_scope.cancel()
    return code


def report(error: BaseException) -> BaseException:
    """Print the error line of the exit-code convention; return the error it names (the one
    error inside task groups' exception groups)."""
    leaf = error
    while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
        leaf = leaf.exceptions[0]
    print(f"lampdist-rank: {type(leaf).__name__}: {leaf}", file=sys.stderr, flush=True)
    return leaf


def entry(argv: list[str]) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the tests dump a hung rank
    args = parse(argv)
    logging.basicConfig(
        level=os.environ.get("LAMPDIST_TEST_LOG", "WARNING"),
        format=f"%(asctime)s %(msecs)03d rank {args.rank} %(name)s %(levelname)s: %(message)s",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        return anyio.run(main, args)
    except Exception as exc:
        logging.getLogger("tests.reliability.rank").debug("failed", exc_info=True)
        error = report(exc)
        return EXIT_CONFIG if isinstance(error, lampdist.ConfigError) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(entry(sys.argv[1:]))
