"""The default deadlines of a run, in seconds: declared once, here, for every entry point.

:class:`lampdist.Timeouts`, :func:`lampdist.clique.open_clique`,
:func:`lampdist.clique.in_process` and the control channels' factories take their defaults
from these, so a rank that leaves a deadline out gets the same one whichever entry point it
came through.
"""

from __future__ import annotations

from typing import Final

__all__ = ["COLLECTIVE_TIMEOUT", "JOIN_TIMEOUT", "SETUP_TIMEOUT", "STOP_TIMEOUT"]

JOIN_TIMEOUT: Final = 300.0
"""For the followers to join the root, and a follower to reach it (large jobs start slowly)."""
SETUP_TIMEOUT: Final = 300.0
"""For every rank to open the clique."""
COLLECTIVE_TIMEOUT: Final = 600.0
"""For each collective, counted from its start (the first batch of a pass may be slow)."""
STOP_TIMEOUT: Final = 30.0
"""Once a stop is requested, for the epoch in progress to end and be checkpointed."""
