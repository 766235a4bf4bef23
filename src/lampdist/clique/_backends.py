"""Building the torch process group of a clique: Gloo or NCCL, deadlines, error mapping."""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from .._errors import CliqueError, CliqueTimeout, CollectiveFailed, LampdistError
from .._store import wait_for_keys
from ._bridge import Failure

__all__ = [
    "ABORT_KEY",
    "Deadline",
    "Setup",
    "describe",
    "make_gloo",
    "make_nccl",
    "prefer_nccl_cleanup",
    "span",
    "translate",
]

logger = logging.getLogger(__name__)

SETUP = "clique setup"
ABORT_KEY = "abort"  # where a rank that leaves abnormally posts "rank\nreason"
NO_LIMIT = timedelta(days=365)  # what the process group gets for "None: no limit"
_GLOO_THREADS = 2
_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
_NCCL_RUNTIME_CONNECT = "NCCL_RUNTIME_CONNECT"
_NCCL_LOCAL_REGISTER = "NCCL_LOCAL_REGISTER"
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
    """Settings that let a clique fail cleanly; each only when the user has not chosen.

    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: NCCL's watchdog aborts the communicator on an
    error instead of killing the process (torch's default, 3, would turn a dead peer into
    SIGABRT). ``NCCL_RUNTIME_CONNECT=0``: NCCL connects every peer when the communicator is
    built (the clique's setup, which has a deadline), not inside the first collective of each
    kind, where an issuing thread would block on a silent or dead peer until an abort.
    ``NCCL_LOCAL_REGISTER=0``: no lazy registration of user buffers, set after a diagnostic
    seemed to show a 4x slower reduce without it; that was the barrier's skew (the clique
    page), so the setting is likely needless and stays until a GPU run confirms it.
    """
    with _env_lock:
        for name, value, why in (
            (_NCCL_ERROR_HANDLING, "2", "NCCL errors raise instead of aborting the process"),
            (_NCCL_RUNTIME_CONNECT, "0", "NCCL connects the peers at clique setup"),
            (_NCCL_LOCAL_REGISTER, "0", "NCCL does not register user buffers lazily"),
        ):
            if name not in os.environ:
                os.environ[name] = value
                logger.info("set %s=%s so that %s", name, value, why)


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


@attrs.define(eq=False)
class Setup:
    """What every wait of the setup checks between its short slices: the deadline, the
    caller's cancellation (``check_cancelled`` raises it in the worker thread) and, once the
    keys are known, a peer's notice that it abandoned the setup. A rank that dies or is
    cancelled in setup thus frees the others at once instead of at ``setup_timeout``."""

    deadline: Deadline
    check_cancelled: Callable[[], None]
    keys: Any = None

    def remaining(self) -> timedelta:
        """The setup time left; raises the cancellation, a peer's abort, or the timeout."""
        self.check_cancelled()
        if self.keys is not None and self.keys.check([ABORT_KEY]):
            notice = self.keys.get(ABORT_KEY).decode(errors="replace")
            peer, _, reason = notice.partition("\n")
            if peer != str(self.deadline.rank):
                raise CollectiveFailed(
                    f"rank {peer} left the clique during setup: {reason}",
                    rank=self.deadline.rank,
                    phase=SETUP,
                )
        return self.deadline.remaining()

    def wait_for(self, keys: Any, names: list[str]) -> None:
        """Wait until ``names`` exist in ``keys``, in slices."""
        wait_for_keys(keys, names, self.remaining)

    def abandon(self, exc: BaseException) -> None:
        """Tell the peers that this rank abandoned the setup, unless one of them did first."""
        try:
            if self.keys is not None:  # the first notice stays: it names the cause
                self.keys.compare_set(ABORT_KEY, "", f"{self.deadline.rank}\n{describe(exc)}")
        except Exception as error:  # the store is gone: the peers notice that themselves
            logger.debug("rank %d: could not post the abort notice: %s", self.deadline.rank, error)


def describe(exc: BaseException) -> str:
    """``"Type: first line"`` of ``exc``, or ``"cancelled"``, for abort notices. Works in any
    thread (the backend's cancellation class is known only on the event loop thread). A task
    group's exception group of one error is described by that error."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if not isinstance(exc, Exception | KeyboardInterrupt | SystemExit | GeneratorExit):
        return "cancelled"  # asyncio's CancelledError, trio's Cancelled
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
    rank: int,
    nranks: int,
    name: str,
    device: torch.device,
    op_timeout: timedelta,
) -> Any:
    """An NCCL group whose communicator is built now, not at the first collective. NCCL's own
    setup is unbounded: call it once every rank is known to be ready."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise CliqueError("this torch build has no NCCL", rank=rank, phase=SETUP)
    options = nccl.Options()
    options._timeout = op_timeout
    options.is_high_priority_stream = False
    options.group_name = name
    # This runs on a worker thread whose current device may be another rank's GPU: build
    # everything with this rank's device current, so that no context or NCCL resource of
    # this rank lands on another GPU.
    with torch.cuda.device(device):
        group = nccl(store, rank, nranks, options)
        group.eager_connect_single_device(device)  # blocks until every rank has joined
    return group
