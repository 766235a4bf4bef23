"""The whole exception tree of lampdist.

Every error lampdist raises on purpose derives from :class:`LampdistError`. Where a user
already catches a standard exception, the lampdist error derives from it too::

    LampdistError
    ├── ConfigError (ValueError)            bad arguments; the message says what to pass instead
    │   └── MismatchError                   ranks disagree (model, settings, nranks)
    ├── LampdistTimeout (TimeoutError)      a deadline on a peer passed
    │   ├── JoinTimeout                     a follower could not join, or peers did not come
    │   └── CliqueTimeout                   clique setup or a collective ran past its deadline
    ├── ControlError                        the control channel failed
    │   ├── ProtocolError                   a malformed, oversized or wrong-version frame
    │   ├── AuthenticationError             a peer failed the shared-secret challenge
    │   ├── JoinRejected                    the root refused a joiner (duplicate rank, too many)
    │   └── PeerDisconnected                a peer vanished (closed, heartbeat lost)
    │       └── PeerUnresponsive            its connection is open but it is silent (stalled)
    ├── CliqueError                         the collective-communication group failed
    │   └── CollectiveFailed                a collective raised (a peer died or aborted)
    ├── RankFailed                          another rank failed; names that rank and its phase
    ├── Interrupted                         SIGTERM or SIGINT stopped the run gracefully
    ├── TrainingError                       the training pass itself failed
    │   ├── NonFiniteLoss (ArithmeticError) a loss was NaN or infinite
    │   └── BadBatch (TypeError)            a batch source yielded something that is no batch
    └── CheckpointError                     a checkpoint could not be written or read
        └── CheckpointVersionError          written by a newer lampdist; upgrade to read it

Every error carries the ``rank`` and ``phase`` it happened in, when known, and shows them
at the start of its message (``rank 1, phase 'train': ...``). The phases are the values of
:data:`Phase`, one spelling each (docs/reliability.md says where each one is).

Cancellation is never turned into a lampdist error. Calls that run several tasks (the
training entry points, the channels' context managers) may raise an ``ExceptionGroup``
whose leaves are these errors; each entry point's docstring says so.
"""

from __future__ import annotations

from typing import Literal, TypeAlias

__all__ = [
    "AuthenticationError",
    "BadBatch",
    "CheckpointError",
    "CheckpointVersionError",
    "CliqueError",
    "CliqueTimeout",
    "Collective",
    "CollectiveFailed",
    "ConfigError",
    "ControlError",
    "Interrupted",
    "JoinRejected",
    "JoinTimeout",
    "LampdistError",
    "LampdistTimeout",
    "MismatchError",
    "NonFiniteLoss",
    "PeerDisconnected",
    "PeerUnresponsive",
    "Phase",
    "ProtocolError",
    "RankFailed",
    "TrainingError",
]


Collective: TypeAlias = Literal[
    "broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather", "barrier"
]
"""A clique's collectives: each is the phase of its own errors."""

Phase: TypeAlias = Literal[
    Collective,
    # arguments, before anything runs
    "configure",
    "launch",
    "demo",
    "track",
    # the control channel
    "open",
    "join",
    "handshake",
    "publish",
    # the clique
    "clique rendezvous",
    "clique setup",
    "clique teardown",
    # a rank's run and its checkpoints
    "agreement",
    "wait for command",
    "train",
    "valid",
    "checkpoint",
    "resume",
    "stop",
    "recover",
    # the epoch driver
    "loop",
    "schedule",
]
"""Where an error happened: what its rank was doing (see docs/reliability.md)."""


class LampdistError(Exception):
    """The root of every error lampdist raises on purpose.

    ``rank`` and ``phase`` say where it happened, when known; ``str(error)`` starts with them.
    """

    def __init__(
        self, message: str, *, rank: int | None = None, phase: Phase | None = None
    ) -> None:
        self.message = message
        self.rank = rank
        self.phase = phase
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.phase is not None:
            where.append(f"phase {self.phase!r}")
        return f"{', '.join(where)}: {self.message}" if where else self.message

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.message, self.rank, self.phase))


def name_rank(error: BaseException, rank: int) -> None:
    """Name ``rank`` in ``error`` (and the errors of an exception group) wherever no rank is
    named yet: an error raised below a rank's own code (a checkpoint's storage, say) leaves
    the rank through the rank's entry point, which knows it."""
    if isinstance(error, BaseExceptionGroup):
        for each in error.exceptions:
            name_rank(each, rank)
    elif isinstance(error, LampdistError) and error.rank is None:
        error.rank = rank
        error.args = (error._render(),)


def _rebuild(
    cls: type[LampdistError], message: str, rank: int | None, phase: Phase | None
) -> LampdistError:
    return cls(message, rank=rank, phase=phase)


class ConfigError(LampdistError, ValueError):
    """An argument is invalid; the message says what to pass instead."""


class MismatchError(ConfigError):
    """The ranks disagree: model parameters, settings or the number of ranks."""


class LampdistTimeout(LampdistError, TimeoutError):
    """A deadline on a peer passed."""


class JoinTimeout(LampdistTimeout):
    """A follower could not join in time, or the expected peers did not come."""


class CliqueTimeout(LampdistTimeout):
    """Clique setup or a collective ran past its deadline."""


class ControlError(LampdistError):
    """The control channel failed."""


class ProtocolError(ControlError):
    """A frame was malformed, oversized or of an unsupported version."""


class AuthenticationError(ControlError):
    """A peer failed the shared-secret challenge; retrying with the same secret cannot help."""


class JoinRejected(ControlError):
    """The root refused a joiner: duplicate rank, more joiners than ranks, or a closed root."""


class PeerDisconnected(ControlError):
    """A peer vanished: its connection closed or its heartbeats stopped."""


class PeerUnresponsive(PeerDisconnected):
    """A peer whose connection is still open fell silent: no heartbeat within the control
    channel's ``heartbeat_timeout``, or it stopped reading. Its process may be stopped, hung
    or on a machine that went away without closing its connections; the other ranks leave
    their collectives with it at once (see docs/reliability.md)."""


class CliqueError(LampdistError):
    """The collective-communication group failed."""


class CollectiveFailed(CliqueError):
    """A collective raised, usually because a peer died or the group was torn down."""


class RankFailed(LampdistError):
    """Another rank failed; ``rank`` and ``phase`` name that rank and what it was doing."""


class Interrupted(LampdistError):
    """A run stopped gracefully because the process received SIGTERM or SIGINT.

    Raised by :func:`lampdist.train` (and by the demo) after the training was cancelled and
    every resource released: the clique is closed, the followers were told, and the
    checkpoints committed before the signal are intact. ``signum`` is the signal's number;
    exit with ``128 + signum``, as a shell does, or resume from the last checkpoint.
    """

    def __init__(
        self, message: str, *, signum: int, rank: int | None = None, phase: Phase | None = None
    ) -> None:
        self.signum = signum
        super().__init__(message, rank=rank, phase=phase)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_interrupted, (self.message, self.signum, self.rank, self.phase))


def _rebuild_interrupted(
    message: str, signum: int, rank: int | None, phase: Phase | None
) -> Interrupted:
    return Interrupted(message, signum=signum, rank=rank, phase=phase)


class TrainingError(LampdistError):
    """A training or validation pass failed."""


class NonFiniteLoss(TrainingError, ArithmeticError):
    """A loss was NaN or infinite (see the ``non_finite_loss`` option)."""


class BadBatch(TrainingError, TypeError):
    """A batch source yielded something that is not an ``(inputs, target)`` batch of tensors."""


class CheckpointError(LampdistError):
    """A checkpoint could not be written or read."""


class CheckpointVersionError(CheckpointError):
    """The checkpoint was written by a newer format version; upgrade lampdist to read it."""
