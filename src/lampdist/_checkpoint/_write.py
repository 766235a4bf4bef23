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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

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
from ._shards import SHARDS, ShardedState, check_every_rank_wrote
from ._tensor_file import encode
from ._torch_io import check_weights_only_loadable, save_tensors

__all__ = [
    "PlannedFiles",
    "Where",
    "check_writable",
    "committed_checkpoints",
    "name_to_write",
    "new_shards_directory",
    "plan_files",
    "refuse_unwritable",
    "state_json",
    "superseded",
    "verify_shards",
    "write_checkpoint",
]

_log = logging.getLogger("lampdist.checkpoint")

Where = Literal["directory", "prefix"]
"""What holds the checkpoints: a local directory, or an object store's prefix."""

_THREADS = max(2, min(8, os.cpu_count() or 1))
"""Threads checksumming and writing blocks while the writer thread plans them."""
_WINDOW = 2 * _THREADS
"""Blocks in flight at once."""


def committed_checkpoints(directory: Path) -> list[tuple[CheckpointName, Path]]:
    """The committed checkpoints in ``directory``, newest first (scratch entries ignored); a
    symlink to a checkpoint directory counts as one (pruning it removes the link alone)."""
    found = []
    for entry in os.scandir(directory):
        name = CheckpointName.parse(entry.name)
        if name is not None and entry.is_dir():
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
    state = state_json(training_state, lr_state, rng)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        shards: ShardedState | None = training_state.shards
        with writer_lock(directory):
            scratch = None if shards is None else Path(shards.path).parent
            _remove_scratch(directory, keep=scratch)
            name = _next_name(directory, epoch)
            if shards is None:
                temp = directory / f"{TEMP_PREFIX}{name.name}-{secrets.token_hex(4)}"
                temp.mkdir()
            else:  # the ranks wrote their shards into it
                assert scratch is not None
                temp = scratch
            committed = False
            try:
                if shards is not None:
                    verify_shards(temp, shards)
                records = _write_files(temp, plan_files(training_state, rng, state), check)
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


@attrs.frozen(kw_only=True, eq=False)
class PlannedFiles:
    """Every file of one checkpoint but the manifest, as both writers write them."""

    tensor_files: list[PlannedFile]
    """state.json, then a tensor file per state dict: what goes where in each."""
    fallbacks: list[tuple[str, Any]]
    """``(file name, value)`` of each state dict a tensor file cannot hold: written with
    :func:`save_tensors` (torch.save) instead."""
    shard_records: tuple[FileRecord, ...]
    """The records of the ranks' shards, already written (a sharded checkpoint's)."""


def plan_files(training_state: TrainingState, rng: RngStates, state: bytes) -> PlannedFiles:
    """The files of a checkpoint of ``training_state``, its ``rng`` and its ``state.json``.

    State dicts go into tensor files; one holding a value a tensor file cannot represent
    becomes a fallback (after checking that ``torch.load(weights_only=True)`` can load it:
    raises CheckpointError otherwise).
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
    plans = [PlannedFile(name=STATE, size=len(state), parts=((0, state),))]
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
    shards = training_state.shards
    return PlannedFiles(
        tensor_files=plans,
        fallbacks=fallbacks,
        shard_records=() if shards is None else tuple(shards.records),
    )


def _write_files(temp: Path, files: PlannedFiles, check: Callable[[], None]) -> list[FileRecord]:
    """Write every file but the manifest, then the manifest; the records of all of them.

    Tensor files are written block by block on a pool; fallbacks with torch.save.
    """
    with ThreadPoolExecutor(_THREADS, thread_name_prefix="lampdist-checkpoint") as pool:
        records = write_planned(
            temp,
            files.tensor_files,
            check=check,
            pool=pool,
            window=_WINDOW,
            algorithm=WRITE_CHECKSUM,
        )
        for filename, value in files.fallbacks:
            save = functools.partial(save_tensors, value)
            records.append(
                write_file(temp / filename, save, check=check, pool=pool, algorithm=WRITE_CHECKSUM)
            )
        records.extend(files.shard_records)
        manifest = manifest_to_bytes(records)
        manifest_plan = PlannedFile(name=MANIFEST, size=len(manifest), parts=((0, manifest),))
        write_planned(
            temp, [manifest_plan], check=check, pool=pool, window=1, algorithm=WRITE_CHECKSUM
        )
    return records


def state_json(training_state: TrainingState, lr_state: Any, rng: RngStates) -> bytes:
    """The bytes of ``state.json``; raises CheckpointError for a schedule state that is not
    plain JSON."""
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
    check_every_rank_wrote(shards)
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
    existing = [name for name, _ in committed_checkpoints(directory)]
    refuse_unwritable(existing, str(directory), next_epoch, resumed=resumed, kind="directory")


def refuse_unwritable(
    existing: Sequence[CheckpointName],
    where: str,
    next_epoch: int,
    *,
    resumed: bool,
    kind: Where,
) -> None:
    """The rules of :func:`check_writable`, given the committed checkpoints at ``where`` (a
    checkpoint directory, or an object store's prefix); raises CheckpointError."""
    if not existing:
        return
    newest = max(existing).epoch
    if not resumed:
        raise CheckpointError(
            f"{where} already holds checkpoints (the newest of epoch {newest}) and this is "
            f"a new run: pass resume=load_latest({'directory' if kind == 'directory' else 'url'}) "
            f"to continue that run, or give this run its own checkpoint {kind}",
            rank=0,
            phase="configure",
        )
    if newest > next_epoch + 1:
        raise CheckpointError(
            f"{where} already holds a checkpoint of epoch {newest}, newer than the run "
            f"resumed at epoch {next_epoch} would write: resume from the newest checkpoint "
            f"there, give this run its own checkpoint {kind}, or remove the newer checkpoints",
            rank=0,
            phase="configure",
        )


def _next_name(directory: Path, epoch: int) -> CheckpointName:
    existing = [name for name, _ in committed_checkpoints(directory)]
    return name_to_write(existing, epoch, str(directory), kind="directory")


def name_to_write(
    existing: Sequence[CheckpointName], epoch: int, where: str, *, kind: Where
) -> CheckpointName:
    """The name of the checkpoint of ``epoch`` beside the committed ``existing`` ones (the
    next generation when that epoch is there already).

    Raises CheckpointError when a newer epoch is there: the write would be shadowed by it.
    """
    if not existing:
        return CheckpointName(epoch=epoch)
    newest = max(existing)
    if newest.epoch > epoch:
        raise CheckpointError(
            f"{where} already holds a checkpoint of epoch {newest.epoch}, newer than the "
            f"epoch {epoch} being written: resume with load_latest, give each run its own "
            f"checkpoint {kind}, or remove the newer checkpoints",
            phase="checkpoint",
        )
    if newest.epoch == epoch:
        return attrs.evolve(newest, generation=newest.generation + 1)
    return CheckpointName(epoch=epoch)


def superseded(
    existing: Sequence[CheckpointName], written: CheckpointName, *, keep: int
) -> list[CheckpointName]:
    """The checkpoints to remove once ``written`` is committed: those of its epoch it
    supersedes, and all but the newest ``keep``."""
    kept = 0
    doomed = []
    for name in sorted(existing, reverse=True):
        if name != written and name.epoch == written.epoch:
            doomed.append(name)
        elif kept < keep:
            kept += 1
        else:
            doomed.append(name)
    return doomed


def _prune(directory: Path, written: CheckpointName, *, keep: int) -> None:
    """Remove checkpoints superseded by ``written`` (same epoch) and all but the newest keep."""
    existing = dict(committed_checkpoints(directory))
    doomed = [existing[name] for name in superseded(list(existing), written, keep=keep)]
    if not doomed:
        return
    removing = []
    for path in doomed:
        scratch = directory / f"{TEMP_PREFIX}delete-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, scratch)
        removing.append(scratch)
    fsync_directory(directory)
    for scratch in removing:
        if scratch.is_symlink():  # a linked checkpoint: its target is not ours to remove
            scratch.unlink()
        else:
            shutil.rmtree(scratch, ignore_errors=True)
