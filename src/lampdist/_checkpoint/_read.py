"""Reading the newest intact checkpoint; damaged ones are skipped with a warning.

What is read, checked and decoded is the same wherever a checkpoint is stored; only the way
to its files differs. :class:`CheckpointFiles` is that way: a local directory
(:class:`DirectoryFiles`) or an object store's prefix (``_object_store.StoreFiles``). Every
function here takes one and reads through it alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from .._errors import CheckpointError
from .._state import TrainingState
from ._files import block_hash
from ._format import (
    BEST_MODEL,
    BLOCK_BYTES,
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
from ._tensor_file import decode, parse_header, read_prefix
from ._tensor_read import CheckedReader, Stream, place
from ._write import committed_checkpoints

__all__ = [
    "CheckpointFiles",
    "DirectoryFiles",
    "Loaded",
    "Stream",
    "Vanished",
    "read_checkpoint",
    "read_latest",
    "read_manifest",
    "read_newest",
    "verify_checkpoint",
]

_log = logging.getLogger("lampdist.checkpoint")

_RESCANS = 5
"""How often to list the checkpoints again when a writer removes one while we read."""


@attrs.frozen(kw_only=True, eq=False)
class Loaded:
    """One checkpoint as read back."""

    path: Path | str
    """Its directory, or its URL in an object store."""
    training_state: TrainingState
    lr_state_json: dict[str, Any]
    rng: RngStates


class CheckpointFiles(Protocol):
    """The files of one committed checkpoint, wherever they are stored.

    ``read`` and ``open`` raise FileNotFoundError for a missing file, OSError for a file that
    cannot be read (damage), and CheckpointError for a failure of the store itself (a
    network error: no damage, so no reason to fall back to an older checkpoint).
    """

    @property
    def name(self) -> str:
        """``epoch-000012``."""

    @property
    def location(self) -> Path | str:
        """Its directory or URL: in messages, and as :attr:`Loaded.path`."""

    @property
    def directory(self) -> Path | None:
        """Its local directory (where a sharded checkpoint's shards are); None in a store."""

    def read(self, name: str) -> bytes:
        """The whole of file ``name``."""

    def open(self, name: str) -> AbstractContextManager[tuple[int, Stream]]:
        """File ``name``'s size and a stream of its bytes."""

    def committed(self) -> bool:
        """Whether the checkpoint is still there (a writer's pruning may remove it)."""


@attrs.frozen(kw_only=True)
class DirectoryFiles:
    """The files of a checkpoint directory."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def location(self) -> Path:
        return self.path

    @property
    def directory(self) -> Path:
        return self.path

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[tuple[int, Stream]]:
        with open(self.path / name, "rb", buffering=0) as file:
            yield os.fstat(file.fileno()).st_size, file

    def committed(self) -> bool:
        return self.path.exists()


class Vanished(Exception):
    """The checkpoint was removed (by a concurrent writer's pruning) while being read."""


def read_latest(directory: Path, *, map_location: Any) -> Loaded | None:
    """The newest intact checkpoint in ``directory``, or None when it holds none.

    Raises CheckpointVersionError for a newer format and CheckpointError when there are
    checkpoints but none of them is intact.
    """

    def listed() -> list[CheckpointFiles]:
        try:
            found = committed_checkpoints(directory)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(
                f"cannot list checkpoints in {directory} ({exc})", phase="resume"
            ) from exc
        return [DirectoryFiles(path=path) for _, path in found]

    return read_newest(str(directory), listed, map_location=map_location)


def read_newest(
    where: str,
    listed: Callable[[], Sequence[CheckpointFiles]],
    *,
    map_location: Any,
) -> Loaded | None:
    """The newest intact one of the committed checkpoints ``listed`` (newest first) returns,
    or None when it returns none; a damaged one is skipped with a WARNING log.

    Raises CheckpointVersionError for a newer format and CheckpointError when there are
    checkpoints but none of them is intact, or when they keep disappearing.
    """
    for _ in range(_RESCANS):
        found = listed()
        if not found:
            return None
        damaged = []
        try:
            for files in found:
                try:
                    return read_checkpoint(files, map_location=map_location)
                except Damaged as exc:
                    _log.warning("skipping damaged checkpoint %s: %s", files.location, exc)
                    damaged.append(f"{files.name} ({exc})")
        except Vanished:
            continue
        raise CheckpointError(
            f"every checkpoint in {where} is damaged: {'; '.join(damaged)}; "
            "remove them to start afresh",
            phase="resume",
        )
    raise CheckpointError(
        f"checkpoints in {where} kept disappearing while being read: is another process "
        "pruning them?",
        phase="resume",
    )


@contextlib.contextmanager
def _reading(files: CheckpointFiles) -> Iterator[None]:
    """Missing or unreadable files as damage, or as the checkpoint vanishing."""
    try:
        yield
    except FileNotFoundError as exc:
        if not files.committed():
            raise Vanished from exc
        raise Damaged(f"missing file ({exc.filename})") from exc
    except OSError as exc:
        raise Damaged(f"unreadable ({exc})") from exc


def read_manifest(files: CheckpointFiles) -> Manifest:
    """The checkpoint's manifest; raises Damaged (a missing one included) and
    CheckpointVersionError."""
    try:
        data = files.read(MANIFEST)
    except FileNotFoundError as exc:
        if not files.committed():  # pruned by a writer meanwhile: no damage
            raise Vanished from exc
        raise Damaged(f"unreadable manifest ({exc})") from exc
    except OSError as exc:
        raise Damaged(f"unreadable manifest ({exc})") from exc
    return parse_manifest(data, where=str(files.location))


def verify_checkpoint(files: CheckpointFiles) -> Manifest:
    """Check every file of a checkpoint against its manifest (sizes and block checksums)
    without decoding any; its manifest. Raises Damaged naming what is wrong (a checkpoint
    removed while being checked included), and CheckpointVersionError."""
    try:
        with _reading(files):
            manifest = read_manifest(files)
            _stems(manifest)
            for record in manifest.files:
                _check(files, record, manifest.checksum)
    except Vanished:
        raise Damaged("removed while being checked") from None
    return manifest


def _stems(manifest: Manifest) -> dict[str, FileRecord]:
    """The record of each state dict's file; raises Damaged when a required one is missing."""
    if STATE not in manifest.names():
        raise Damaged("the manifest lists no state.json")
    stems = {}
    for stem in (RNG, MODEL, OPTIMIZER, BEST_MODEL, RANKS):
        record = _file_of(manifest, stem)
        if record is not None:
            stems[stem] = record
        elif stem not in (BEST_MODEL, RANKS):
            raise Damaged(f"the manifest lists {sorted(manifest.names())}, not every required file")
    return stems


def read_checkpoint(files: CheckpointFiles, *, map_location: Any) -> Loaded:
    """One checkpoint, every file checked against its manifest as it is read.

    Raises Damaged, CheckpointVersionError, and CheckpointError when a file cannot be placed
    or loaded (a bad ``map_location``) or the store fails.
    """
    with _reading(files):
        return _read_files(files, map_location=map_location)


def _read_files(files: CheckpointFiles, *, map_location: Any) -> Loaded:
    manifest = read_manifest(files)
    stems = _stems(manifest)
    records = {record.name: record for record in manifest.files}
    # state.json, tensor files and .pt files are checked while they are read; the rest now
    for record in manifest.files:
        if record.name != STATE and record not in stems.values():
            _check(files, record, manifest.checksum)
    try:
        state = json.loads(_read_checked(files, records[STATE], manifest.checksum))
        if state["format_version"] != manifest.version:
            raise Damaged(f"state.json has format version {state['format_version']}")
        loop_state = loop_state_from_json(state["loop_state"])
        has_best = bool(state["has_best_model"])
        has_ranks = bool(state.get("has_rank_states", False))  # absent before they existed
        rng_json = state["rng"]
        lr_state_json = state["lr_state"]
        sharded = state.get("sharded")
        nranks = None if sharded is None else int(sharded["nranks"])
        precision = None if sharded is None else dict(sharded["precision"])
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise Damaged(f"malformed state.json ({exc!r})") from exc
    if has_best != (BEST_MODEL in stems):
        raise Damaged("state.json and the manifest disagree about the best model")
    if has_ranks != (RANKS in stems):
        raise Damaged("state.json and the manifest disagree about the ranks' states")
    shards = None
    if nranks is not None and precision is not None:
        where: Path | str = (
            f"{files.location}/{SHARDS}" if files.directory is None else files.directory / SHARDS
        )  # in an object store, each rank downloads the shards it loads (see _object_store)
        shards = ShardedState(path=where, nranks=nranks, precision=precision)

    def load(stem: str, location: Any) -> Any:
        record = stems[stem]
        if record.name.endswith(TENSORS):
            return _read_tensor_file(files, record, manifest.checksum, location)
        return _load(files, record, manifest.checksum, location)

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
    return Loaded(
        path=files.location, training_state=training_state, lr_state_json=lr_state_json, rng=rng
    )


def _file_of(manifest: Manifest, stem: str) -> FileRecord | None:
    """The record of ``stem``'s file (format 1: ``.pt``; format 2: either kind, not both)."""
    suffixes = (TORCH,) if manifest.version == 1 else (TENSORS, TORCH)
    found = [r for r in manifest.files if r.name in {stem + suffix for suffix in suffixes}]
    if len(found) > 1:
        raise Damaged(f"the manifest lists {stem} twice")
    return found[0] if found else None


def _digests(data: memoryview, checksum: str) -> tuple[str, ...]:
    digests = []
    for start in range(0, len(data), BLOCK_BYTES):
        block = block_hash(checksum)
        block.update(data[start : start + BLOCK_BYTES])
        digests.append(block.hexdigest())
    return tuple(digests)


def _compare(record: FileRecord, size: int, digests: tuple[str, ...], checksum: str) -> None:
    if size != record.size:
        raise Damaged(f"{record.name} has {size} bytes, the manifest says {record.size}")
    if digests != record.digests:
        raise Damaged(f"{record.name} does not match its {checksum} checksums")


def _check(files: CheckpointFiles, record: FileRecord, checksum: str) -> None:
    """Raise Damaged unless the file matches its record; read block by block."""
    buffer = bytearray(BLOCK_BYTES)
    view = memoryview(buffer)
    digests: list[str] = []
    size = 0
    with files.open(record.name) as (_, stream):
        while count := stream.readinto(view):
            filled = count
            while filled < BLOCK_BYTES and (more := stream.readinto(view[filled:])):
                filled += more
            digests.extend(_digests(view[:filled], checksum))
            size += filled
    _compare(record, size, tuple(digests), checksum)


def _read_checked(files: CheckpointFiles, record: FileRecord, checksum: str) -> bytes:
    """The whole of a file, once it matches its record (raises Damaged)."""
    data = files.read(record.name)
    _compare(record, len(data), _digests(memoryview(data), checksum), checksum)
    return data


def _read_tensor_file(
    files: CheckpointFiles, record: FileRecord, checksum: str, map_location: Any
) -> Any:
    """The value stored in a tensor file, its tensors placed by ``map_location``, read in one
    pass into fresh (writable) tensors while its block checksums are checked.

    Raises Damaged when the file does not match ``record`` (size, block checksums) or is no
    well-formed tensor file, and CheckpointError when ``map_location`` cannot be applied.
    """
    with files.open(record.name) as (size, stream):
        if size != record.size:
            raise Damaged(f"{record.name} has {size} bytes, the manifest says {record.size}")
        # The checked reader calls only readinto and read, which every Stream has.
        reader = CheckedReader(stream, record, checksum)
        header_length = read_prefix(reader.read(16), file_size=size)
        layout = parse_header(reader.read(header_length), file_size=size)
        buffers = []
        for spec in layout.tensors:
            reader.skip_to(spec.offset)
            buffer = torch.empty(spec.nbytes, dtype=torch.uint8)
            if spec.nbytes:
                reader.readinto(buffer.numpy().data)
            buffers.append(buffer)
        reader.skip_to(size)
        reader.finish()
    tensors = []
    for spec, buffer in zip(layout.tensors, buffers, strict=True):
        tensor = buffer.view(spec.dtype).reshape(spec.shape)
        try:
            tensors.append(place(tensor, spec.device, map_location))
        except Exception as exc:  # map_location may be the caller's own function
            raise CheckpointError(
                f"cannot load {_where(files, record)} onto map_location {map_location!r} "
                f"({exc}); check map_location",
                phase="resume",
            ) from exc
    return decode(layout.value, tensors)


def _where(files: CheckpointFiles, record: FileRecord) -> str:
    location = files.location
    return (
        str(location / record.name) if isinstance(location, Path) else f"{location}/{record.name}"
    )


def _load(files: CheckpointFiles, record: FileRecord, checksum: str, map_location: Any) -> Any:
    data = _read_checked(files, record, checksum)
    # The checksum matched: the file is what the writer wrote, so a failure here is no
    # damage to skip past but a real problem (a bad map_location, an unknown type).
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise CheckpointError(
            f"cannot load {_where(files, record)} ({exc}); check map_location", phase="resume"
        ) from exc
