"""The on-disk format: names, the manifest envelope and the JSON form of the loop state.

A checkpoint is a directory ``epoch-000012`` (``epoch-000012.1`` and up when the same epoch
is written again) holding::

    state.json      format version, loop state, schedule state, python/numpy RNG states
    rng.pt          torch CPU and CUDA RNG states
    model.pt        the model state dict            (torch.save, loaded with weights_only)
    optimizer.pt    the optimizer state dict
    best_model.pt   the best model state dict, absent when there is none
    manifest.json   written last: the size of every other file, the sha256 of each of its
                    16 MiB blocks (hashed in parallel), and the manifest's own checksum

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
from ..loop._state import CurvePoint, LoopState

__all__ = [
    "BEST_MODEL",
    "BLOCK_BYTES",
    "FORMAT_VERSION",
    "MANIFEST",
    "MODEL",
    "OPTIMIZER",
    "RNG",
    "STATE",
    "TEMP_PREFIX",
    "CheckpointName",
    "Damaged",
    "FileRecord",
    "dump_json",
    "loop_state_from_json",
    "loop_state_to_json",
    "manifest_to_bytes",
    "parse_manifest",
]

FORMAT_VERSION = 1
"""The checkpoint format this lampdist writes, and the newest it reads."""

MANIFEST = "manifest.json"
STATE = "state.json"
RNG = "rng.pt"
MODEL = "model.pt"
OPTIMIZER = "optimizer.pt"
BEST_MODEL = "best_model.pt"
BLOCK_BYTES = 16 << 20
"""The manifest holds the sha256 of every block of this many bytes of every file."""
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
    sha256: tuple[str, ...]
    """The sha256 of each ``BLOCK_BYTES`` block, in order (none for an empty file)."""


def dump_json(value: Any) -> bytes:
    """Canonical JSON (sorted keys, exact floats, NaN and infinities allowed)."""
    return json.dumps(value, sort_keys=True, allow_nan=True, separators=(",", ":")).encode()


def _manifest_body(version: int, files: Any) -> bytes:
    return dump_json({"format_version": version, "files": files})


def manifest_to_bytes(files: list[FileRecord]) -> bytes:
    body = {
        "block_bytes": BLOCK_BYTES,
        "files": {r.name: {"size": r.size, "sha256": list(r.sha256)} for r in files},
    }
    checksum = hashlib.sha256(_manifest_body(FORMAT_VERSION, body)).hexdigest()
    return dump_json({"format_version": FORMAT_VERSION, "files": body, "checksum": checksum})


def parse_manifest(data: bytes, *, where: str) -> list[FileRecord]:
    """The file records of a manifest.

    Raises :class:`Damaged` when it is not an intact manifest, and
    :class:`CheckpointVersionError` when it is an intact one of a newer format.
    """
    try:
        envelope = json.loads(data)
        version = envelope["format_version"]
        files = envelope["files"]
        checksum = envelope["checksum"]
    except (ValueError, TypeError, KeyError) as exc:
        raise Damaged(f"unreadable manifest ({exc!r})") from exc
    if not isinstance(version, int) or not isinstance(files, dict):
        raise Damaged("malformed manifest")
    if hashlib.sha256(_manifest_body(version, files)).hexdigest() != checksum:
        raise Damaged("manifest checksum mismatch")
    if version > FORMAT_VERSION:
        from .. import __version__

        raise CheckpointVersionError(
            f"checkpoint {where} has format version {version}, but lampdist {__version__} "
            f"reads versions up to {FORMAT_VERSION}: upgrade lampdist to resume from it",
            phase="resume",
        )
    if version < 1:
        raise Damaged(f"invalid format version {version}")
    try:
        if files["block_bytes"] != BLOCK_BYTES:
            raise Damaged(f"block size {files['block_bytes']}, not {BLOCK_BYTES}")
        return [
            FileRecord(
                name=str(name),
                size=int(entry["size"]),
                sha256=tuple(str(digest) for digest in entry["sha256"]),
            )
            for name, entry in files["files"].items()
        ]
    except (TypeError, KeyError, ValueError) as exc:
        raise Damaged(f"malformed manifest entry ({exc!r})") from exc


def loop_state_to_json(state: LoopState) -> dict[str, Any]:
    return {
        "epoch": state.epoch,
        "last_validation_loss": state.last_validation_loss,
        "min_validation_loss": state.min_validation_loss,
        "min_validation_epoch": state.min_validation_epoch,
        "learning_curve": [
            {
                "epoch": point.epoch,
                "training_loss": point.training_loss,
                "validation_loss": point.validation_loss,
                "smoothed_validation_loss": point.smoothed_validation_loss,
            }
            for point in state.learning_curve
        ],
    }


def loop_state_from_json(data: dict[str, Any]) -> LoopState:
    return LoopState(
        epoch=data["epoch"],
        last_validation_loss=data["last_validation_loss"],
        min_validation_loss=data["min_validation_loss"],
        min_validation_epoch=data["min_validation_epoch"],
        learning_curve=tuple(CurvePoint(**point) for point in data["learning_curve"]),
    )
