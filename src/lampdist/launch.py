"""Launch with the engines you already use: torchrun, SLURM's srun, or your own.

lampdist has no launcher of its own. A launcher starts one process per rank and tells each
its place in environment variables; :func:`from_env` reads them into a :class:`LaunchEnv`,
and :meth:`LaunchEnv.open_control` opens the right side of the control channel for this
rank::

    env = lampdist.launch.from_env()        # RANK, WORLD_SIZE, ... or SLURM_PROCID, ...
    async with env.open_control() as control:
        ...                                 # tcp_root on rank 0, tcp_follower elsewhere

:func:`lampdist.train` does both and runs the right role; most scripts need nothing else.

Variables read (torchrun's win where both launchers set theirs):

- torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
- SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the first host of
  ``SLURM_JOB_NODELIST`` (or ``MASTER_ADDR`` when set), and ``MASTER_PORT``;
- lampdist: ``LAMPDIST_SECRET`` or ``LAMPDIST_SECRET_FILE`` (the shared secret of the control
  channel) and ``LAMPDIST_PORT`` (its port, the same on every rank).

Without ``LAMPDIST_PORT``, under torchrun (whose agent serves a store at ``MASTER_ADDR:
MASTER_PORT`` to its workers, ``TORCHELASTIC_USE_AGENT_STORE=True``) the root listens on a free
port and publishes it in that store, and the followers read it there (see
:class:`PortExchange`); under srun the channel listens on ``MASTER_PORT + 1``.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.to_thread
import attrs
import torch

from ._errors import ConfigError, JoinTimeout, Phase
from ._store import Budget, connect_store, wait_for_keys
from .control import (
    DEFAULT_JOIN_TIMEOUT,
    FollowerChannel,
    RootChannel,
    local_channels,
    tcp_follower,
    tcp_root,
)

__all__ = ["LaunchEnv", "PortExchange", "first_slurm_host", "from_env"]

logger = logging.getLogger(__name__)

_PHASE: Phase = "launch"


def _never() -> None:
    """A ``check_cancelled`` for callers that cannot be cancelled."""


@attrs.frozen(kw_only=True)
class PortExchange:
    """A key in the launcher's store through which the root hands its control port to the
    followers: the root listens on a free port and publishes it, the followers wait for it.

    ``host`` and ``port`` are the store's (torchrun's agent store: ``MASTER_ADDR`` and
    ``MASTER_PORT``); ``key`` must be fresh for every run and restart. Both sides give up
    after ``timeout`` seconds with :class:`~lampdist.JoinTimeout`.
    """

    host: str
    port: int
    key: str
    timeout: float = DEFAULT_JOIN_TIMEOUT

    def publish(
        self, control_port: int, *, rank: int = 0, check_cancelled: Callable[[], None] = _never
    ) -> None:
        """Write ``control_port`` under the key (blocking: call it in a worker thread, with
        ``check_cancelled=anyio.from_thread.check_cancelled`` to stop when cancelled)."""
        remaining = self._budget(rank, "publish the control port", check_cancelled)
        connect_store(self.host, self.port, remaining).set(self.key, str(control_port))

    def lookup(self, *, rank: int, check_cancelled: Callable[[], None] = _never) -> int:
        """Wait for the root's control port (blocking, like :meth:`publish`)."""
        remaining = self._budget(rank, "read the root's control port", check_cancelled)
        store = connect_store(self.host, self.port, remaining)
        wait_for_keys(store, [self.key], remaining)
        return int(store.get(self.key))

    def _budget(
        self, rank: int, what: str, check_cancelled: Callable[[], None]
    ) -> Callable[[], timedelta]:
        def expired() -> JoinTimeout:
            return JoinTimeout(
                f"could not {what} in the launcher's store at {self.host}:{self.port} "
                f"within {self.timeout} s (key {self.key!r}); is rank 0 running, or set "
                "LAMPDIST_PORT to the same free port on every rank",
                rank=rank,
                phase=_PHASE,
            )

        return Budget(self.timeout, expired, check_cancelled).remaining


@attrs.frozen(kw_only=True)
class LaunchEnv:
    """Where this process stands in a run: its rank, the run's size, its device, and where
    the root's control channel listens.

    Build it with :func:`from_env` under a launcher, or directly (``LaunchEnv(rank=1,
    nranks=2, host="10.0.0.1", port=29401, secret=...)``) when you start the ranks yourself;
    change a field with ``attrs.evolve(env, device=torch.device("cpu"))``. ``host`` is the
    root's address: the root binds its control channel there and serves the clique's
    rendezvous at it; the followers dial it. ``secret`` (never shown in ``repr``) is the
    control channel's shared secret; a run of one rank needs none. ``port=0`` lets the root
    pick a free port (read it from the channel's ``address``); followers need the real one,
    or ``port_exchange``, through which the root publishes the port it picked.
    """

    rank: int
    nranks: int
    local_rank: int = 0
    device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    host: str = "127.0.0.1"
    port: int = 0
    secret: str | bytes | None = attrs.field(default=None, repr=False)
    port_exchange: PortExchange | None = None

    def __attrs_post_init__(self) -> None:
        if self.nranks < 1:
            raise ConfigError(f"nranks must be >= 1, got {self.nranks}", phase=_PHASE)
        if not 0 <= self.rank < self.nranks:
            raise ConfigError(
                f"rank must be in 0..{self.nranks - 1} for nranks={self.nranks}, got {self.rank}",
                phase=_PHASE,
            )
        if self.local_rank < 0:
            raise ConfigError(f"local_rank must be >= 0, got {self.local_rank}", phase=_PHASE)
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}", phase=_PHASE)
        if self.rank > 0 and self.port == 0 and self.port_exchange is None:
            raise ConfigError(
                "a follower needs the root's control port: pass port=..., the port the root "
                "listens on, or port_exchange=...",
                rank=self.rank,
                phase=_PHASE,
            )
        if self.nranks > 1 and not self.secret:
            raise ConfigError(
                "a run of several ranks needs the control channel's shared secret: set "
                "LAMPDIST_SECRET (the same on every rank; e.g. "
                "`export LAMPDIST_SECRET=$(openssl rand -hex 16)`) or LAMPDIST_SECRET_FILE",
                rank=self.rank,
                phase=_PHASE,
            )

    @property
    def is_root(self) -> bool:
        """Whether this rank is the root (rank 0), which drives the run."""
        return self.rank == 0

    def open_control(
        self, *, ssl_context: ssl.SSLContext | None = None
    ) -> AbstractAsyncContextManager[RootChannel | FollowerChannel]:
        """The control channel of this rank, as an async context manager.

        On rank 0 it is :func:`lampdist.control.tcp_root` listening on ``host:port``; on the
        other ranks :func:`lampdist.control.tcp_follower` dialling it. A run of one rank gets
        an in-process channel (no socket, no secret). ``ssl_context`` turns on TLS: a server
        context on rank 0, a client context elsewhere. Pass the channel on as ``control=``
        to :func:`lampdist.drive_distributed_training` on rank 0 and to
        :func:`lampdist.follow_distributed_training` elsewhere (or call
        :func:`lampdist.train`, which does all of it).

        Raises :class:`~lampdist.ConfigError` for bad settings and, on entering,
        :class:`~lampdist.ControlError` when the root cannot listen.
        """
        if self.nranks == 1:
            return _single_rank_channel()
        if self.rank == 0:
            return _root_channel(self, ssl_context)
        return _follower_channel(self, ssl_context)


@asynccontextmanager
async def _root_channel(
    env: LaunchEnv, ssl_context: ssl.SSLContext | None
) -> AsyncIterator[RootChannel]:
    async with tcp_root(
        env.host, env.port, nranks=env.nranks, secret=env.secret, ssl_context=ssl_context
    ) as root:
        exchange = env.port_exchange
        if exchange is not None:
            port = root.address[1]
            await anyio.to_thread.run_sync(
                lambda: exchange.publish(
                    port, rank=env.rank, check_cancelled=anyio.from_thread.check_cancelled
                )
            )
        yield root


@asynccontextmanager
async def _follower_channel(
    env: LaunchEnv, ssl_context: ssl.SSLContext | None
) -> AsyncIterator[FollowerChannel]:
    port = env.port
    exchange = env.port_exchange
    if port == 0 and exchange is not None:
        port = await anyio.to_thread.run_sync(
            lambda: exchange.lookup(
                rank=env.rank, check_cancelled=anyio.from_thread.check_cancelled
            )
        )
        logger.info("the root's control port, from the launcher's store: %d", port)
    async with tcp_follower(
        env.host, port, rank=env.rank, secret=env.secret, ssl_context=ssl_context
    ) as follower:
        yield follower


@asynccontextmanager
async def _single_rank_channel() -> AsyncIterator[RootChannel]:
    root, _ = local_channels(1)
    async with root:
        yield root


def from_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read this process's :class:`LaunchEnv` from the variables torchrun or srun set
    (``environ``, by default this process's environment, read when called).

    torchrun's ``RANK``/``WORLD_SIZE`` are used when present, else SLURM's
    ``SLURM_PROCID``/``SLURM_NTASKS``. The device is ``cuda:LOCAL_RANK`` when CUDA is
    available (``cuda:0`` when the process sees a single GPU), else the CPU. The control
    channel listens on ``LAMPDIST_PORT``; without it, under torchrun on a free port that the
    root publishes in torchrun's store (:class:`PortExchange`), elsewhere on
    ``MASTER_PORT + 1``. The secret comes from
    ``LAMPDIST_SECRET`` or the file named by ``LAMPDIST_SECRET_FILE`` (one trailing newline
    stripped).

    Raises :class:`~lampdist.ConfigError`, naming the variables, when this process was not
    started by a launcher, when variables are missing, not numbers, or contradict each other
    (a rank out of range, a local rank without a GPU, both secret variables set).
    """
    if environ is None:
        environ = os.environ
    exchange_key = None
    if "RANK" in environ or "WORLD_SIZE" in environ:
        rank = _int(environ, "RANK")
        nranks = _int(environ, "WORLD_SIZE")
        local_rank = _int(environ, "LOCAL_RANK", default=0)
        host = _str(environ, "MASTER_ADDR")
        launcher = "torchrun"
        if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            run = environ.get("TORCHELASTIC_RUN_ID", "none")
            restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            exchange_key = f"lampdist/control-port/{run}/{restart}"
    elif "SLURM_PROCID" in environ:
        rank = _int(environ, "SLURM_PROCID")
        nranks = _int(environ, "SLURM_NTASKS")
        local_rank = _int(environ, "SLURM_LOCALID", default=0)
        if "MASTER_ADDR" in environ:
            host = _str(environ, "MASTER_ADDR")
        else:
            host = first_slurm_host(_str(environ, "SLURM_JOB_NODELIST"))
        launcher = "srun"
    else:
        raise ConfigError(
            "this process was not started by torchrun or srun: neither RANK/WORLD_SIZE nor "
            "SLURM_PROCID/SLURM_NTASKS is set. Start it with e.g. `torchrun --nproc-per-node 2 "
            "script.py`, or build a LaunchEnv yourself",
            phase=_PHASE,
        )
    if nranks < 1 or not 0 <= rank < nranks:
        raise ConfigError(
            f"{launcher}'s rank {rank} is not in 0..{nranks - 1} (world size {nranks})",
            phase=_PHASE,
        )
    if local_rank < 0 or local_rank > rank:
        raise ConfigError(
            f"{launcher}'s local rank {local_rank} must be in 0..{rank} for rank {rank}",
            rank=rank,
            phase=_PHASE,
        )
    exchange = None
    if exchange_key is not None and "LAMPDIST_PORT" not in environ:
        exchange = PortExchange(host=host, port=_store_port(environ, rank), key=exchange_key)
    return LaunchEnv(
        rank=rank,
        nranks=nranks,
        local_rank=local_rank,
        device=_device(local_rank, rank),
        host=host,
        port=0 if exchange is not None else _control_port(environ, rank),
        secret=_secret(environ, rank),
        port_exchange=exchange,
    )


def _device(local_rank: int, rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:  # one visible GPU per process (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES)
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise ConfigError(
            f"local rank {local_rank} has no GPU: this process sees {count} CUDA devices; "
            "start at most one rank per GPU on each machine",
            rank=rank,
            phase=_PHASE,
        )
    return torch.device("cuda", local_rank)


def _store_port(environ: Mapping[str, str], rank: int) -> int:
    port = _int(environ, "MASTER_PORT")
    if not 0 < port < 65536:
        raise ConfigError(
            f"torchrun's MASTER_PORT {port} is not in 1..65535", rank=rank, phase=_PHASE
        )
    return port


def _control_port(environ: Mapping[str, str], rank: int) -> int:
    if "LAMPDIST_PORT" in environ:
        port = _int(environ, "LAMPDIST_PORT")
    elif "MASTER_PORT" in environ:
        port = _int(environ, "MASTER_PORT") + 1
    else:
        raise ConfigError(
            "no port for the control channel: set MASTER_PORT (lampdist listens on "
            "MASTER_PORT + 1) or LAMPDIST_PORT, the same on every rank",
            rank=rank,
            phase=_PHASE,
        )
    if not 0 < port < 65536:
        raise ConfigError(
            f"the control channel's port {port} is not in 1..65535: check MASTER_PORT or "
            "LAMPDIST_PORT",
            rank=rank,
            phase=_PHASE,
        )
    return port


def _secret(environ: Mapping[str, str], rank: int) -> str | bytes | None:
    if "LAMPDIST_SECRET" in environ and "LAMPDIST_SECRET_FILE" in environ:
        raise ConfigError(
            "both LAMPDIST_SECRET and LAMPDIST_SECRET_FILE are set: keep one",
            rank=rank,
            phase=_PHASE,
        )
    if "LAMPDIST_SECRET_FILE" in environ:
        path = Path(environ["LAMPDIST_SECRET_FILE"])
        try:
            secret = path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"cannot read LAMPDIST_SECRET_FILE {str(path)!r}: {exc.strerror}",
                rank=rank,
                phase=_PHASE,
            ) from exc
        secret = secret.removesuffix(b"\n").removesuffix(b"\r")
        if not secret:
            raise ConfigError(
                f"LAMPDIST_SECRET_FILE {str(path)!r} is empty", rank=rank, phase=_PHASE
            )
        return secret
    secret_text = environ.get("LAMPDIST_SECRET")
    if secret_text == "":
        raise ConfigError("LAMPDIST_SECRET is set but empty", rank=rank, phase=_PHASE)
    return secret_text


def _str(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "")
    if not value:
        raise ConfigError(
            f"{name} is not set: the launcher sets it, or set it yourself, the same on every rank",
            phase=_PHASE,
        )
    return value


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in environ and default is not None:
        return default
    text = _str(environ, name)
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}", phase=_PHASE) from None


_BRACKETS = re.compile(r"\[([^\]]*)\]")


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[07-08,12],cpu3"`` gives ``"gpu07"``.

    Handles SLURM's compressed form (ranges with zero padding, several bracket groups,
    suffixes) without calling ``scontrol``. Raises :class:`~lampdist.ConfigError` for an
    empty or malformed list.
    """
    first = _split_top_level(nodelist.strip())[0]
    if not first or first.count("[") != first.count("]"):
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}", phase=_PHASE)

    def first_of(match: re.Match[str]) -> str:
        item = match.group(1).split(",")[0]
        return item.split("-")[0]

    host = _BRACKETS.sub(first_of, first)
    if not host or "[" in host or "]" in host:
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}", phase=_PHASE)
    return host


def _split_top_level(nodelist: str) -> list[str]:
    """``nodelist`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(nodelist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(nodelist[start:index])
            start = index + 1
    parts.append(nodelist[start:])
    return parts
