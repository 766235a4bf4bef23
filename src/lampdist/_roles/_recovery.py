"""The root's in-job recovery of lost followers (see :class:`lampdist.Recovery`): what a lost
follower is, the state the run goes back to, and how long the survivors hold.

After every pass the root keeps a *snapshot* in memory: what a checkpoint holds (the model,
the whole optimizer state, every rank's place in its training data and RNG states), taken by
the run's state component as it takes a checkpoint (``_run_state``: the same capture, kept in
memory). When a follower is lost the root aborts the
clique, tells the survivors to HOLD, waits for a new process to join as that rank, opens the
clique's next generation and resumes every rank from the snapshot as a resumed run resumes
from a checkpoint; the pass in flight is then redone from its start. The run thus ends where
an uninterrupted run ends: the redone pass draws the same batches with the same RNG states
from the same weights, and its tallies, metrics and progress start afresh.
"""

from __future__ import annotations

from .._errors import (
    CliqueError,
    CliqueTimeout,
    LampdistError,
    LampdistTimeout,
    PeerDisconnected,
    RankFailed,
)

__all__ = ["HOLD_MARGIN", "is_consequence", "is_lost"]

HOLD_MARGIN = 30.0
"""Seconds a survivor holds beyond the root's own deadlines (the rejoin timeout, the clique
setup) before it gives up on the root's REJOIN."""


def is_lost(error: LampdistError) -> bool:
    """Whether ``error`` (a follower's, as the control channel reports it) is the loss of its
    process or connection, which a new process can make good: its channel closed or broke,
    its heartbeats stopped, it acknowledged no command, or it left on a signal (it reports
    the stop it abandoned in phase ``'stop'``). Any other failure the follower reported
    (:class:`~lampdist.RankFailed`: its own error) would come back with a new process."""
    if error.rank is None or error.rank < 1:
        return False
    if isinstance(error, PeerDisconnected):
        return True
    if isinstance(error, RankFailed):
        return error.phase == "stop"
    return isinstance(error, LampdistTimeout) and error.phase == "broadcast"


def is_consequence(error: BaseException) -> bool:
    """Whether ``error``, raised on the root, can be the consequence of a lost follower: the
    control channel's word of it, or a collective that failed or timed out."""
    if isinstance(error, CliqueError | CliqueTimeout):
        return True
    return isinstance(error, LampdistError) and is_lost(error)
