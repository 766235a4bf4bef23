"""The deadlines of a run: :class:`Timeouts`."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ._defaults import COLLECTIVE_TIMEOUT, JOIN_TIMEOUT, SETUP_TIMEOUT, STOP_TIMEOUT
from ._errors import ConfigError
from ._option_checks import validator

__all__ = ["Timeouts"]


def _seconds(name: str, *, zero: bool = False) -> Callable[[object, object, object], None]:
    def check(_: object, __: object, value: object) -> None:
        if value is None:
            return
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (value >= 0 if zero else value > 0)
        ):
            bound = ">= 0" if zero else "> 0"
            raise ConfigError(
                f"Timeouts.{name} must be {bound} seconds or None (no limit), got {value!r}",
                phase="configure",
            )

    return check


@attrs.frozen(kw_only=True)
class Timeouts:
    """The deadlines of a run, in seconds (``None``: no limit).

    ``join``: for the followers to join the root (and a follower to reach it); ``setup``: for
    every rank to open the clique; ``collective``: for each collective, counted from its
    start; ``stop``: once a stop is requested, for the epoch in progress to end and be
    checkpointed (keep it below your scheduler's grace period). Raises
    :class:`~lampdist.ConfigError` for a negative or zero value (``stop`` may be 0).

    ``end_unresponsive``: what the root does with a follower that the control channel finds
    unresponsive (:class:`~lampdist.PeerUnresponsive`: its connection open, its heartbeats
    gone for the channel's ``heartbeat_timeout``). Every rank leaves its collectives with it
    at once either way; with ``True`` (the default) the root also ends the follower's process
    with SIGKILL when it runs on the root's machine, so that a launcher sees it fail (and
    torchrun names it as the root cause) and a supervisor can restart it. With ``False``, or
    on another machine, the stalled process exits with a named error when it wakes up.
    """

    join: float | None = attrs.field(default=JOIN_TIMEOUT, validator=_seconds("join"))
    setup: float | None = attrs.field(default=SETUP_TIMEOUT, validator=_seconds("setup"))
    collective: float | None = attrs.field(
        default=COLLECTIVE_TIMEOUT, validator=_seconds("collective")
    )
    stop: float | None = attrs.field(default=STOP_TIMEOUT, validator=_seconds("stop", zero=True))
    end_unresponsive: bool = attrs.field(
        default=True,
        validator=validator(lambda value: isinstance(value, bool), "True or False", "pass a bool"),
    )
