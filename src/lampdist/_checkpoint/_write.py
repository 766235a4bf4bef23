"""Writing one checkpoint atomically, then pruning old ones (runs on a worker thread).

The commit protocol: write every file into a fresh ``.tmp-*`` directory beside the target,
fsync each file, write the manifest last, fsync the directory, rename it into place, fsync
the parent. Only then are superseded and surplus checkpoints removed (each renamed to a
``.tmp-*`` name first, so a crash mid-removal leaves scratch, never a half checkpoint).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from .._errors import CheckpointError, ConfigError
from .._state import TrainingState
from ..schedules import state_to_json
from ._block_writer import PlannedFile, Source, write_planned
from ._files import fsync_directory, hash_file, write_file, writer_lock
from ._format import (
    BEST_MODEL,
    FORMAT_VERSION,
    MANIFEST,
    MODEL,
    OPTIMIZER,
    RANKS,
    RNG,
    STATE,
    TEMP_PREFIX,
    TENSORS,
    TORCH,
    WRITE_CHECKSUM,
    CheckpointName,
    FileRecord,
    dump_json,
    loop_state_to_json,
    manifest_to_bytes,
)
from ._rng import RngStates
from ._shards import SHARDS, ShardedState
from ._tensor_file import encode
from ._torch_io import check_weights_only_loadable, save_tensors

__all__ = [
    "check_writable",
    "committed_checkpoints",
    "new_shards_directory",
    "verify_shards",
    "write_checkpoint",
]

_log = logging.getLogger("lampdist.checkpoint")

_THREADS = max(2, min(8, os.cpu_count() or 1))
"""Threads checksumming and writing blocks while the writer thread plans them."""
_WINDOW = 2 * _THREADS
"""Blocks in flight at once."""


def committed_checkpoints(directory: Path) -> list[tuple[CheckpointName, Path]]:
    """The committed checkpoints in ``directory``, newest first (scratch entries ignored)."""
    found = []
    for entry in os.scandir(directory):
        name = CheckpointName.parse(entry.name)
        if name is not None and entry.is_dir(follow_symlinks=False):
            found.append((name, Path(entry.path)))
    found.sort(reverse=True)
    return found


def _plain_state_dict(value: Mapping[str, Any]) -> Any:
    return value if type(value) in (dict, OrderedDict) else dict(value)


def write_checkpoint(
    directory: Path,
    training_state: TrainingState,
    lr_state: Any,
    rng: RngStates,
    *,
    keep: int,
    check: Callable[[], None],
) -> Path:
    """Commit one checkpoint of ``training_state`` into ``directory``; its path.

    ``check`` is called between steps until the commit and raises to abort (cancellation);
    an abort or error leaves no committed checkpoint behind. Raises CheckpointError.
    """
    started = time.perf_counter()
    epoch = training_state.loop_state.epoch
    if epoch < 0:
        raise CheckpointError(f"cannot checkpoint a negative epoch {epoch}", phase="checkpoint")
    state_json = _state_json(training_state, lr_state, rng)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        shards: ShardedState | None = training_state.shards
        with writer_lock(directory):
            _remove_scratch(directory, keep=None if shards is None else shards.path.parent)
            name = _next_name(directory, epoch)
            if shards is None:
                temp = directory / f"{TEMP_PREFIX}{name.name}-{secrets.token_hex(4)}"
                temp.mkdir()
            else:  # the ranks wrote their shards into it
                temp = shards.path.parent
            committed = False
            try:
                if shards is not None:
                    verify_shards(temp, shards)
                records = _write_files(temp, state_json, training_state, rng, check)
                fsync_directory(temp)
                check()  # the last point at which a cancellation aborts the write
                target = directory / name.name
                os.rename(temp, target)
                committed = True
            finally:
                if not committed:
                    shutil.rmtree(temp, ignore_errors=True)
            fsync_directory(directory)
            try:
                _prune(directory, name, keep=keep)
            except OSError as exc:
                _log.warning("could not remove old checkpoints from %s: %s", directory, exc)
    except OSError as exc:
        raise CheckpointError(
            f"could not write checkpoint of epoch {epoch} into {directory} ({exc}); "
            "the checkpoints written before are intact",
            phase="checkpoint",
        ) from exc
    size = sum(record.size for record in records)
    _log.info(
        "checkpoint %s written (%.1f MB in %.2f s)",
        target,
        size / 1e6,
        time.perf_counter() - started,
        extra={"epoch": epoch},
    )
    return target


def _write_files(
    temp: Path,
    state_json: bytes,
    training_state: TrainingState,
    rng: RngStates,
    check: Callable[[], None],
) -> list[FileRecord]:
    """Write every file but the manifest, then the manifest; the records of all of them.

    State dicts go into tensor files, written block by block on a pool; one holding a value
    a tensor file cannot represent is written with torch.save instead (after checking that
    ``torch.load(weights_only=True)`` can load it).
    """
    parts: list[tuple[str, str, Any]] = [
        (RNG, "rng_state", rng.tensors()),
        (MODEL, "model_state", _plain_state_dict(training_state.model_state)),
        (OPTIMIZER, "optimizer_state", _plain_state_dict(training_state.optimizer_state)),
    ]
    if training_state.best_model_state is not None:
        best = _plain_state_dict(training_state.best_model_state)
        parts.append((BEST_MODEL, "best_model_state", best))
    if training_state.rank_states is not None:
        ranks = [dict(state) for state in training_state.rank_states]
        parts.append((RANKS, "rank_states", ranks))
    plans = [PlannedFile(name=STATE, size=len(state_json), parts=((0, state_json),))]
    fallbacks = []
    for stem, label, value in parts:
        encoded = encode(value)
        if encoded is None:
            check_weights_only_loadable(value, label)
            fallbacks.append((stem + TORCH, value))
            continue
        pieces: tuple[tuple[int, Source], ...] = (
            (0, encoded.head),
            *zip(encoded.offsets, encoded.tensors, strict=True),
        )
        plans.append(PlannedFile(name=stem + TENSORS, size=encoded.size, parts=pieces))
    with ThreadPoolExecutor(_THREADS, thread_name_prefix="lampdist-checkpoint") as pool:
        records = write_planned(
            temp, plans, check=check, pool=pool, window=_WINDOW, algorithm=WRITE_CHECKSUM
        )
        for filename, value in fallbacks:
            save = functools.partial(save_tensors, value)
            records.append(
                write_file(temp / filename, save, check=check, pool=pool, algorithm=WRITE_CHECKSUM)
            )
        if training_state.shards is not None:
            records.extend(training_state.shards.records)
        manifest = manifest_to_bytes(records)
        manifest_plan = PlannedFile(name=MANIFEST, size=len(manifest), parts=((0, manifest),))
        write_planned(
            temp, [manifest_plan], check=check, pool=pool, window=1, algorithm=WRITE_CHECKSUM
        )
    return records


def _state_json(training_state: TrainingState, lr_state: Any, rng: RngStates) -> bytes:
    try:
        schedule_json = state_to_json(lr_state)
    except ConfigError as exc:
        raise CheckpointError(
            f"cannot checkpoint the learning-rate schedule state: {exc.message}",
            phase="checkpoint",
        ) from exc
    return dump_json(
        {
            "format_version": FORMAT_VERSION,
            "loop_state": loop_state_to_json(training_state.loop_state),
            "lr_state": {"type": _type_name(type(lr_state)), "value": schedule_json},
            "has_best_model": training_state.best_model_state is not None,
            "has_rank_states": training_state.rank_states is not None,
            "rng": rng.to_json(),
            **_sharded_json(training_state.shards),
        }
    )


def _sharded_json(shards: ShardedState | None) -> dict[str, Any]:
    """What state.json says of a sharded checkpoint (nothing for whole state dicts)."""
    if shards is None:
        return {}
    return {"sharded": {"nranks": shards.nranks, "precision": dict(shards.precision)}}


def new_shards_directory(
    directory: Path, nranks: int, precision: Mapping[str, Any]
) -> ShardedState:
    """A scratch directory in ``directory`` for the ranks' shards of the next checkpoint,
    which :func:`write_checkpoint` commits (or the next write removes)."""
    directory.mkdir(parents=True, exist_ok=True)
    scratch = directory / f"{TEMP_PREFIX}shards-{secrets.token_hex(4)}"
    scratch.mkdir()
    return ShardedState(path=scratch / SHARDS, nranks=nranks, precision=precision)


def verify_shards(temp: Path, shards: ShardedState) -> None:
    """Raise :class:`CheckpointError` unless every rank's files are there, as its records say
    (every rank wrote its part before the checkpoint is committed)."""
    files = {record.name for record in shards.records}
    if f"{SHARDS}/.metadata" not in files:
        raise CheckpointError("the shards' metadata is missing", phase="checkpoint")
    for rank in range(shards.nranks):
        if not any(name.startswith(f"{SHARDS}/__{rank}_") for name in files):
            raise CheckpointError(f"rank {rank} wrote no shard", phase="checkpoint")
    for record in shards.records:
        size, digests = hash_file(temp / record.name, WRITE_CHECKSUM)
        if size != record.size or digests != record.digests:
            raise CheckpointError(
                f"{record.name} does not match what its rank wrote", phase="checkpoint"
            )


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _remove_scratch(directory: Path, *, keep: Path | None = None) -> None:
    """Remove what crashed writers left behind (we hold the lock: nobody is writing), except
    ``keep`` (the scratch directory the ranks' shards of this checkpoint are in)."""
    for entry in os.scandir(directory):
        if entry.name.startswith(TEMP_PREFIX) and (keep is None or entry.name != keep.name):
            _log.info("removing leftover %s from an interrupted checkpoint", entry.path)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)


def check_writable(directory: Path, next_epoch: int, *, resumed: bool) -> None:
    """Refuse, before training, a run whose checkpoints ``directory`` cannot take.

    A new run (``resumed=False``) needs a directory without committed checkpoints; a resumed
    run at ``next_epoch`` one whose newest checkpoint is not newer than the first one it
    writes (of epoch ``next_epoch + 1``: the write :func:`write_checkpoint` would refuse).
    """
    if not directory.is_dir():
        return
    existing = committed_checkpoints(directory)
    if not existing:
        return
    newest = existing[0][0].epoch
    if not resumed:
        raise CheckpointError(
            f"{directory} already holds checkpoints (the newest of epoch {newest}) and this is "
            "a new run: pass resume=load_latest(directory) to continue that run, or give this "
            "run its own checkpoint directory",
            rank=0,
            phase="configure",
        )
    if newest > next_epoch + 1:
        raise CheckpointError(
            f"{directory} already holds a checkpoint of epoch {newest}, newer than the run "
            f"resumed at epoch {next_epoch} would write: resume from the newest checkpoint "
            "there, give this run its own checkpoint directory, or remove the newer checkpoints",
            rank=0,
            phase="configure",
        )


def _next_name(directory: Path, epoch: int) -> CheckpointName:
    existing = committed_checkpoints(directory)
    if not existing:
        return CheckpointName(epoch=epoch)
    newest = existing[0][0]
    if newest.epoch > epoch:
        raise CheckpointError(
            f"{directory} already holds a checkpoint of epoch {newest.epoch}, newer than the "
            f"epoch {epoch} being written: resume with load_latest, give each run its own "
            "checkpoint directory, or remove the newer checkpoints",
            phase="checkpoint",
        )
    if newest.epoch == epoch:
        return attrs.evolve(newest, generation=newest.generation + 1)
    return CheckpointName(epoch=epoch)


def _prune(directory: Path, written: CheckpointName, *, keep: int) -> None:
    """Remove checkpoints superseded by ``written`` (same epoch) and all but the newest keep."""
    existing = committed_checkpoints(directory)
    kept = 0
    doomed = []
    for name, path in existing:
        if name != written and name.epoch == written.epoch:
            doomed.append(path)
        elif kept < keep:
            kept += 1
        else:
            doomed.append(path)
    if not doomed:
        return
    removing = []
    for path in doomed:
        scratch = directory / f"{TEMP_PREFIX}delete-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, scratch)
        removing.append(scratch)
    fsync_directory(directory)
    for scratch in removing:
        shutil.rmtree(scratch, ignore_errors=True)
