"""What a group's failure says: a backend's error as the clique's failure (naming the peer
that left), a timeout's account of where every rank is, and the clique's account of a failure
seen outside it (a collective of torch's default group)."""

from __future__ import annotations

import time

import torch.distributed as dist

from .._errors import CliqueTimeout, CollectiveFailed, LampdistError, Phase
from ._backends import translate
from ._bridge import Failure
from ._group_state import WATCH_INTERVAL, GroupState
from ._trail import ANSWER_WAIT, account, ask

__all__ = ["ExplainingGroup"]

# How long explain() waits for the watcher to learn of a peer's death or abort notice: a few
# of its polls (only on the failure path of a collective run outside the clique).
_EXPLAIN_WAIT = 4 * WATCH_INTERVAL


class ExplainingGroup(GroupState):
    """The group's failures in words (see the module docstring)."""

    __slots__ = ()

    # -- what pending collectives call -----------------------------------------------------

    def _translate(self, exc: BaseException, phase: Phase, what: str | None = None) -> Failure:
        """``exc`` as a failure of collective ``phase`` (``what`` names it with its number
        and size in a timeout's message)."""
        kind, message = translate(exc, phase)
        if isinstance(exc, LampdistError):
            return kind, message
        # A peer that leaves abnormally posts its notice before its sockets close: name it.
        notice = self._link.read_notice()
        if notice is not None and notice[0] != str(self.rank):
            return CollectiveFailed, f"{phase} failed: rank {notice[0]} left the clique: " + (
                f"{notice[1]} ({message.removeprefix(f'{phase} failed: ')})"
            )
        if kind is CliqueTimeout:
            # The backend's own deadline is the clique's: say which limit passed, as the
            # clique's timer does when it fires first.
            detail = message.removeprefix(f"{phase} failed: ")
            limit = self.collective_timeout
            what = what or phase
            return kind, f"{what} did not complete within collective_timeout={limit} s ({detail})"
        return kind, message

    def _account(self, failure: Failure) -> Failure:
        """A timeout's ``failure`` with where every rank is: its step, its last collectives,
        how long it has waited in its current one (see ``_trail``). Blocking: the first
        caller asks the peers and waits up to :data:`ANSWER_WAIT` seconds for their answers;
        later callers reuse its account. Other failures are returned as they are."""
        kind, message = failure
        if kind is not CliqueTimeout:
            return failure
        if not self._asking.acquire(timeout=2 * ANSWER_WAIT):  # another caller is asking
            return failure
        try:
            if self._account_text is None:
                with self._lock:
                    trails = {self.rank: self.trail.snapshot()}
                keys = self._keys
                if keys is not None and self.nranks > 1:
                    trails.update(ask(keys, self.rank, self.nranks, ANSWER_WAIT))
                self._account_text = account(trails, self.rank, self.nranks, ANSWER_WAIT)
            text = self._account_text
        finally:
            self._asking.release()
        return kind, f"{message.rstrip('.')}. {text}"

    # -- a failure seen outside the clique -------------------------------------------------

    def explain(self, exc: BaseException, phase: Phase) -> Failure | None:
        """What this clique knows of ``exc``, a failure seen outside it (in a collective of
        torch's default group, say): its own failure, or a peer's abort notice naming the
        peer that left (a timeout says where every rank is, see :meth:`_account`); ``None``
        when it knows of none. A peer's death can reach the caller's
        collective before the watcher reads the tether: give the watcher
        :data:`_EXPLAIN_WAIT` seconds to learn of it."""
        deadline = time.monotonic() + _EXPLAIN_WAIT
        while True:
            with self._lock:
                failure = self._failure
            if failure is not None or time.monotonic() >= deadline:
                break
            time.sleep(WATCH_INTERVAL / 5)
        if failure is not None:
            kind, message = failure
            return self._account((kind, f"{message} ({type(exc).__name__}: {exc})"))
        notice = self._link.read_notice()
        if notice is not None and notice[0] != str(self.rank):
            return CollectiveFailed, (
                f"{phase} failed: rank {notice[0]} left the clique: {notice[1]} "
                f"({type(exc).__name__}: {exc})"
            )
        if _from_a_backend(exc):  # a collective of another group of this process failed
            kind, message = translate(exc, phase)
            if kind is CliqueTimeout:
                detail = message.removeprefix(f"{phase} failed: ")
                limit = self.collective_timeout
                message = f"{phase} did not complete within collective_timeout={limit} s ({detail})"
            return self._account((kind, message))
        return None


def _from_a_backend(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective backend's own error (torch's distributed errors, or
    Gloo's and NCCL's runtime errors, which name their sources), not a model's."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("gloo/" in text or "NCCL" in text)
