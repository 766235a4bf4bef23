"""lampdist inside Ray Train: ``TorchTrainer``'s ``train_loop_per_worker`` runs
:func:`lampdist.train` on every worker.

Ray Train starts one worker per rank, sets ``MASTER_ADDR``/``MASTER_PORT`` and opens
torch's default process group over a store that worker 0 serves there. lampdist keeps to its
own: :func:`from_train_context` reads the rank from ``ray.train.get_context()``, and the root
listens on a free port that it publishes in Ray Train's store (a
:class:`~lampdist.launch.PortExchange`), where the followers read it. lampdist's clique opens
process groups of its own beside Ray Train's default group (``step_on="fsdp"``, which needs
the default group to itself, is refused).

Checkpoints: lampdist writes its own every epoch into :func:`storage_dir` (under
``RunConfig(storage_path=...)``), :func:`report` hands the newest to Ray Train at the end so
that the run's ``Result.checkpoint`` carries it, and :func:`resume` finds where to go on.
Ray is imported when these are called, never by ``import lampdist``.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .._checkpoint import list_checkpoints
from .._errors import ConfigError, Phase
from .._state import LoopState
from ..checkpoint import Resumed, load, load_latest
from ..control import DEFAULT_JOIN_TIMEOUT
from ..launch import LaunchEnv, PortExchange

__all__ = ["TrainSecret", "from_train_context", "report", "resume", "storage_dir"]

_PHASE: Phase = "launch"
_CALLS = itertools.count()
"""This process's calls of :func:`from_train_context`: every rank makes the same calls, so
the n-th call's key in Ray Train's store is the same on every rank and fresh for each."""


@attrs.frozen(repr=False)
class TrainSecret:
    """The control channel's shared secret, handed to the workers in
    ``TorchTrainer(train_loop_config=...)``: the driver makes it with :meth:`new`.

    Ray Train keeps ``train_loop_config`` in its run state (what its dashboard and state API
    show), writing each value as ``str(value)``: this wrapper shows as
    ``TrainSecret(<hidden>)`` there, while a plain string would show itself.
    """

    value: bytes

    @classmethod
    def new(cls) -> TrainSecret:
        """A fresh random secret (32 bytes)."""
        return cls(secrets.token_bytes(32))

    def __repr__(self) -> str:
        return "TrainSecret(<hidden>)"

    __str__ = __repr__


def from_train_context(
    secret: TrainSecret | str | bytes, *, timeout: float = DEFAULT_JOIN_TIMEOUT
) -> LaunchEnv:
    """This Ray Train worker's :class:`~lampdist.launch.LaunchEnv`, to pass as
    ``lampdist.train(launch=...)`` (with ``stop_on_signals=False``: Ray Train runs
    ``train_loop_per_worker`` off the main thread).

    The rank, the number of ranks and the local rank are Ray Train's
    (``ray.train.get_context()``), the device ``ray.train.torch.get_device()``'s, the root's
    host ``MASTER_ADDR``. The root listens on a free port and publishes it in the store that
    Ray Train's default process group uses (``MASTER_ADDR:MASTER_PORT``), where the
    followers wait for it up to ``timeout`` seconds; call this once per run of
    :func:`lampdist.train`, on every worker. ``secret`` is the control channel's shared
    secret, the same on every worker: a :class:`TrainSecret` from ``train_loop_config``.

    Raises :class:`~lampdist.ConfigError` outside a Ray Train worker and, for several
    workers, without a secret or without ``MASTER_ADDR``/``MASTER_PORT``
    (``TorchConfig(init_method="env")``, the default, sets them).
    """
    import ray.train.torch

    context = _context("from_train_context")
    rank, nranks = context.get_world_rank(), context.get_world_size()
    call = next(_CALLS)
    value = secret.value if isinstance(secret, TrainSecret) else secret
    if nranks > 1 and not value:
        raise ConfigError(
            f"lampdist.ray.from_train_context(secret={value!r}): a run of several workers "
            "needs the control channel's shared secret: make one on the driver, "
            'train_loop_config={"lampdist_secret": lampdist.ray.TrainSecret.new()}, and pass '
            'it here (config["lampdist_secret"])',
            rank=rank,
            phase=_PHASE,
        )
    host, exchange = "127.0.0.1", None  # a worker alone needs no channel
    if nranks > 1:
        host, store_port = _store_address(os.environ, rank)
        key = f"lampdist/control-port/{context.get_experiment_name()}/{call}"
        exchange = PortExchange(host=host, port=store_port, key=key, timeout=timeout)
    return LaunchEnv(
        rank=rank,
        nranks=nranks,
        local_rank=context.get_local_rank(),
        device=ray.train.torch.get_device(),
        host=host,
        secret=value,
        port_exchange=exchange,
    )


def _context(caller: str) -> Any:
    """``ray.train.get_context()``; a ConfigError outside a Ray Train worker."""
    import ray.train

    try:
        context = ray.train.get_context()
        context.get_world_rank()
    except RuntimeError as exc:
        raise ConfigError(
            f"lampdist.ray.{caller} reads Ray Train's context, which this process has none "
            f"of ({exc}): call it inside TorchTrainer's train_loop_per_worker",
            phase=_PHASE,
        ) from exc
    return context


def _store_address(environ: Mapping[str, str], rank: int) -> tuple[str, int]:
    host, port = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"MASTER_ADDR={host!r} and MASTER_PORT={port!r}: lampdist.ray.from_train_context "
            "needs the address of Ray Train's store, which TorchTrainer sets with "
            'TorchConfig(init_method="env") (the default); pass torch_config=TorchConfig() '
            "or leave it out",
            rank=rank,
            phase=_PHASE,
        )
    return host, int(port)


def storage_dir(name: str = "lampdist") -> Path:
    """``<storage_path>/<run name>/<name>``: the directory of this Ray Train run where
    lampdist's own checkpoints go (``checkpoint.to_directory(storage_dir())``).

    The same on every worker and after Ray Train restarts the workers; a run started again
    under the same ``RunConfig(name=..., storage_path=...)`` finds it again. Raises
    :class:`~lampdist.ConfigError` when the run's storage is not a local (or mounted)
    filesystem: pass ``checkpoint.to_url(...)`` an object store's URL yourself then.
    """
    storage = _context("storage_dir").get_storage()
    if storage.storage_filesystem.type_name != "local":
        raise ConfigError(
            f"lampdist.ray.storage_dir: the run's storage is a "
            f"{storage.storage_filesystem.type_name!r} filesystem, not a local or mounted "
            "one: mount it (e.g. NFS), or keep lampdist's checkpoints in a directory of your "
            "own and pass it to resume() and report()",
            phase="configure",
        )
    return Path(storage.experiment_fs_path) / name


def resume(
    directory: str | os.PathLike[str],
    checkpoint: Any = None,
    *,
    restore_rng: bool = True,
) -> Resumed | None:
    """Where this worker's :func:`lampdist.train` goes on from, as its ``resume=``: on the
    root, the newest checkpoint in ``directory`` (lampdist's own store, a directory: what
    this run wrote before Ray Train restarted it) when there is one, else ``checkpoint`` (a
    ``ray.train.Checkpoint`` that :func:`report` made, e.g. an earlier run's
    ``Result.checkpoint`` handed in ``train_loop_config``), else ``ray.train.get_checkpoint()``
    (the run's latest reported one), else ``None``: a new run. On the other workers
    ``None`` (the root sends them the state).

    ``restore_rng`` is :func:`lampdist.checkpoint.load_latest`'s. Blocks while it reads.
    Raises the errors of :func:`lampdist.checkpoint.load`.
    """
    import ray.train

    if _context("resume").get_world_rank() != 0:
        return None
    found = load_latest(directory, restore_rng=restore_rng)
    if found is not None:
        return found
    if checkpoint is None:
        checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as path:
        return load(path, restore_rng=restore_rng)


def report(state: LoopState, directory: str | os.PathLike[str]) -> None:
    """Report the end of the run to Ray Train, on every worker (``ray.train.report`` waits
    for all of them): the root reports the last epoch's losses (``epoch``,
    ``training_loss``, ``validation_loss``) and the newest checkpoint in ``directory`` as
    the run's checkpoint, under the same name (``epoch-000004``); the others report the
    same metrics without one. ``Result.checkpoint`` then holds it, and :func:`resume`
    goes on from it.
    """
    import ray.train

    metrics: dict[str, Any] = {"epoch": state.epoch}
    if state.learning_curve:
        last = state.learning_curve[-1]
        metrics.update(training_loss=last.training_loss, validation_loss=last.validation_loss)
    if _context("report").get_world_rank() != 0 or not Path(directory).is_dir():
        ray.train.report(metrics)
        return
    newest = list_checkpoints(directory, verify=False)
    if not newest:
        ray.train.report(metrics)
        return
    checkpoint = ray.train.Checkpoint.from_directory(newest[0].location)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=newest[0].name)
