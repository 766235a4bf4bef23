"""Reading the newest intact checkpoint; damaged ones are skipped with a warning."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import attrs
import torch

from .._errors import CheckpointError
from .._state import TrainingState
from ._files import hash_file
from ._format import (
    BEST_MODEL,
    MANIFEST,
    MODEL,
    OPTIMIZER,
    RANKS,
    RNG,
    STATE,
    TENSORS,
    TORCH,
    Damaged,
    FileRecord,
    Manifest,
    loop_state_from_json,
    parse_manifest,
)
from ._rng import RngStates
from ._shards import SHARDS, ShardedState
from ._tensor_read import read_tensor_file
from ._write import committed_checkpoints

__all__ = ["Loaded", "read_latest"]

_log = logging.getLogger("lampdist.checkpoint")

_RESCANS = 5
"""How often to list the directory again when a writer removes a checkpoint while we read."""


@attrs.frozen(kw_only=True, eq=False)
class Loaded:
    """One checkpoint as read from disk."""

    path: Path
    training_state: TrainingState
    lr_state_json: dict[str, Any]
    rng: RngStates


class _Vanished(Exception):
    """The checkpoint was removed (by a concurrent writer's pruning) while being read."""


def read_latest(directory: Path, *, map_location: Any) -> Loaded | None:
    """The newest intact checkpoint in ``directory``, or None when it holds none.

    Raises CheckpointVersionError for a newer format and CheckpointError when there are
    checkpoints but none of them is intact.
    """
    for _ in range(_RESCANS):
        try:
            found = committed_checkpoints(directory)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointError(
                f"cannot list checkpoints in {directory} ({exc})", phase="resume"
            ) from exc
        if not found:
            return None
        damaged = []
        try:
            for _name, path in found:
                try:
                    return _read_one(path, map_location=map_location)
                except Damaged as exc:
                    _log.warning("skipping damaged checkpoint %s: %s", path, exc)
                    damaged.append(f"{path.name} ({exc})")
        except _Vanished:
            continue
        raise CheckpointError(
            f"every checkpoint in {directory} is damaged: {'; '.join(damaged)}; "
            "remove them to start afresh",
            phase="resume",
        )
    raise CheckpointError(
        f"checkpoints in {directory} kept disappearing while being read: is another process "
        "pruning them?",
        phase="resume",
    )


def _read_one(path: Path, *, map_location: Any) -> Loaded:
    try:
        return _read_files(path, map_location=map_location)
    except FileNotFoundError as exc:
        if not path.exists():
            raise _Vanished from exc
        raise Damaged(f"missing file ({exc.filename})") from exc
    except OSError as exc:
        raise Damaged(f"unreadable ({exc})") from exc


def _read_files(path: Path, *, map_location: Any) -> Loaded:
    manifest = parse_manifest((path / MANIFEST).read_bytes(), where=str(path))
    records = {record.name: record for record in manifest.files}
    if STATE not in records:
        raise Damaged("the manifest lists no state.json")
    stems = {}
    for stem in (RNG, MODEL, OPTIMIZER, BEST_MODEL, RANKS):
        record = _file_of(manifest, stem)
        if record is not None:
            stems[stem] = record
        elif stem not in (BEST_MODEL, RANKS):
            raise Damaged(f"the manifest lists {sorted(records)}, not every required file")
    for record in manifest.files:  # tensor files are checked while they are read
        if not record.name.endswith(TENSORS):
            _check(path, record, manifest.checksum)
    try:
        state = json.loads((path / STATE).read_bytes())
        if state["format_version"] != manifest.version:
            raise Damaged(f"state.json has format version {state['format_version']}")
        loop_state = loop_state_from_json(state["loop_state"])
        has_best = bool(state["has_best_model"])
        has_ranks = bool(state.get("has_rank_states", False))  # absent before they existed
        rng_json = state["rng"]
        lr_state_json = state["lr_state"]
        sharded = state.get("sharded")
        shards = (
            None
            if sharded is None
            else ShardedState(
                path=path / SHARDS,
                nranks=int(sharded["nranks"]),
                precision=dict(sharded["precision"]),
            )
        )
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise Damaged(f"malformed state.json ({exc!r})") from exc
    if has_best != (BEST_MODEL in stems):
        raise Damaged("state.json and the manifest disagree about the best model")
    if has_ranks != (RANKS in stems):
        raise Damaged("state.json and the manifest disagree about the ranks' states")

    def load(stem: str, location: Any) -> Any:
        record = stems[stem]
        if record.name.endswith(TENSORS):
            return read_tensor_file(path / record.name, record, manifest.checksum, location)
        return _load(path / record.name, location)

    rng_tensors = load(RNG, "cpu")
    training_state = TrainingState(
        loop_state=loop_state,
        model_state=load(MODEL, map_location),
        optimizer_state=load(OPTIMIZER, map_location),
        best_model_state=load(BEST_MODEL, map_location) if has_best else None,
        rank_states=tuple(load(RANKS, "cpu")) if has_ranks else None,
        shards=shards,
    )
    try:
        rng = RngStates.from_stored(rng_tensors, rng_json)
    except (ValueError, TypeError, KeyError) as exc:
        raise Damaged(f"malformed RNG states ({exc!r})") from exc
    return Loaded(path=path, training_state=training_state, lr_state_json=lr_state_json, rng=rng)


def _file_of(manifest: Manifest, stem: str) -> FileRecord | None:
    """The record of ``stem``'s file (format 1: ``.pt``; format 2: either kind, not both)."""
    suffixes = (TORCH,) if manifest.version == 1 else (TENSORS, TORCH)
    found = [r for r in manifest.files if r.name in {stem + suffix for suffix in suffixes}]
    if len(found) > 1:
        raise Damaged(f"the manifest lists {stem} twice")
    return found[0] if found else None


def _check(path: Path, record: FileRecord, checksum: str) -> None:
    size, digests = hash_file(path / record.name, checksum)
    if size != record.size:
        raise Damaged(f"{record.name} has {size} bytes, the manifest says {record.size}")
    if digests != record.digests:
        raise Damaged(f"{record.name} does not match its {checksum} checksums")


def _load(path: Path, map_location: Any) -> Any:
    # The checksum matched: the file is what the writer wrote, so a failure here is no
    # damage to skip past but a real problem (a bad map_location, an unknown type).
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"cannot load {path} ({exc}); check map_location", phase="resume"
        ) from exc
