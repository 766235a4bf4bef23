"""``lampdist demo``: a small digits classifier trained data-parallel, end to end."""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
import attrs
import torch
from rich.console import Console

from .. import checkpoint
from .._errors import ConfigError
from .._model import SupervisedModel
from .._monitor import Monitor
from .._options import LoopOptions, ModelWithData, StepOptions
from .._roles import handling_signals, local_data_parallel_training_loop, run_until_signal, train
from .._state import LoopState
from .._words import counted
from ..checkpoint import Resumed
from ..launch import LaunchEnv, from_env
from ..trackers import TensorBoardTracker, Tracker
from ._data import ACCURACY, Digits, batch_source, create_model, cross_entropy, load_digits
from ._plot import plot_learning_curve
from ._progress import MetricsFile, PassCounter, on_pass_event, open_reporter

__all__ = ["DemoOptions", "DemoResult", "choose_launch", "run_demo"]

logger = logging.getLogger(__name__)

BEST_BY = Monitor("validation_accuracy", mode="max")
"""The demo keeps the model of the epoch with the highest validation accuracy."""
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
CURVE = "learning_curve.png"
MODEL = "model.pt"


@attrs.frozen(kw_only=True)
class DemoOptions:
    """The demo's command-line flags."""

    ranks: int | None = None
    epochs: int = 10
    batch_size: int = 32
    lr: float = 0.003
    device: Literal["cpu", "cuda"] = "cpu"
    out: Path = Path("lampdist-demo")
    seed: int = 0
    resume: bool = False
    role: Literal["root", "follower"] | None = None
    rank: int | None = None
    nranks: int | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    tensorboard: Path | None = None


@attrs.frozen(kw_only=True)
class DemoResult:
    """What the root reports at the end of the demo."""

    state: LoopState
    accuracy: float
    seconds: float
    nranks: int
    device: str
    out: Path
    first_epoch: int
    tensorboard: Path | None = None


def choose_launch(options: DemoOptions, environ: Mapping[str, str]) -> LaunchEnv | None:
    """The launch of a multi-process demo (``--role`` flags, or torchrun's variables), or
    ``None`` for ranks in this process."""
    if options.role is not None:
        rank = options.rank if options.rank is not None else 0
        if (options.role == "root") != (rank == 0):
            raise ConfigError(
                f"--role {options.role} does not fit --rank {rank}: the root is rank 0, "
                "followers are ranks 1..N-1",
                phase="demo",
            )
        if options.nranks is None or options.port is None:
            raise ConfigError("--role needs --nranks and --port (and --host)", phase="demo")
        secrets = {k: v for k, v in environ.items() if k.startswith("LAMPDIST_SECRET")}
        environ = {
            **secrets,
            "RANK": str(rank),
            "WORLD_SIZE": str(options.nranks),
            "LOCAL_RANK": environ.get("LOCAL_RANK", "0"),
            "MASTER_ADDR": options.host,
            "LAMPDIST_PORT": str(options.port),
        }
    elif not ("RANK" in environ and "WORLD_SIZE" in environ):
        return None
    launch = from_env(environ)
    if options.device == "cpu":
        return attrs.evolve(launch, device=torch.device("cpu"))
    if launch.device.type != "cuda":
        raise ConfigError("--device cuda, but CUDA is not available", phase="demo")
    return launch


async def run_demo_until_signal(
    options: DemoOptions, console: Console, environ: Mapping[str, str] | None = None
) -> DemoResult | None:
    """:func:`run_demo` with SIGTERM and SIGINT handled from the command's first instant: one
    before training (loading the data, importing, joining) ends the command at once with
    :class:`~lampdist._roles.Interrupted`; during training, the run stops in order."""
    async with handling_signals(None) as signals:
        with signals.guarded():  # starting until train() takes the signals over
            return await run_demo(options, console, environ)
        raise signals.interrupted()  # cancelled by a signal, out of train()
    raise AssertionError("unreachable: the guard returns or raises")


async def run_demo(
    options: DemoOptions, console: Console, environ: Mapping[str, str] | None = None
) -> DemoResult | None:
    """Run the demo as this process's part: every rank here, or one rank of a launched run,
    as ``environ`` (default: this process's environment) says.

    Returns the result on the root, ``None`` on a follower. Raises
    :class:`~lampdist._roles.Interrupted` after SIGTERM or SIGINT, and the errors of the run.
    """
    _check(options)
    launch = choose_launch(options, os.environ if environ is None else environ)
    data = await anyio.to_thread.run_sync(load_digits, options.seed)
    if launch is not None and not launch.is_root:
        shard = data.shard(launch.rank, launch.nranks)
        await train(
            launch=launch,
            data=ModelWithData(
                model=_model(create_model(options.seed)),
                train_batches=_train_batches(shard, options),
                validation_batches=_valid_batches(shard, options),
            ),
            optimizer_factory=_optimizer(options.lr),
            loop=LoopOptions(max_epochs=options.epochs),
            step=_step(options),
        )
        logger.info("rank %d: done", launch.rank)
        return None
    devices = _devices(options, launch)
    return await _run_root(options, console, data, launch, devices)


def _check(options: DemoOptions) -> None:
    for name in ("epochs", "batch_size"):
        if getattr(options, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1", phase="demo")
    if not options.lr > 0:
        raise ConfigError("--lr must be > 0", phase="demo")
    if options.ranks is not None and options.ranks < 1:
        raise ConfigError("--ranks must be >= 1", phase="demo")


def _devices(options: DemoOptions, launch: LaunchEnv | None) -> list[torch.device]:
    """One device per rank of this process."""
    if launch is not None:
        return [launch.device]
    if options.device == "cpu":
        return [torch.device("cpu")] * (options.ranks or 2)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError("--device cuda, but CUDA is not available", phase="demo")
    ranks = options.ranks or count
    if ranks > count:
        raise ConfigError(
            f"--ranks {ranks} needs {ranks} GPUs, this machine has {count}", phase="demo"
        )
    return [torch.device("cuda", i) for i in range(ranks)]


def _optimizer(lr: float) -> Any:
    def create(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(parameters, lr=lr)

    return create


def _model(module: torch.nn.Module) -> SupervisedModel:
    """Every rank's model: the classifier, its loss, and its accuracy as a metric."""
    return SupervisedModel(module, cross_entropy, metrics={"accuracy": ACCURACY})


def _step(options: DemoOptions) -> StepOptions:
    """Every rank's step options: the shuffles follow ``--seed``; the gradient norm is
    reported."""
    return StepOptions(shuffle_seed=options.seed, measure_grad_norm=True)


def _train_batches(shard: Digits, options: DemoOptions) -> Any:
    return batch_source(
        shard.train_inputs,
        shard.train_labels,
        options.batch_size,
        shuffle=True,
    )


def _valid_batches(shard: Digits, options: DemoOptions) -> Any:
    return batch_source(shard.valid_inputs, shard.valid_labels, options.batch_size, shuffle=False)


async def _run_root(
    options: DemoOptions,
    console: Console,
    data: Digits,
    launch: LaunchEnv | None,
    devices: Sequence[torch.device],
) -> DemoResult:
    started = time.perf_counter()
    out = options.out.resolve()
    resumed = await _prepare(out, options.resume)
    first_epoch = resumed.epoch if resumed is not None else 0
    nranks = launch.nranks if launch is not None else len(devices)
    metrics = MetricsFile(out / METRICS)
    metrics.restart(first_epoch)
    module = create_model(options.seed).to(devices[0])
    root_shard = data.shard(0, nranks)
    train_steps = math.ceil(len(root_shard.train_labels) / options.batch_size)  # the most
    per_epoch = train_steps + math.ceil(len(root_shard.valid_labels) / options.batch_size)
    counter = PassCounter(
        first_epoch=first_epoch, epochs=options.epochs, batches_per_epoch=per_epoch
    )

    async with AsyncExitStack() as trackers:
        tracker = await _open_tensorboard(
            trackers, options, nranks=nranks, first_step=first_epoch * train_steps
        )
        if first_epoch < options.epochs:  # else the library warns, and the summary names --epochs
            logger.info(
                "training on %s (%s), epochs %d..%d, files in %s",
                counted(nranks, "rank"),
                devices[0].type,
                first_epoch + 1,
                options.epochs,
                out,
            )
        with open_reporter(console, epochs=options.epochs, total=counter.total) as reporter:
            loop = LoopOptions(
                max_epochs=options.epochs,
                checkpoint_state=checkpoint.to_directory(out / CHECKPOINTS, keep=3),
                return_min_validation_loss_model=range(options.epochs),
                best_model_monitor=BEST_BY,
                on_event=on_pass_event(reporter, counter, metrics, tracker),
            )
            if launch is not None:
                state = await train(
                    launch=launch,
                    data=ModelWithData(
                        model=_model(module),
                        train_batches=_train_batches(root_shard, options),
                        validation_batches=_valid_batches(root_shard, options),
                    ),
                    optimizer_factory=_optimizer(options.lr),
                    loop=loop,
                    step=_step(options),
                    resume=resumed,
                )
                assert state is not None  # train returns the loop state on the root
            else:
                state = await _train_here(options, data, module, devices, loop, resumed)
        if tracker is not None:
            await tracker.log_summary(state)
    seconds = time.perf_counter() - started
    await anyio.to_thread.run_sync(functools.partial(_write_results, out, module, state))
    return DemoResult(
        state=state,
        accuracy=final_accuracy(state),
        seconds=seconds,
        nranks=nranks,
        device=str(devices[0]),
        out=out,
        first_epoch=first_epoch,
        tensorboard=options.tensorboard.resolve() if options.tensorboard is not None else None,
    )


async def _open_tensorboard(
    stack: AsyncExitStack, options: DemoOptions, *, nranks: int, first_step: int
) -> Tracker | None:
    """The root's TensorBoard tracker for ``--tensorboard`` (``None`` without it), open in
    ``stack`` and with the demo's hyperparameters logged. A resumed run's steps go on from
    ``first_step``, the steps of the epochs it resumes after."""
    if options.tensorboard is None:
        return None
    tracker = TensorBoardTracker(options.tensorboard.resolve(), first_step=first_step)
    await stack.enter_async_context(tracker)
    await tracker.log_hyperparameters(
        {
            "epochs": options.epochs,
            "batch_size": options.batch_size,
            "lr": options.lr,
            "optimizer": "adam",
            "ranks": nranks,
            "device": options.device,
            "seed": options.seed,
        }
    )
    return tracker


async def _train_here(
    options: DemoOptions,
    data: Digits,
    root_module: torch.nn.Module,
    devices: Sequence[torch.device],
    loop: LoopOptions,
    resumed: Resumed | None,
) -> LoopState:
    """Every rank in this process, over the in-process control channel."""
    nranks = len(devices)
    entries = []
    for rank, device in enumerate(devices):
        module = root_module if rank == 0 else create_model(options.seed).to(device)
        shard = data.shard(rank, nranks)
        entries.append(
            ModelWithData(
                model=_model(module),
                train_batches=_train_batches(shard, options),
                validation_batches=_valid_batches(shard, options),
            )
        )

    async def work(stop: anyio.Event) -> LoopState:
        return await local_data_parallel_training_loop(
            models_with_data_streams=entries,
            optimizer_factory=_optimizer(options.lr),
            loop=loop,
            step=_step(options),
            resume=resumed,
            stop=stop,
        )

    return await run_until_signal(work, rank=0)


async def _prepare(out: Path, resume: bool) -> Resumed | None:
    """The checkpoint to resume from, if ``resume``; refuses to overwrite a run otherwise."""
    directory = out / CHECKPOINTS
    if resume:
        loaded = await anyio.to_thread.run_sync(
            functools.partial(checkpoint.load_latest, directory, map_location="cpu")
        )
        if loaded is None:
            logger.warning("nothing to resume in %s: starting a new run", directory)
        return loaded
    if directory.exists() and any(directory.iterdir()):
        raise ConfigError(
            f"{out} already holds a run: pass --resume to continue it, or choose another --out",
            phase="demo",
        )
    return None


def final_accuracy(state: LoopState) -> float:
    """The validation accuracy of the model the run ends with: the best epoch's, measured by
    its validation pass over every rank's examples (NaN for a curve without it)."""
    epoch = state.min_validation_epoch
    points = [p for p in state.learning_curve if p.epoch == epoch] or state.learning_curve[-1:]
    value = points[0].metrics.get(BEST_BY.metric, math.nan) if points else math.nan
    return value if isinstance(value, float) else math.nan


def _write_results(out: Path, module: torch.nn.Module, state: LoopState) -> None:
    torch.save(module.state_dict(), out / MODEL)
    plot_learning_curve(out / CURVE, state.learning_curve)
