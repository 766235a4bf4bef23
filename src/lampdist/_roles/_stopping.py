"""The graceful stop: once a stop is requested, how long the run has to reach its end, and
what is raised when it does not. (The OS signals that request it are :mod:`._train`'s.)"""

from __future__ import annotations

import logging

import anyio
import attrs

from .._errors import LampdistTimeout, Phase
from ._failures import PhaseTracker, most_telling

__all__ = ["BEFORE_TRAINING", "Stopping", "abandoned_stop"]

logger = logging.getLogger(__name__)

BEFORE_TRAINING: frozenset[Phase] = frozenset({"join", "clique setup", "agreement"})
"""The phases before the first pass: a stop requested in one of them has nothing to drain."""


def abandoned_stop(error: BaseException) -> bool:
    """Whether ``error`` is a stop's own end: the run abandoned because the stop did not
    finish within ``Timeouts.stop`` or came before training (a :class:`LampdistTimeout` in
    phase ``'stop'``, :meth:`Stopping.timeout_error`)."""
    leaf = most_telling(error)
    return isinstance(leaf, LampdistTimeout) and leaf.phase == "stop"


@attrs.define(eq=False)
class Stopping:
    """A graceful stop: once ``stop`` is set, the run has ``timeout`` seconds to reach its
    end (the root: the end of the epoch in progress; a follower: the root's STOP), after
    which :meth:`enforce` cancels ``scope`` and the run is abandoned. A stop requested before
    training began (:data:`BEFORE_TRAINING`) abandons the run at once: there is no epoch to
    finish, and a launcher's grace period (torchrun's is 30 s) must not run out on it."""

    stop: anyio.Event | None
    timeout: float | None
    rank: int
    scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    reached: anyio.Event = attrs.field(factory=anyio.Event)
    abandoned: str | None = None
    at_once: bool = False
    """Whether the stop came before training and abandoned the run without waiting."""
    failure_first: bool = False
    """Whether a peer's failure was known when the stop abandoned the run at once."""

    def requested(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    async def enforce(self, tracker: PhaseTracker) -> None:
        """Once stop is set, give the run ``timeout`` seconds to reach its end."""
        assert self.stop is not None
        await self.stop.wait()
        if tracker.current in BEFORE_TRAINING:
            self.abandoned = f"{tracker.current!r}, before training began,"
            self.at_once = True
            self.failure_first = tracker.cause is not None
            logger.info(
                "stop requested in phase %r, before training began: stopping at once",
                tracker.current,
                extra={"rank": self.rank, "epoch": tracker.epoch},
            )
            self.scope.cancel()
            return
        waits_for = "the current epoch" if self.rank == 0 else "the root's STOP"
        logger.info(
            "stop requested in phase %r of epoch %d: %s has %s s to come",
            tracker.current,
            tracker.epoch,
            waits_for,
            self.timeout,
            extra={"rank": self.rank, "epoch": tracker.epoch},
        )
        with anyio.move_on_after(self.timeout):
            await self.reached.wait()
            return
        self.abandoned = f"{tracker.current!r} of epoch {tracker.epoch}"
        logger.warning(
            "Timeouts.stop=%s s passed in phase %s: abandoning it",
            self.timeout,
            self.abandoned,
            extra={"rank": self.rank, "epoch": tracker.epoch},
        )
        self.scope.cancel()

    def timeout_error(self) -> LampdistTimeout:
        if self.at_once:
            return LampdistTimeout(
                f"stop was requested in phase {self.abandoned} so nothing was left to finish: "
                "abandoned it at once",
                rank=self.rank,
                phase="stop",
            )
        return LampdistTimeout(
            f"stop was requested, but phase {self.abandoned} did not end within "
            f"Timeouts.stop={self.timeout} s: abandoned it; resume from the last checkpoint",
            rank=self.rank,
            phase="stop",
        )

    def ended_it(self, error: BaseException) -> bool:
        """Whether ``error`` is what abandoning the run at once, before training, brought
        about rather than a failure of its own: under torchrun every rank is signalled at
        once, and a peer that stopped too (its report, its closed channel, the clique it
        broke) is the stop, not news, unless a failure was known before the stop came."""
        if not self.at_once or self.failure_first:
            return False
        return not abandoned_stop(error)

    def check_abandoned(self) -> None:
        """Raise the stop timeout if :meth:`enforce` abandoned the run."""
        if self.abandoned is not None:
            raise self.timeout_error()
