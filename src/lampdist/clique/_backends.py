"""Building the torch process group of a clique: Gloo or NCCL, deadlines, error mapping."""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from .._errors import CliqueError, CliqueTimeout, CollectiveFailed, LampdistError
from ._bridge import Failure

__all__ = ["Deadline", "make_gloo", "make_nccl", "prefer_nccl_cleanup", "span", "translate"]

logger = logging.getLogger(__name__)

SETUP = "clique setup"
NO_LIMIT = timedelta(days=365)  # what the process group gets for "None: no limit"
_GLOO_THREADS = 2
_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_env_lock = threading.Lock()


def span(seconds: float | None) -> timedelta:
    """Seconds as a timedelta for torch; ``None`` (no limit) as a year."""
    return NO_LIMIT if seconds is None else timedelta(seconds=seconds)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def translate(exc: BaseException, phase: str) -> Failure:
    """A torch error as a lampdist failure: a timeout, or a failed collective."""
    if isinstance(exc, LampdistError):
        return type(exc), exc.message
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    lowered = text.lower()
    kind: type[LampdistError] = CollectiveFailed
    if "timed out" in lowered or "timeout" in lowered:
        kind = CliqueTimeout
    elif phase == SETUP:
        kind = CliqueError
    return kind, f"{phase} failed: {text}"


def prefer_nccl_cleanup() -> None:
    """Make NCCL's watchdog abort the communicator on an error instead of killing the process.

    torch's default (3, tear the process down) would turn a dead peer into SIGABRT; 2 aborts
    the communicator and lets the clique raise. Only set when the user has not chosen.
    """
    with _env_lock:
        if _NCCL_ERROR_HANDLING not in os.environ:
            os.environ[_NCCL_ERROR_HANDLING] = "2"
            logger.info(
                "set %s=2 so that NCCL errors raise instead of aborting the process",
                _NCCL_ERROR_HANDLING,
            )


@attrs.define(eq=False)
class Deadline:
    """The setup budget of one rank: ``remaining()`` is the time left, or raises once spent."""

    seconds: float | None
    rank: int
    start: float = attrs.field(factory=time.monotonic)

    def remaining(self) -> timedelta:
        if self.seconds is None:
            return NO_LIMIT
        left = self.start + self.seconds - time.monotonic()
        if left <= 0:
            raise CliqueTimeout(
                f"the clique was not set up within setup_timeout={self.seconds} s; "
                "check that every rank opens it with the same clique id",
                rank=self.rank,
                phase=SETUP,
            )
        return timedelta(seconds=left)


def make_gloo(
    *,
    store: Any,
    host: str,
    rank: int,
    nranks: int,
    name: str,
    deadline: Deadline,
    op_timeout: timedelta,
) -> Any:
    """A Gloo group on the loopback device for a loopback rendezvous, else the default one."""
    gloo = ProcessGroupGloo
    options = gloo._Options()  # type: ignore[attr-defined]  # the stubs call it Options
    if _is_loopback(host):
        device = gloo.create_device(hostname="127.0.0.1", lazy_init=False)
    else:
        device = gloo.create_default_device(lazy_init=False)
    options._devices = [device]
    options._threads = _GLOO_THREADS
    options._timeout = deadline.remaining()  # the constructor's wait for all ranks
    options.group_name = name
    group = gloo(store, rank, nranks, options)  # blocks until every rank has connected
    group.set_timeout(op_timeout)
    return group


def make_nccl(
    *,
    store: Any,
    keys: Any,
    rank: int,
    nranks: int,
    name: str,
    device: torch.device,
    deadline: Deadline,
    op_timeout: timedelta,
) -> Any:
    """An NCCL group whose communicator is built now, not at the first collective."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise CliqueError("this torch build has no NCCL", rank=rank, phase=SETUP)
    # Every rank alive before NCCL's own, unbounded, communicator setup starts.
    keys.set(f"ready/{rank}", "1")
    keys.wait([f"ready/{peer}" for peer in range(nranks)], deadline.remaining())
    options = nccl.Options()
    options._timeout = op_timeout
    options.is_high_priority_stream = False
    options.group_name = name
    group = nccl(store, rank, nranks, options)
    with torch.cuda.device(device):
        group.eager_connect_single_device(device)  # blocks until every rank has joined
    return group
