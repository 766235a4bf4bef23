"""One rank of a multi-process training run over TCP, for the tests.

    python -m tests.roles.tcp_rank --rank 0 --nranks 2 --out DIR [--port 0] [--shuffle] [--cuda]
        [--step-on root|every_rank|sharded|fsdp] [--metrics] [--accumulate N]
        [--optimizer sgd|adamw|adafactor] [--clip NORM] [--meta]
        [--data random|hf-iterable|hf-loader]

The root prints ``PORT <n>`` once it listens; followers take ``--port``. Each rank writes its
final weights to ``DIR/rank<r>.pt`` and the root writes its learning curve to
``DIR/curve.json``. The secret comes from ``LAMPDIST_SECRET``. With ``--shuffle`` the training
batches come from the shuffled loader of :func:`.reference.shuffled`; with ``--cuda`` rank r
trains on ``cuda:r`` and the clique is NCCL. With ``--metrics`` the model reports
:data:`METRIC` and a torchmetrics mean squared error, and the root writes its learning curve's
metrics to ``DIR/metrics.json``.

Under ``--step-on fsdp`` each rank writes its own shards (``DIR/rank<r>.pt``, each parameter's
local part, in rank order along dimension 0); with ``--meta`` the model is built on the meta
device (every rank from another seed: the root's weights must win). ``--nranks 3`` trains on
:data:`SIZES_3`. ``--data KIND`` trains on dict batches of the rank's rows from a source that
keeps its own state (:mod:`.data_sources`), ``--die-after`` wrapping it with its state.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import attrs
import torch

import lampdist
from lampdist import checkpoint, control

from . import data_sources
from .reference import make_model, make_shards, mse, shuffled

SIZES = [[5, 7, 3, 9, 2], [6, 6, 0, 4]]
VALID_SIZES = [[5, 3], [4]]
SIZES_3 = [[5, 7, 3, 9, 2], [6, 6, 0, 4], [4, 0, 8]]
VALID_SIZES_3 = [[5, 3], [4], [2, 2]]
EPOCHS = 2
ACCUMULATE = 3


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


class NormalizedSGD(torch.optim.Optimizer):
    """Steps each tensor by its gradient over the gradient's norm: not elementwise (the norm
    spans the whole tensor, every rank's shard of it under fsdp)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-3), alpha=-group["lr"])


def normalized(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return NormalizedSGD(params, lr=0.05)


OPTIMIZERS = {"sgd": sgd, "adamw": adamw, "normalized": normalized}


def shard_root(module: torch.nn.Module, mesh: Any) -> None:
    """A ``parallelize``: the root module as one unit."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh)


def shard_linears(module: torch.nn.Module, mesh: Any) -> None:
    """A ``parallelize``: each Linear a unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for child in module.modules():
        if isinstance(child, torch.nn.Linear):
            fully_shard(child, mesh=mesh)
    fully_shard(module, mesh=mesh)


def sizes(nranks: int) -> tuple[list[list[int]], list[list[int]]]:
    """The training and validation batch sizes of each rank."""
    return (SIZES, VALID_SIZES) if nranks == 2 else (SIZES_3, VALID_SIZES_3)


def optimizer_parts(
    optimizer: torch.optim.Optimizer, module: torch.nn.Module
) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's state on this rank by parameter name (an fsdp shard's local part)."""
    names = {id(p): name for name, p in module.named_parameters()}
    return {
        names[id(p)]: {
            key: (v.to_local() if hasattr(v, "to_local") else v).detach().cpu()
            for key, v in state.items()
            if isinstance(v, torch.Tensor)
        }
        for p, state in optimizer.state.items()
    }


def count_reduce_scatters() -> list[int]:
    """Count torch.distributed's reduce-scatters in this process (FSDP2 reduces its gradients
    with them: ``reduce_scatter_single`` in newer torch, ``reduce_scatter_tensor`` before)
    into the list returned; each call still runs."""
    import torch.distributed as dist

    count = [0]
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        real = getattr(dist, name, None)
        if real is None:
            continue

        def counting(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            count[0] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counting)
    return count


def stalling(batches: list[Any], at: int) -> Any:
    """``batches``, the source sleeping 12 s before batch ``at`` of the first pass."""
    import time

    class Stalling(list):  # type: ignore[type-arg]
        passes = 0

        def __iter__(self) -> Any:
            Stalling.passes += 1
            for index, batch in enumerate(list.__iter__(self)):
                if Stalling.passes == 1 and index == at:
                    time.sleep(12)
                yield batch

    return Stalling(batches)


def dying(batches: list[Any], after: int, marker: Path, signum: int) -> Any:
    """``batches``, but the process sends itself ``signum`` (SIGKILL, or SIGSTOP: it stalls)
    as it takes its ``after``-th training batch, unless ``marker`` exists (it is written
    first: a replacement process started with the same command lives on)."""
    taken = [0]

    def source() -> Any:
        for batch in batches:
            taken[0] += 1
            if taken[0] == after and not marker.exists():
                marker.write_text("killed\n")
                os.kill(os.getpid(), signum)
            yield batch

    return source


def dying_in_forward(module: torch.nn.Module, at: int, marker: Path, drop: Path | None) -> None:
    """SIGKILL this process as ``module`` runs its ``at``-th forward (on the compute
    thread, where the batches loaded ahead do not count), unless ``marker`` exists; with
    ``drop``, the newest checkpoint in that directory is removed first."""
    count = [0]

    def hook(*_: Any) -> None:
        count[0] += 1
        if count[0] == at and not marker.exists():
            marker.write_text("killed\n")
            if drop is not None:
                import shutil

                shutil.rmtree(max(drop.glob("epoch-*")))
            os.kill(os.getpid(), signal.SIGKILL)

    module.register_forward_pre_hook(hook)


def dying_after_ring(at: int, marker: Path) -> None:
    """SIGKILL this process as soon as its ``at``-th fsdp snapshot has been kept here and
    exchanged with its neighbours (``_fsdp_replica.ring``), before the root has it, unless
    ``marker`` exists: the others kept a snapshot that the root never commits."""
    from lampdist._epoch._designs import _fsdp_replica

    replica: Any = _fsdp_replica  # the module whose ring the snapshot calls
    count, real_ring = [0], replica.ring

    def ring(*args: Any, **kwargs: Any) -> Any:
        received = real_ring(*args, **kwargs)
        count[0] += 1
        if count[0] == at and not marker.exists():
            marker.write_text("killed\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return received

    replica.ring = ring


def dying_in_write(at: int, marker: Path) -> None:
    """SIGKILL this process as it starts writing its shards of its ``at``-th fsdp checkpoint
    (torch's distributed checkpoint, whose collectives the other ranks are in), unless
    ``marker`` exists."""
    from lampdist._epoch._designs import _fsdp

    design: Any = _fsdp  # the module whose write_own_shards a checkpoint calls
    count, real_write = [0], design.write_own_shards

    def write(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] == at and not marker.exists():
            marker.write_text("killed\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(*args, **kwargs)

    design.write_own_shards = write


def unsized(batches: list[Any], really: bool) -> Any:
    """A source of ``batches``: the list, or with ``really`` a generator (no length)."""
    if really:
        return lambda: (batch for batch in batches)
    return lambda: batches


def concatenated(shards: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[Any]:
    """Each step's batches of every rank as one batch (one batch a step)."""
    steps = max(len(batches) for batches in shards)
    joined = []
    for step in range(steps):
        parts = [batches[step] for batches in shards if step < len(batches)]
        joined.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
    return joined


def local_parts(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's and buffer's part on this rank (an fsdp shard's local tensor)."""
    return {
        name: (value.to_local() if hasattr(value, "to_local") else value).detach().cpu()
        for name, value in module.state_dict().items()
    }


METRIC = lampdist.Metric(lambda out, y: ((out - y).abs().sum(), y.numel()))
"""The mean absolute error."""


def metrics() -> dict[str, Any]:
    import torchmetrics

    return {"mae": METRIC, "mse": torchmetrics.MeanSquaredError().set_dtype(torch.float64)}


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nranks", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--cuda", action="store_true", help="rank r on cuda:r, over NCCL")
    parser.add_argument(
        "--step-on", default="root", choices=["root", "every_rank", "sharded", "fsdp"]
    )
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--accumulate", type=int, default=ACCUMULATE)
    parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument(
        "--grad-norm", action="store_true", help="the root writes each pass's grad_norm"
    )
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument(
        "--checkpoint", default=None, help="to_directory(DIR), or to_url(URL) for s3://..."
    )
    parser.add_argument("--resume", default=None, help="load_latest(DIR or URL)")
    parser.add_argument("--width", type=int, default=6, help="the model's hidden width")
    parser.add_argument("--bf16", action="store_true", help="fsdp: gather in bfloat16")
    parser.add_argument(
        "--concatenated", action="store_true", help="one rank: each step the 2 ranks' batches"
    )
    parser.add_argument(
        "--count-reduces", action="store_true", help="write DIR/reduces<r>.json: reduce-scatters"
    )
    parser.add_argument(
        "--unsized", action="store_true", help="sources without a length (generators)"
    )
    parser.add_argument(
        "--nan-at", type=int, default=None, help="rank 1's batch N has a NaN target"
    )
    parser.add_argument("--non-finite", default="raise", choices=["raise", "skip"])
    parser.add_argument(
        "--fp16", action="store_true", help="float32 model and data, float16 autocast"
    )
    parser.add_argument(
        "--stop-in-epoch", type=int, default=None, help="the root's graceful stop, in epoch N"
    )
    parser.add_argument(
        "--cancel-in-epoch", type=int, default=None, help="cancel the root in epoch N"
    )
    parser.add_argument(
        "--stall-at", type=int, default=None, help="rank 1 sleeps 12 s before its batch N"
    )
    parser.add_argument("--collective-timeout", type=float, default=None)
    parser.add_argument(
        "--keep-unresponsive",
        action="store_true",
        help="Timeouts(end_unresponsive=False): the root does not end a stalled follower",
    )
    parser.add_argument("--shard-linear", action="store_true", help="fsdp: each Linear a unit")
    parser.add_argument("--recovery", type=float, default=None, help="Recovery(rejoin_timeout)")
    parser.add_argument("--max-recoveries", type=int, default=3)
    parser.add_argument(
        "--drop-newest", action="store_true", help="--die-in-forward removes the newest checkpoint"
    )
    parser.add_argument(
        "--no-replica", action="store_true", help="Recovery(fsdp_replica=False): from checkpoints"
    )
    parser.add_argument("--snapshot-every", type=int, default=None, help="snapshot_every_steps")
    parser.add_argument("--window", type=int, default=None, help="steps_per_epoch")
    parser.add_argument("--heartbeat", type=float, default=None, help="heartbeat_timeout (s)")
    parser.add_argument(
        "--signal", default="SIGKILL", choices=["SIGKILL", "SIGSTOP"], help="--die-after's"
    )
    parser.add_argument("--data", default=None, choices=data_sources.KINDS)
    parser.add_argument(
        "--die-in-forward",
        type=int,
        default=None,
        help="SIGKILL this process as its model runs its Nth forward, once per DIR/died-r",
    )
    parser.add_argument(
        "--die-after-ring",
        type=int,
        default=None,
        help="fsdp: SIGKILL this process once its Nth snapshot is kept, once per DIR/died-r",
    )
    parser.add_argument(
        "--die-in-write",
        type=int,
        default=None,
        help="fsdp: SIGKILL this process as it writes its Nth checkpoint, once per DIR/died-r",
    )
    parser.add_argument(
        "--die-after",
        type=int,
        default=None,
        help="SIGKILL this process when it takes its Nth training batch, once per DIR/died-r",
    )
    args = parser.parse_args(argv)
    step = lampdist.StepOptions(
        steps_per_epoch=args.window,
        accumulate_gradient_over_n_batches=args.accumulate,
        step_on=args.step_on,
        max_grad_norm=args.clip,
        measure_grad_norm=args.grad_norm,
        non_finite_loss=args.non_finite,
        autocast_dtype=torch.float16 if args.fp16 else None,
        fsdp=lampdist.FsdpPolicy(
            shard_modules=(torch.nn.Linear,) if args.shard_linear else (),
            precision=lampdist.Precision(param_dtype=torch.bfloat16 if args.bf16 else None),
        ),
    )
    built: list[torch.optim.Optimizer] = []
    reduces = count_reduce_scatters() if args.count_reduces else None

    def optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        built.append(OPTIMIZERS[args.optimizer](params))
        return built[-1]

    checkpoint_state = None
    if args.checkpoint is not None and "://" in args.checkpoint:
        checkpoint_state = checkpoint.to_url(args.checkpoint)
    elif args.checkpoint is not None:
        checkpoint_state = checkpoint.to_directory(Path(args.checkpoint))
    resume = None if args.resume is None else checkpoint.load_latest(args.resume)
    train_sizes, valid_sizes = sizes(args.nranks)
    device = f"cuda:{args.rank}" if args.cuda else "cpu"
    secret = os.environ["LAMPDIST_SECRET"]
    train = make_shards(train_sizes, seed=1)[args.rank]
    valid = make_shards(valid_sizes, seed=2)[args.rank]
    if args.fp16:  # a large loss, so that float16 gradients overflow at the first scales
        train = [(x.float(), (y * 300).float()) for x, y in train]
        valid = [(x.float(), (y * 300).float()) for x, y in valid]
    if args.nan_at is not None and args.rank == 1:
        x, y = train[args.nan_at]
        train = [
            *train[: args.nan_at],
            (x, torch.full_like(y, float("nan"))),
            *train[args.nan_at + 1 :],
        ]
    if args.stall_at is not None and args.rank == 1:
        train = stalling(train, args.stall_at)
    stateful = None
    if args.data is not None:
        stateful = data_sources.make_source(args.data, *data_sources.rows(train))
        valid = [{"x": x, "y": y} for x, y in valid]  # dict batches
    if args.die_after is not None and stateful is not None:
        marker = args.out / f"died-{args.rank}"
        signum = getattr(signal, args.signal)
        stateful = data_sources.Dying(stateful, args.die_after, marker, signum)
    elif args.die_after is not None:
        marker = args.out / f"died-{args.rank}"
        train = dying(train, args.die_after, marker, getattr(signal, args.signal))
    if args.concatenated:  # one rank, each batch the two ranks' batches of its step
        train, valid = (
            concatenated(make_shards(SIZES, seed=1)),
            concatenated(make_shards(VALID_SIZES, seed=2)),
        )
    if args.meta:
        with torch.device("meta"):
            module = make_model(seed=0 if args.rank == 0 else 10 + args.rank, width=args.width)
    else:
        module = make_model(seed=0 if args.rank == 0 else 10 + args.rank, width=args.width)
        module = module.to(device)
    if args.fp16:
        module = module.float()
    if args.die_in_write is not None:
        dying_in_write(args.die_in_write, args.out / f"died-{args.rank}")
    if args.die_after_ring is not None:
        dying_after_ring(args.die_after_ring, args.out / f"died-{args.rank}")
    if args.die_in_forward is not None:
        drop = Path(args.checkpoint) if args.drop_newest else None
        dying_in_forward(module, args.die_in_forward, args.out / f"died-{args.rank}", drop)
    model: Any = lampdist.SupervisedModel(module, mse, metrics=metrics() if args.metrics else {})
    train_source: Any
    if stateful is not None:
        model, train_source = data_sources.loss_model(module), stateful
    elif callable(train):  # dying
        train_source = train
    else:
        train_source = shuffled(train) if args.shuffle else unsized(train, args.unsized)
    data = lampdist.ModelWithData(
        model=model,
        train_batches=train_source,
        validation_batches=unsized(valid, args.unsized),
    )
    limits = {} if args.collective_timeout is None else {"collective": args.collective_timeout}
    timeouts = lampdist.Timeouts(join=30, end_unresponsive=not args.keep_unresponsive, **limits)
    stop = anyio.Event()
    cancelled = anyio.CancelScope()
    recovery = None
    if args.recovery is not None:
        recovery = lampdist.Recovery(
            rejoin_timeout=args.recovery,
            max_recoveries=args.max_recoveries,
            fsdp_replica=not args.no_replica,
            snapshot_every_steps=args.snapshot_every,
        )
    liveness: dict[str, Any] = {}
    if args.heartbeat is not None:
        liveness = {"heartbeat_interval": args.heartbeat / 4, "heartbeat_timeout": args.heartbeat}

    async def on_event(event: lampdist.PassEvent | lampdist.Recovered) -> None:
        if isinstance(event, lampdist.Recovered):
            with (args.out / "recovered.jsonl").open("a") as file:
                file.write(json.dumps(attrs.asdict(event)) + "\n")
            return
        if event.kind == "train" and event.done and not (args.out / "trained").exists():
            (args.out / "trained").touch()  # a training pass done: the tests' "well into"
        # a graceful stop asked for in the middle of a training pass of epoch --stop-in-epoch
        if event.kind == "train" and event.epoch == args.stop_in_epoch and not event.done:
            stop.set()
        if event.kind == "train" and event.epoch == args.cancel_in_epoch and not event.done:
            cancelled.cancel()  # the root's task is cancelled in the middle of a pass
        if event.kind == "train" and event.done and args.grad_norm:
            with (args.out / "grad_norms.jsonl").open("a") as file:
                file.write(json.dumps([event.grad_norm, event.grad_norm_max]) + "\n")

    if args.rank == 0:
        async with control.tcp_root(
            "127.0.0.1", args.port, nranks=args.nranks, secret=secret, **liveness
        ) as root:
            print(f"PORT {root.address[1]}", flush=True)
            with cancelled:
                state = await lampdist.drive_distributed_training(
                    data=data,
                    nranks=args.nranks,
                    device=device,
                    control=root,
                    optimizer_factory=optimizer,
                    loop=lampdist.LoopOptions(
                        max_epochs=args.epochs,
                        checkpoint_state=checkpoint_state,
                        on_event=on_event,
                        recovery=recovery,
                    ),
                    stop=stop,
                    resume=resume,
                    step=step,
                    timeouts=timeouts,
                )
        if cancelled.cancelled_caught:
            print("CANCELLED", flush=True)
            return
        curve = [[p.training_loss, p.validation_loss] for p in state.learning_curve]
        (args.out / "curve.json").write_text(json.dumps(curve))
        if args.metrics:
            points = [dict(p.metrics) for p in state.learning_curve]
            (args.out / "metrics.json").write_text(json.dumps(points))
    else:
        async with control.tcp_follower(
            "127.0.0.1", args.port, rank=args.rank, secret=secret, **liveness
        ) as follower:
            await lampdist.follow_distributed_training(
                data=data,
                rank=args.rank,
                nranks=args.nranks,
                device=device,
                control=follower,
                optimizer_factory=optimizer,
                step=step,
                timeouts=timeouts,
            )
    torch.save(local_parts(module), args.out / f"rank{args.rank}.pt")
    (args.out / f"pid{args.rank}").write_text(f"{os.getpid()}\n")  # the process that ended it
    if reduces is not None:
        (args.out / f"reduces{args.rank}.json").write_text(json.dumps(reduces))
    if built:
        torch.save(optimizer_parts(built[0], module), args.out / f"optim{args.rank}.pt")


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=os.environ.get("TCP_RANK_LOG", "WARNING"))
    anyio.run(main, sys.argv[1:])
