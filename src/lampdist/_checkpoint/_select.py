"""Reading one chosen checkpoint: a checkpoint's own directory or URL, or a given epoch of a
run's directory or prefix.

A checkpoint is told by its ``manifest.json``, not by its name: a checkpoint directory copied
or symlinked anywhere, under any name, reads as the original does. Unlike
:func:`~._read.read_latest`, nothing is skipped: a damaged chosen checkpoint is an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import CheckpointError, ConfigError
from ._format import MANIFEST, CheckpointName, Damaged
from ._object_store import StoreFiles, read_latest_from_store, store_checkpoints
from ._read import (
    CheckpointFiles,
    DirectoryFiles,
    Loaded,
    Vanished,
    read_checkpoint,
    read_latest,
)
from ._store_client import is_url, open_store
from ._write import committed_checkpoints

__all__ = ["chosen_checkpoint", "read_chosen", "read_location"]


def read_chosen(
    location: str | os.PathLike[str],
    *,
    epoch: int | None,
    map_location: Any,
    options: Mapping[str, str] | None,
) -> Loaded:
    """The checkpoint :func:`chosen_checkpoint` finds, read and checked against its manifest.

    Raises ConfigError as :func:`chosen_checkpoint` does, CheckpointError when the checkpoint
    is damaged (naming what is wrong) or cannot be read, and CheckpointVersionError.
    """
    files = chosen_checkpoint(location, epoch=epoch, options=options)
    try:
        return read_checkpoint(files, map_location=map_location)
    except Damaged as exc:
        raise CheckpointError(
            f"checkpoint {files.location} is damaged ({exc}): choose another one "
            "(lampdist checkpoint ls --verify lists them)",
            phase="resume",
        ) from exc
    except Vanished as exc:
        raise CheckpointError(
            f"checkpoint {files.location} was removed while being read", phase="resume"
        ) from exc


def chosen_checkpoint(
    location: str | os.PathLike[str],
    *,
    epoch: int | None,
    options: Mapping[str, str] | None,
) -> CheckpointFiles:
    """The files of one checkpoint: ``location`` itself (a checkpoint's directory or URL)
    when ``epoch`` is None, else the newest checkpoint of ``epoch`` in ``location`` (a run's
    directory or URL, as ``checkpoint.to_directory`` and ``to_url`` write).

    Raises ConfigError when ``location`` holds no checkpoint (naming what to pass instead) or
    no checkpoint of ``epoch``, and CheckpointError when it cannot be listed.
    """
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
        raise ConfigError(f"epoch={epoch!r}: pass an int, or None", phase="resume")
    if is_url(location):
        url = str(location).rstrip("/")
        if epoch is not None:
            return _of_epoch(store_checkpoints(url, options, phase="resume"), url, epoch)
        prefix, _, name = url.rpartition("/")
        files = StoreFiles(store=open_store(prefix, options), url=prefix, checkpoint=name)
        if not files.committed():
            raise _not_a_checkpoint(url, runs=bool(store_checkpoints(url, options, phase="resume")))
        return files
    directory = Path(location)
    if not directory.is_dir():
        raise ConfigError(
            f"{str(location)!r} is no directory: pass a checkpoint's directory (such as "
            "runs/a/epoch-000003) or an object store URL",
            phase="resume",
        )
    if epoch is not None:
        return _of_epoch([DirectoryFiles(path=p) for _, p in _listed(directory)], directory, epoch)
    if not (directory / MANIFEST).is_file():
        raise _not_a_checkpoint(directory, runs=bool(_listed(directory)))
    return DirectoryFiles(path=directory)


def _listed(directory: Path) -> list[tuple[CheckpointName, Path]]:
    try:
        return committed_checkpoints(directory)
    except OSError as exc:
        raise CheckpointError(
            f"cannot list checkpoints in {directory} ({exc})", phase="resume"
        ) from exc


def _of_epoch(found: Sequence[CheckpointFiles], where: Path | str, epoch: int) -> CheckpointFiles:
    """The newest of ``found`` (newest first) whose name is of ``epoch``."""
    names = {files.name: CheckpointName.parse(files.name) for files in found}
    for files in found:
        name = names[files.name]
        if name is not None and name.epoch == epoch:
            return files
    epochs = sorted({name.epoch for name in names.values() if name is not None})
    held = f"those of epochs {epochs}" if epochs else "none"
    raise ConfigError(
        f"epoch={epoch}: {where} holds no checkpoint of epoch {epoch} (it holds {held}): "
        "pass one of those, or leave the epoch out for the newest",
        phase="resume",
    )


def _not_a_checkpoint(where: Path | str, *, runs: bool) -> ConfigError:
    if runs:
        return ConfigError(
            f"{where} is a run's checkpoint directory, not one checkpoint: pass one of its "
            f"checkpoints ({where}/epoch-000003), an epoch (epoch= or --epoch), or use "
            "checkpoint.load_latest for the newest",
            phase="resume",
        )
    return ConfigError(
        f"{where} is no checkpoint (it has no {MANIFEST}): pass a checkpoint's directory or "
        "URL, such as runs/a/epoch-000003",
        phase="resume",
    )


def read_location(
    location: str | os.PathLike[str],
    *,
    epoch: int | None,
    map_location: Any,
    options: Mapping[str, str] | None,
) -> Loaded | None:
    """The checkpoint at ``location``: with ``epoch``, or when ``location`` is one
    checkpoint's directory or URL, that one (:func:`read_chosen`); else the newest intact one
    of the run there, None when it holds none. Raises as :func:`read_chosen` and
    :func:`~._read.read_latest` do."""
    if epoch is not None or _is_checkpoint(location, options):
        return read_chosen(location, epoch=epoch, map_location=map_location, options=options)
    if is_url(location):
        return read_latest_from_store(str(location), map_location=map_location, options=options)
    return read_latest(Path(location), map_location=map_location)


def _is_checkpoint(location: str | os.PathLike[str], options: Mapping[str, str] | None) -> bool:
    if is_url(location):
        prefix, _, name = str(location).rstrip("/").rpartition("/")
        if not name or "://" not in prefix:
            return False
        return StoreFiles(
            store=open_store(prefix, options), url=prefix, checkpoint=name
        ).committed()
    return (Path(location) / MANIFEST).is_file()
