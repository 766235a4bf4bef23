"""Sharded checkpoints: each rank writes and reads its own shards (``step_on="fsdp"``).

Every rank writes its shards of the model and optimizer state into the ``shards``
subdirectory of the checkpoint's scratch directory at once, with
``torch.distributed.checkpoint`` (one file per rank, and the global metadata from rank 0), and
returns the block checksums of its own files. The root verifies every rank's files against
them and commits the checkpoint as any other (see ``_write``: manifest last, atomic rename,
keep-k), its manifest listing the shard files, so that a missing or damaged shard makes the
checkpoint damaged and :func:`lampdist.checkpoint.load_latest` falls back to the one before.

In an object store (:mod:`._object_store`), each rank writes its shards into a scratch
directory of its own, uploads its files under the checkpoint's ``shards/`` prefix and
removes the scratch; to load, each rank downloads the shards into a scratch directory.

A sharded checkpoint loads on any number of ranks: under fsdp each rank reads the parts of
the saved shards that its own shards cover (the global metadata says which); any other design
reads it whole in one process (:func:`read_whole`), as ``lampdist checkpoint consolidate``
does. Optimizer state is keyed by parameter name (``torch.distributed.checkpoint.state_dict``'s
form); :func:`by_index` and :func:`by_name` convert to and from a plain optimizer's index keys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from .._errors import CheckpointError
from ._files import hash_file
from ._format import WRITE_CHECKSUM, FileRecord

__all__ = [
    "SHARDS",
    "ShardedState",
    "by_index",
    "by_name",
    "check_every_rank_wrote",
    "load_rank_shards",
    "read_whole",
    "write_rank_shards",
]

SHARDS = "shards"
"""The subdirectory of a checkpoint that holds its shards."""
_METADATA = ".metadata"


@attrs.frozen(kw_only=True)
class ShardedState:
    """Where a sharded checkpoint's shards are: ``path`` (a ``shards`` directory, or the URL
    of a ``shards`` prefix in an object store, read and written with ``options``), written by
    ``nranks`` ranks with ``precision`` (:meth:`lampdist.Precision.to_plain`). While being
    written, ``records`` holds every rank's files and their checksums."""

    path: Path | str
    nranks: int
    precision: Mapping[str, str | None] = attrs.field(factory=dict)
    records: tuple[FileRecord, ...] = ()
    options: Mapping[str, str] | None = attrs.field(default=None, repr=False)


def check_every_rank_wrote(shards: ShardedState) -> None:
    """Raise :class:`CheckpointError` unless ``shards.records`` hold the metadata and a file
    of every rank (each rank's part before the checkpoint is committed)."""
    names = {record.name for record in shards.records}
    if f"{SHARDS}/{_METADATA}" not in names:
        raise CheckpointError("the shards' metadata is missing", phase="checkpoint")
    for rank in range(shards.nranks):
        if not any(name.startswith(f"{SHARDS}/__{rank}_") for name in names):
            raise CheckpointError(f"rank {rank} wrote no shard", phase="checkpoint")


def _own_files(directory: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` wrote into ``directory``: its data files, and on rank 0 the
    metadata."""
    prefix = f"__{rank}_"
    mine = [directory / name for name in sorted(os.listdir(directory)) if name.startswith(prefix)]
    if rank == 0:
        mine.append(directory / _METADATA)
    return mine


def write_rank_shards(
    directory: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int
) -> list[FileRecord]:
    """Write this rank's shards of ``module`` and ``optimizer`` into ``directory / SHARDS``
    (a collective: every rank calls it) and return its own files' records, named relative to
    the checkpoint directory."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_saver import save

    target = directory / SHARDS
    state: dict[str, Any] = {
        "model": get_model_state_dict(module),
        "optimizer": get_optimizer_state_dict(module, optimizer),
    }
    try:
        save(state, storage_writer=FileSystemWriter(target, sync_files=True))
        records = []
        for path in _own_files(target, rank):
            size, digests = hash_file(path, WRITE_CHECKSUM)
            records.append(FileRecord(name=f"{SHARDS}/{path.name}", size=size, digests=digests))
    except (OSError, CheckpointException) as exc:
        raise CheckpointError(
            f"could not write this rank's shards into {target} ({_first_failure(exc)})",
            rank=rank,
            phase="checkpoint",
        ) from exc
    return records


def load_rank_shards(
    path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rank: int
) -> None:
    """Load this rank's shards of the sharded checkpoint at ``path`` (a ``shards``
    directory) into ``module`` and ``optimizer``, whatever the number of ranks that wrote it
    (a collective: every rank calls it). Raises :class:`CheckpointError` naming the rank when
    the checkpoint was written by another model or optimizer."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load

    state: dict[str, Any] = {
        "model": get_model_state_dict(module),
        "optimizer": get_optimizer_state_dict(module, optimizer),
    }
    try:
        load(state, storage_reader=FileSystemReader(path))
        set_model_state_dict(module, state["model"])
        set_optimizer_state_dict(module, optimizer, state["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError, CheckpointException) as exc:
        # DCP gathers every rank's planning errors into a CheckpointException (a
        # BaseException): name the first.
        raise CheckpointError(
            f"the sharded checkpoint {path.parent} does not load into this run's model and "
            f"optimizer ({_first_failure(exc)}); was it written by another model?",
            rank=rank,
            phase="resume",
        ) from exc


def _first_failure(exc: BaseException) -> str:
    """``Kind: message`` of ``exc``, or of the first rank's failure that DCP gathered in it."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        if isinstance(first, BaseException):
            return f"{type(first).__name__}: {first}"
    return f"{type(exc).__name__}: {exc}"


def read_whole(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole model state dict and the name-keyed optimizer state of the sharded
    checkpoint at ``path``, read in this process alone (no process group)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(path),
            planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    except (RuntimeError, ValueError, KeyError, OSError, CheckpointException) as exc:
        raise CheckpointError(
            f"cannot read the sharded checkpoint {path.parent} ({_first_failure(exc)})",
            phase="resume",
        ) from exc
    return dict(state.get("model", {})), dict(state.get("optimizer", {}))


def by_index(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A name-keyed optimizer state as a plain optimizer's over parameters ``names`` (in its
    order) keys it."""
    index = {name: position for position, name in enumerate(names)}
    missing = [name for name in state.get("state", {}) if name not in index]
    if missing:
        raise CheckpointError(
            f"the checkpoint's optimizer state holds parameters {missing[:3]} that this run's "
            "model does not have",
            phase="resume",
        )
    groups = []
    for group in state.get("param_groups", []):
        groups.append({**group, "params": [index[name] for name in group["params"]]})
    return {
        "state": {index[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": groups,
    }


def by_name(state: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A plain optimizer's state over parameters ``names`` (in its order), keyed by name."""
    groups = []
    for group in state.get("param_groups", []):
        groups.append({**group, "params": [names[i] for i in group["params"]]})
    return {
        "state": {names[int(i)]: value for i, value in state.get("state", {}).items()},
        "param_groups": groups,
    }
