"""The on-disk format: names, the manifest envelope and the JSON form of the loop state.

A checkpoint is a directory ``epoch-000012`` (``epoch-000012.1`` and up when the same epoch
is written again) holding (format 2)::

    state.json          format version, loop state, schedule state, python/numpy RNG states
    rng.tensors         torch CPU and CUDA RNG states
    model.tensors       the model state dict            (a tensor file: _tensor_file.py)
    optimizer.tensors   the optimizer state dict
    best_model.tensors  the best model state dict, absent when there is none
    manifest.json       written last: the size of every other file, the checksum of each
                        of its 16 MiB blocks, and the manifest's own sha256

A state dict holding a value the tensor file cannot represent is written as ``NAME.pt``
instead (torch.save, loaded with ``weights_only=True``). Format 1 had only ``.pt`` files and
sha256 block checksums; it is still read.

The manifest envelope ``{"format_version": int, "files": ..., "checksum": str}`` is stable
across format versions, so a reader can always tell "newer format" from "damaged".
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import attrs

from .._errors import CheckpointVersionError
from .._state_json import loop_state_from_json, loop_state_to_json
from .._version import __version__

__all__ = [
    "BEST_MODEL",
    "BLOCK_BYTES",
    "FORMAT_VERSION",
    "MANIFEST",
    "MODEL",
    "OPTIMIZER",
    "RANKS",
    "RNG",
    "STATE",
    "TEMP_PREFIX",
    "TENSORS",
    "TORCH",
    "WRITE_CHECKSUM",
    "CheckpointName",
    "Damaged",
    "FileRecord",
    "Manifest",
    "dump_json",
    "loop_state_from_json",
    "loop_state_to_json",
    "manifest_to_bytes",
    "parse_manifest",
]

FORMAT_VERSION = 2
"""The checkpoint format this lampdist writes, and the newest it reads (it reads 1 too)."""

MANIFEST = "manifest.json"
STATE = "state.json"
RNG = "rng"
MODEL = "model"
OPTIMIZER = "optimizer"
BEST_MODEL = "best_model"
RANKS = "ranks"
"""The state dict files, without their suffix (``ranks``: what each rank holds of the
checkpoint, when the run gathered it)."""
TENSORS = ".tensors"
"""The suffix of a tensor file (format 2)."""
TORCH = ".pt"
"""The suffix of a torch.save file (format 1, and format 2's fallback)."""
BLOCK_BYTES = 16 << 20
"""The manifest holds the checksum of every block of this many bytes of every file."""
WRITE_CHECKSUM = "crc32"
"""The block checksum this lampdist writes (format 1 used sha256)."""
_CHECKSUMS = ("crc32", "sha256")
TEMP_PREFIX = ".tmp-"
"""A writer's scratch entries start with this: ignored on load, removed by the next writer."""

_NAME = re.compile(r"epoch-(\d+)(?:\.(\d+))?")


class Damaged(Exception):
    """A committed checkpoint is truncated, corrupted or incomplete (internal; never escapes)."""


@attrs.frozen(kw_only=True, order=True)
class CheckpointName:
    """``epoch-000012`` (generation 0) or ``epoch-000012.3``; newer sorts greater."""

    epoch: int
    generation: int = 0

    @property
    def name(self) -> str:
        base = f"epoch-{self.epoch:06d}"
        return base if self.generation == 0 else f"{base}.{self.generation}"

    @classmethod
    def parse(cls, name: str) -> CheckpointName | None:
        match = _NAME.fullmatch(name)
        if match is None:
            return None
        return cls(epoch=int(match[1]), generation=int(match[2] or 0))


@attrs.frozen(kw_only=True)
class FileRecord:
    """One file of a checkpoint as the manifest records it."""

    name: str
    size: int
    digests: tuple[str, ...]
    """The checksum of each ``BLOCK_BYTES`` block, in order (none for an empty file)."""


@attrs.frozen(kw_only=True)
class Manifest:
    """A checkpoint's manifest: its format version and what its files must be."""

    version: int
    checksum: str
    """The block checksum algorithm: "sha256" (format 1) or "crc32"."""
    files: tuple[FileRecord, ...]

    def names(self) -> set[str]:
        return {record.name for record in self.files}


def dump_json(value: Any) -> bytes:
    """Canonical JSON (sorted keys, exact floats, NaN and infinities allowed)."""
    return json.dumps(value, sort_keys=True, allow_nan=True, separators=(",", ":")).encode()


def _manifest_body(version: int, files: Any) -> bytes:
    return dump_json({"format_version": version, "files": files})


def manifest_to_bytes(files: list[FileRecord]) -> bytes:
    body = {
        "block_bytes": BLOCK_BYTES,
        "block_checksum": WRITE_CHECKSUM,
        "files": {r.name: {"size": r.size, "blocks": list(r.digests)} for r in files},
    }
    checksum = hashlib.sha256(_manifest_body(FORMAT_VERSION, body)).hexdigest()
    return dump_json({"format_version": FORMAT_VERSION, "files": body, "checksum": checksum})


def _is_file_name(name: str) -> bool:
    """Whether a manifest entry names a file inside the checkpoint: a plain name, or one in
    its ``shards`` directory (a sharded checkpoint's; DCP names its metadata ``.metadata``)."""
    head, _, tail = name.partition("/")
    if not tail:
        return bool(head) and not head.startswith(".")
    return head == "shards" and "/" not in tail and tail not in (".", "..") and bool(tail)


def parse_manifest(data: bytes, *, where: str) -> Manifest:
    """A manifest read from its bytes.

    Raises :class:`Damaged` when it is not an intact manifest, and
    :class:`CheckpointVersionError` when it is an intact one of a newer format.
    """
    try:
        envelope = json.loads(data)
        version = envelope["format_version"]
        files = envelope["files"]
        checksum = envelope["checksum"]
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise Damaged(f"unreadable manifest ({exc!r})") from exc
    if not isinstance(version, int) or not isinstance(files, dict):
        raise Damaged("malformed manifest")
    if hashlib.sha256(_manifest_body(version, files)).hexdigest() != checksum:
        raise Damaged("manifest checksum mismatch")
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"checkpoint {where} has format version {version}, but lampdist {__version__} "
            f"reads versions up to {FORMAT_VERSION}: upgrade lampdist to resume from it",
            phase="resume",
        )
    if version < 1:
        raise Damaged(f"invalid format version {version}")
    # format 1: {"size", "sha256": [...]} per file; format 2 names its checksum
    checksum_name, key = ("sha256", "sha256") if version == 1 else (None, "blocks")
    try:
        if files["block_bytes"] != BLOCK_BYTES:
            raise Damaged(f"block size {files['block_bytes']}, not {BLOCK_BYTES}")
        checksum_name = checksum_name or files["block_checksum"]
        if checksum_name not in _CHECKSUMS:
            raise Damaged(f"unknown block checksum {checksum_name!r}")
        records = tuple(
            FileRecord(
                name=str(name),
                size=int(entry["size"]),
                digests=tuple(str(digest) for digest in entry[key]),
            )
            for name, entry in files["files"].items()
        )
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise Damaged(f"malformed manifest entry ({exc!r})") from exc
    if any(not _is_file_name(r.name) or r.size < 0 for r in records):
        raise Damaged("a manifest entry names no file of the checkpoint")
    return Manifest(version=version, checksum=checksum_name, files=records)
