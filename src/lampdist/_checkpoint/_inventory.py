"""What checkpoints a directory or an object store's prefix holds, and whether they verify."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from .._errors import CheckpointError, CheckpointVersionError
from ._format import CheckpointName, Damaged
from ._object_store import is_url, store_checkpoints
from ._read import CheckpointFiles, DirectoryFiles, Vanished, read_manifest, verify_checkpoint
from ._write import committed_checkpoints

__all__ = ["Listed", "list_checkpoints"]


@attrs.frozen(kw_only=True)
class Listed:
    """One committed checkpoint as :func:`list_checkpoints` finds it."""

    name: str
    """``epoch-000012`` or ``epoch-000012.1``."""
    epoch: int
    size: int
    """Bytes: the sum of its manifest's files (0 when the manifest is unreadable)."""
    verified: bool | None
    """Whether every file matches the manifest; None when not checked."""
    problem: str | None
    """Why it failed verification (or what is wrong with its manifest)."""
    location: str
    """Its path or URL."""


def list_checkpoints(
    location: str | os.PathLike[str],
    *,
    verify: bool,
    options: Mapping[str, str] | None = None,
) -> list[Listed]:
    """The committed checkpoints in a directory or under an object store URL, newest first.

    With ``verify=True`` every file of each is read and checked against its manifest (sizes
    and block checksums), as loading would. ``options`` are an object store's (see
    ``checkpoint.to_url``). Raises CheckpointError when ``location`` is no directory or
    cannot be listed, and ConfigError for bad options.
    """
    found: Sequence[CheckpointFiles]
    if is_url(location):
        found = store_checkpoints(str(location), options, phase="resume")
    else:
        directory = Path(location)
        if not directory.is_dir():
            raise CheckpointError(f"{directory} is no directory", phase="resume")
        try:
            found = [DirectoryFiles(path=path) for _, path in committed_checkpoints(directory)]
        except OSError as exc:
            raise CheckpointError(
                f"cannot list checkpoints in {directory} ({exc})", phase="resume"
            ) from exc
    return [_listed(files, verify=verify) for files in found]


def _listed(files: CheckpointFiles, *, verify: bool) -> Listed:
    name = CheckpointName.parse(files.name)
    size = 0
    problem = None
    try:
        size = sum(record.size for record in read_manifest(files).files)
        if verify:
            verify_checkpoint(files)
    except Damaged as exc:
        problem = str(exc)
    except Vanished:
        problem = "removed while being listed (pruned by a writer)"
    except CheckpointVersionError as exc:
        problem = exc.message
    return Listed(
        name=files.name,
        epoch=-1 if name is None else name.epoch,
        size=size,
        verified=(problem is None) if verify else None,
        problem=problem,
        location=str(files.location),
    )
