"""Failure triage: where a rank is (:class:`PhaseTracker`), which of the errors a failure
raised on the ranks tells the most, and which peer the control channel names as its culprit."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn, cast, get_args

import anyio
import anyio.to_thread
import attrs

from .._errors import (
    CliqueTimeout,
    CollectiveFailed,
    ConfigError,
    JoinRejected,
    LampdistError,
    PeerDisconnected,
    PeerUnresponsive,
    Phase,
    RankFailed,
    name_rank,
)
from ..clique import Clique

__all__ = [
    "CULPRIT_TIMEOUT",
    "DERIVED",
    "PhaseTracker",
    "describe",
    "end_unresponsive",
    "find_culprit",
    "most_telling",
    "naming_rank",
    "reported_config_error",
    "single_error",
    "watch_peers",
]

logger = logging.getLogger(__name__)

CULPRIT_TIMEOUT = 2.0
"""How long a rank whose collective failed waits for the control channel to name the culprit."""


@attrs.define
class PhaseTracker:
    """A rank's failure-report tracker: where the rank is, which its error messages and
    failure reports name, and what has been said about its failure.

    The rank's driver updates it as the run moves on; the tasks beside the run (the peer
    watch, the stop) read it.
    """

    current: Phase = "join"
    """The phase the rank is in ("join", "clique setup", "train", ...)."""
    epoch: int = 0
    pass_index: int = 0
    reported: bool = False
    """Whether the rank's failure has already gone to its peers (the root's STOP with the
    error, a follower's report), so that the driver's outer handler does not send it again."""
    cause: LampdistError | None = None
    """A peer's failure that cancelled this rank (the root's watch sets it)."""
    head_start_given: bool = False
    """Whether the root has let a failed follower exit first (it does so once)."""


def describe(error: BaseException) -> str:
    """``"Type: message"`` of the most telling error in ``error`` (see :func:`single_error`)."""
    leaf = most_telling(error)
    if isinstance(leaf, anyio.get_cancelled_exc_class()):
        return "cancelled"  # the backend's message names internals, not a reason
    return f"{type(leaf).__name__}: {leaf}"


_REPORTED_WHERE = re.compile(r"rank (?P<rank>\d+), phase '(?P<phase>[^']+)': (?P<message>.*)", re.S)
"""The start of a lampdist error's text: where it happened, then its message."""

_PHASES: frozenset[str] = frozenset(get_args(Phase))


def _config_errors(kind: type[ConfigError]) -> dict[str, type[ConfigError]]:
    """``kind`` and its subclasses in lampdist, by name."""
    found = {kind.__name__: kind}
    for sub in kind.__subclasses__():
        if sub.__module__ == ConfigError.__module__:
            found |= _config_errors(sub)
    return found


def reported_config_error(error: BaseException) -> ConfigError | None:
    """On the root: the :class:`ConfigError` (or the subclass of it, :class:`MismatchError`)
    that a follower reported, when ``error`` is that report, else ``None``.

    A follower reports its failure as :func:`describe`'s text (``"MismatchError: rank 1,
    phase 'clique setup': ..."``), which the root's channel raises as :class:`RankFailed`
    naming the follower and the phase of its report. Bad settings are a
    :class:`ConfigError` on every rank that learns of them, so that a launcher's script
    that catches it (exit 2, see docs/reliability.md) does so on the root too: the error
    returned names the follower's rank and the phase its own error names (else that of its
    report), with the follower's message."""
    leaf = most_telling(error)
    if not isinstance(leaf, RankFailed) or not leaf.rank:
        return None
    name, colon, text = leaf.message.partition(": ")
    kind = _config_errors(ConfigError).get(name)
    if not colon or kind is None:
        return None
    phase, message = leaf.phase, text
    where = _REPORTED_WHERE.fullmatch(text)
    if where is not None and int(where["rank"]) == leaf.rank and where["phase"] in _PHASES:
        phase, message = cast(Phase, where["phase"]), where["message"]
    return kind(message, rank=leaf.rank, phase=phase)


def most_telling(error: BaseException) -> BaseException:
    """``error`` itself, or for an exception group the error :func:`single_error` would raise."""
    if not isinstance(error, BaseExceptionGroup):
        return error
    cancelled = anyio.get_cancelled_exc_class()
    real = [leaf for leaf in _leaves(error) if not isinstance(leaf, cancelled)]
    return _most_telling(real) or error


async def watch_peers(watch: Callable[[], Awaitable[NoReturn]], tracker: PhaseTracker) -> NoReturn:
    """``watch()`` of a control channel; a peer that vanished is reported in this rank's
    current phase, which says more than the channel's (the kind of the last command)."""
    try:
        await watch()
    except PeerDisconnected as exc:  # PeerUnresponsive stays itself
        raise type(exc)(exc.message, rank=exc.rank, phase=tracker.current) from None


END_TIMEOUT = 2.0
"""How long the root looks for an unresponsive follower's process (a read of its store)."""


async def end_unresponsive(error: LampdistError, clique: Clique | None) -> None:
    """On the root, when ``error`` finds a follower unresponsive: end its process if it runs
    on this machine (see :meth:`lampdist.Clique.end_process`), so that its launcher sees it
    fail first. Best effort, within :data:`END_TIMEOUT` seconds."""
    if clique is None or not isinstance(error, PeerUnresponsive) or not error.rank:
        return
    pid = None
    with anyio.move_on_after(END_TIMEOUT):
        pid = await anyio.to_thread.run_sync(clique.end_process, error.rank, abandon_on_cancel=True)
    if pid is not None:
        logger.warning(
            "rank %d (process %d on this machine) is unresponsive: ended it with SIGKILL, so "
            "that its launcher sees it fail (Timeouts.end_unresponsive)",
            error.rank,
            pid,
            extra={"rank": 0},
        )


async def find_culprit(
    watch: Callable[[], Awaitable[NoReturn]], tracker: PhaseTracker
) -> LampdistError | None:
    """After a collective failed: the control channel's account of which peer failed, if it
    gives one within :data:`CULPRIT_TIMEOUT` seconds."""
    with anyio.move_on_after(CULPRIT_TIMEOUT):
        try:
            await watch_peers(watch, tracker)
        except (RankFailed, PeerDisconnected) as exc:
            return exc
    return None


DERIVED: tuple[type[BaseException], ...] = (
    RankFailed,
    PeerDisconnected,
    CollectiveFailed,
    CliqueTimeout,
    JoinRejected,
)
"""Errors that report another failure, most telling first. A follower's join refused
(``JoinRejected``) follows from the root's state: in one process, the root's own error (its
stop before training began, its failure) is the news, not the followers' refusals."""


@contextmanager
def naming_rank(rank: int) -> Iterator[None]:
    """Name ``rank`` in a lampdist error that leaves the block naming no rank (see
    :func:`lampdist._errors.name_rank`)."""
    try:
        yield
    except BaseException as error:
        name_rank(error, rank)
        raise


@contextmanager
def single_error() -> Iterator[None]:
    """Re-raise an exception group as its most telling error.

    A failure shows up several times: where it happened, as failed collectives elsewhere, and
    as the control channel's report naming the failed rank. This keeps the original error,
    else the report; it raises the group itself only when it holds unrelated errors.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        chosen = most_telling(group)
        if chosen is group:
            raise
        raise chosen from chosen.__cause__


def _most_telling(errors: list[BaseException]) -> BaseException | None:
    """The original error if there is one kind of it (the lowest rank's), else the most telling
    report of a failure elsewhere; ``None`` for several unrelated errors."""
    original = [e for e in errors if not isinstance(e, DERIVED)]
    if original:
        if len({type(e) for e in original}) > 1:
            return None
        return min(original, key=lambda e: getattr(e, "rank", None) or 0)
    for kind in DERIVED:
        for error in errors:
            if isinstance(error, kind):
                return error
    return None


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
