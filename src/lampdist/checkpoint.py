"""Atomic, complete, resumable checkpoints.

:func:`to_directory` builds the ``checkpoint_state`` effect the training entry points await
after every epoch; :func:`load_latest` reads the newest intact checkpoint back into the
``init_state`` and ``learning_rate_schedule_init_state`` they resume from::

    resumed = checkpoint.load_latest("runs/a", restore_rng=True)
    init_state, lr_state = resumed if resumed is not None else (None, None)
    await lampdist.drive_distributed_training(
        ...,
        init_state=init_state,
        learning_rate_schedule_init_state=lr_state,
        checkpoint_state=checkpoint.to_directory("runs/a", keep=3),
    )

A crash or cancellation at any moment leaves the checkpoints committed before it intact and
loadable. Loading never runs code from the files: tensors are raw bytes described by a JSON
header (or, for values that format cannot hold, ``torch.load(weights_only=True)``), and
everything else is JSON.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import attrs

from ._checkpoint import (
    FORMAT_VERSION,
    NO_SCHEDULE,
    capture_rng_states,
    read_latest,
    rebuild_schedule_state,
    restore_rng_states,
    schedule_state_from_json,
    write_checkpoint,
)
from ._effects import CheckpointState
from ._errors import ConfigError
from ._state import TrainingState
from .schedules import LearningRateSchedule

__all__ = ["FORMAT_VERSION", "load_latest", "to_directory"]


def to_directory(
    path: str | os.PathLike[str],
    *,
    keep: int = 3,
    schedule: LearningRateSchedule[Any] | None = None,
) -> CheckpointState:
    """A ``checkpoint_state`` effect that writes one atomic checkpoint into ``path`` per call.

    Each call writes the loop state (learning curve included), the schedule state, the
    model, optimizer and best-model state dicts, the global RNG states (torch CPU and CUDA,
    python ``random``, numpy) and the format version into a new ``epoch-000012`` directory,
    on a worker thread, whose pool of threads checksums and writes the tensors' bytes block
    by block straight from their memory. The directory appears complete or not at all:
    files go into a scratch directory; every file, that directory and (after the rename
    into place) the parent are fsynced. Afterwards only the newest
    ``keep`` checkpoints are kept. The state dicts must not change until the call returns
    (the training loop awaits it before the next epoch). Cancelling the call before the
    commit removes the partial write.

    Give each run its own directory: the effect owns it, and refuses (CheckpointError) to
    write an epoch older than the newest checkpoint there, which would otherwise shadow it.
    With ``schedule`` given, each call also checks that ``load_latest(schedule=...)`` can
    rebuild the schedule state.

    Raises ConfigError for ``keep < 1`` and, when awaited, CheckpointError when the state
    cannot be checkpointed (a value that neither the tensor file nor
    ``torch.load(weights_only=True)`` could load back, a
    schedule state not made of numbers) or the disk write fails.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep must be an int >= 1, not {keep!r}", phase="checkpoint")
    schedule_init = NO_SCHEDULE if schedule is None else schedule.init
    return _DirectoryCheckpoint(directory=Path(path), keep=keep, schedule_init=schedule_init)


@attrs.frozen(kw_only=True)
class _DirectoryCheckpoint:
    """The effect :func:`to_directory` returns."""

    directory: Path
    keep: int
    schedule_init: Any = attrs.field(repr=False)

    async def __call__(self, training_state: TrainingState, lr_state: Any, /) -> None:
        rng = capture_rng_states()  # on the caller's thread, at the moment of the call
        write = functools.partial(
            write_checkpoint,
            self.directory,
            training_state,
            lr_state,
            rng,
            keep=self.keep,
            schedule_init=self.schedule_init,
            check=anyio.from_thread.check_cancelled,
        )
        await anyio.to_thread.run_sync(write)


def load_latest(
    path: str | os.PathLike[str],
    *,
    map_location: Any = None,
    schedule: LearningRateSchedule[Any] | None = None,
    restore_rng: bool = False,
) -> tuple[TrainingState, Any] | None:
    """The newest intact checkpoint in ``path`` as ``(training_state, lr_state)``, or None.

    The result plugs into the training entry points' ``init_state`` and
    ``learning_rate_schedule_init_state``. ``None`` means there is no checkpoint yet (the
    directory is missing, empty, or holds only scratch of an interrupted first write).
    ``map_location`` places tensors as ``torch.load``'s does (a device, a string, a dict
    of locations, or a function of a storage and its location). ``lr_state`` is the stored
    schedule state as plain JSON values (a dict for an attrs state); pass ``schedule`` to get
    an instance of the type of ``schedule.init`` back instead. With ``restore_rng=True`` the
    global RNG states saved with the checkpoint are restored as well (on the root, just
    before training resumes), so a resumed run draws the same random numbers as an
    uninterrupted one.

    A damaged newest checkpoint (truncated, a flipped byte, a missing file, a malformed
    tensor file: every file is checked against the block checksums in its manifest) is
    skipped with a WARNING log and the one before it is used. Checkpoints of the previous
    format (lampdist's format 1) load as well. This call blocks; from async code run it in a
    worker thread (``await anyio.to_thread.run_sync(functools.partial(load_latest, path,
    ...))``).

    Raises CheckpointVersionError when a checkpoint was written in a newer format (upgrade
    lampdist), CheckpointError when there are checkpoints but none is intact, when a file
    cannot be loaded (e.g. a bad ``map_location``, a tensor file of the other byte order) or
    the schedule state does not fit
    ``schedule``.
    """
    loaded = read_latest(Path(path), map_location=map_location)
    if loaded is None:
        return None
    if schedule is None:
        lr_state = schedule_state_from_json(loaded.lr_state_json)
    else:
        lr_state = rebuild_schedule_state(schedule.init, loaded.lr_state_json)
    if restore_rng:
        restore_rng_states(loaded.rng)
    return loaded.training_state, lr_state
