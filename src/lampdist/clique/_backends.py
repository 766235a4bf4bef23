"""Building the torch process group of a clique: Gloo or NCCL, the setup's budget, abort
notices, error mapping."""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from .._errors import CliqueError, CliqueTimeout, CollectiveFailed, LampdistError, Phase
from .._store import NO_LIMIT, Budget, wait_for_keys
from ._bridge import Failure

__all__ = [
    "Setup",
    "describe",
    "make_gloo",
    "make_nccl",
    "post_notice",
    "prefer_nccl_cleanup",
    "read_notice",
    "span",
    "translate",
]

logger = logging.getLogger(__name__)

SETUP: Phase = "clique setup"
ABORT_KEY = "abort"  # where a rank that leaves abnormally posts "rank\nreason"
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


def translate(exc: BaseException, phase: Phase) -> Failure:
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
    ``NCCL_LOCAL_REGISTER=0``: no lazy registration of user buffers (the clique page says
    why it is set).
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


def read_notice(keys: Any) -> tuple[str, str] | None:
    """The abort notice in the clique's ``keys``: the rank that posted it (as text) and its
    reason, or ``None`` while there is none. Store errors propagate."""
    if not keys.check([ABORT_KEY]):
        return None
    notice = keys.get(ABORT_KEY).decode(errors="replace")
    peer, _, reason = notice.partition("\n")
    return peer, reason


def post_notice(keys: Any, rank: int, reason: str) -> None:
    """Post rank ``rank``'s abort notice for the other ranks, unless one is there already:
    the first notice stays, as it names the cause. Best effort: a store that is gone is
    logged, and the peers notice that themselves."""
    try:
        keys.compare_set(ABORT_KEY, "", f"{rank}\n{reason}")
    except Exception as exc:
        logger.debug("rank %d: could not post the abort notice: %s", rank, exc)


@attrs.define(eq=False)
class Setup:
    """What every wait of the setup checks between its short slices: the caller's
    cancellation (``check_cancelled`` raises it in the worker thread), once the keys are
    known a peer's notice that it abandoned the setup, and the ``setup_timeout`` budget. A
    rank that dies or is cancelled in setup thus frees the others at once instead of at
    ``setup_timeout``."""

    rank: int
    budget: Budget
    check_cancelled: Callable[[], None]
    keys: Any = None

    @classmethod
    def start(
        cls, rank: int, setup_timeout: float | None, check_cancelled: Callable[[], None]
    ) -> Setup:
        """Rank ``rank``'s setup, whose ``setup_timeout`` seconds start now."""

        def expired() -> CliqueTimeout:
            return CliqueTimeout(
                f"the clique was not set up within setup_timeout={setup_timeout} s; "
                "check that every rank opens it with the same clique id",
                rank=rank,
                phase=SETUP,
            )

        return cls(
            rank=rank, budget=Budget(setup_timeout, expired), check_cancelled=check_cancelled
        )

    def remaining(self) -> timedelta:
        """The setup time left; raises the cancellation, a peer's abort, or the timeout."""
        self.check_cancelled()
        notice = None if self.keys is None else read_notice(self.keys)
        if notice is not None and notice[0] != str(self.rank):
            raise CollectiveFailed(
                f"rank {notice[0]} left the clique during setup: {notice[1]}",
                rank=self.rank,
                phase=SETUP,
            )
        return self.budget.remaining()

    def wait_for(self, keys: Any, names: list[str]) -> None:
        """Wait until ``names`` exist in ``keys``, in slices."""
        wait_for_keys(keys, names, self.remaining)

    def abandon(self, exc: BaseException) -> None:
        """Tell the peers that this rank abandoned the setup, unless one of them did first."""
        if self.keys is not None:
            post_notice(self.keys, self.rank, describe(exc))


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
    budget: Budget,
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
    options._timeout = budget.remaining()  # the constructor's wait for all ranks
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
