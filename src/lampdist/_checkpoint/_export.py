"""A checkpoint's model weights as files other tools read: a ``torch.save`` state dict or a
safetensors file.

The weights come as :class:`Weights`: what tensors there are (names, dtypes, shapes) before
any is read, then the tensors one at a time. A checkpoint whose root wrote the whole model
holds them in memory already; a sharded one (``step_on="fsdp"``) reads each tensor whole from
every rank's shard files only when it is due, so that consolidating never holds more than one
tensor whole: the safetensors writer streams each to the file (its header is written first,
from the shapes), the torch writer maps each into a scratch file of its own that
``torch.save`` then copies from.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

from .._errors import CheckpointError, ConfigError
from ._shards import _first_failure

__all__ = [
    "FORMATS",
    "ExportFormat",
    "Weights",
    "sharded_weights",
    "whole_weights",
    "write_weights",
]

ExportFormat = Literal["torch", "safetensors"]
FORMATS: tuple[ExportFormat, ...] = ("torch", "safetensors")

_MODEL = "model"
"""The key of the model's state dict among a sharded checkpoint's (see ``_shards``)."""

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@attrs.frozen(kw_only=True)
class Spec:
    """One tensor of the weights, before it is read."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@attrs.frozen(kw_only=True)
class Weights:
    """A model's state dict to export: its tensors' specs, its values that are no tensors
    (a module's extra state), and a reader of the tensors, one at a time in ``specs``'
    order."""

    specs: tuple[Spec, ...]
    others: Mapping[str, Any]
    read: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    held: bool
    """Whether the tensors are in memory already (nothing to gain by streaming them)."""


def whole_weights(state: Mapping[str, Any]) -> Weights:
    """The weights of a state dict held whole (a checkpoint the root wrote)."""
    tensors = {k: v.detach().cpu() for k, v in state.items() if isinstance(v, torch.Tensor)}
    return Weights(
        specs=tuple(Spec(name=k, dtype=v.dtype, shape=tuple(v.shape)) for k, v in tensors.items()),
        others={k: v for k, v in state.items() if not isinstance(v, torch.Tensor)},
        read=lambda: iter(tensors.items()),
        held=True,
    )


def sharded_weights(path: Path) -> Weights:
    """The model weights of the sharded checkpoint whose shards are in ``path``, each tensor
    read whole from every rank's files when it is due (no process group).

    Raises CheckpointError when the shards cannot be read.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(path)
    try:
        metadata = reader.read_metadata()
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(
            f"cannot read the sharded checkpoint {path.parent} ({_first_failure(exc)})",
            phase="resume",
        ) from exc
    prefix = f"{_MODEL}."
    specs = []
    others = []
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if isinstance(item, TensorStorageMetadata):
            shape = tuple(item.size)
            specs.append(Spec(name=key[len(prefix) :], dtype=item.properties.dtype, shape=shape))
        else:
            others.append(key[len(prefix) :])
    if others:
        raise CheckpointError(
            f"the sharded checkpoint {path.parent} holds model values that are no tensors "
            f"({others[:3]}): export reads tensors only; read it whole with "
            "checkpoint.consolidate",
            phase="resume",
        )

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        for spec in specs:
            yield spec.name, _read_one(path, spec)

    return Weights(specs=tuple(specs), others={}, read=read, held=False)


def _read_one(path: Path, spec: Spec) -> torch.Tensor:
    """One tensor of the model, whole, from the shard files at ``path``."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    tensor = torch.empty(spec.shape, dtype=spec.dtype)
    try:
        _load_state_dict(
            {_MODEL: {spec.name: tensor}},
            storage_reader=FileSystemReader(path),
            planner=DefaultLoadPlanner(allow_partial_load=True),
            no_dist=True,
        )
    except (RuntimeError, ValueError, KeyError, OSError, CheckpointException) as exc:
        raise CheckpointError(
            f"cannot read {spec.name!r} from the sharded checkpoint {path.parent} "
            f"({_first_failure(exc)})",
            phase="resume",
        ) from exc
    return tensor


def write_weights(weights: Weights, out: Path, form: str) -> None:
    """Write ``weights`` to ``out`` in format ``form``; ``out`` appears complete or not at
    all. Raises ConfigError for an unknown format or (safetensors) a value that is no
    tensor, and CheckpointError when writing fails."""
    if form not in FORMATS:
        raise ConfigError(
            f"format={form!r} is no export format: pass one of {', '.join(FORMATS)}",
            phase="configure",
        )
    scratch = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if form == "safetensors":
            _write_safetensors(weights, scratch)
        else:
            _write_torch(weights, scratch, out.parent)
        os.replace(scratch, out)
    except OSError as exc:
        raise CheckpointError(f"cannot write {out} ({exc})", phase="checkpoint") from exc
    finally:
        scratch.unlink(missing_ok=True)


def _write_torch(weights: Weights, target: Path, near: Path) -> None:
    if weights.held:
        torch.save({**dict(weights.read()), **weights.others}, target)
        return
    with tempfile.TemporaryDirectory(prefix=".lampdist-export-", dir=near) as scratch:
        mapped: dict[str, Any] = {}
        for index, (name, tensor) in enumerate(weights.read()):
            mapped[name] = _mapped(tensor, Path(scratch) / str(index))
            del tensor  # the file holds it now; the mapping pages it in while saved
        torch.save({**mapped, **weights.others}, target)


def _mapped(tensor: torch.Tensor, path: Path) -> torch.Tensor:
    """``tensor`` written to ``path`` and mapped back from it (not held in memory)."""
    if tensor.numel() == 0:
        return tensor
    with open(path, "wb") as file:
        file.write(_bytes_of(tensor).numpy().data)
    flat = torch.from_file(str(path), shared=False, size=tensor.numel(), dtype=tensor.dtype)
    return flat.reshape(tensor.shape)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` in C order, as a flat uint8 tensor."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _write_safetensors(weights: Weights, target: Path) -> None:
    """The safetensors format (an 8-byte little-endian header length, a JSON header of every
    tensor's dtype, shape and byte range, then the bytes) written one tensor at a time."""
    if weights.others:
        names = sorted(weights.others)[:3]
        raise ConfigError(
            f"format='safetensors' holds tensors only, and the model's state dict holds "
            f"other values ({names}): pass format='torch'",
            phase="configure",
        )
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in weights.specs:
        if spec.dtype not in _SAFETENSORS_DTYPES:
            raise ConfigError(
                f"format='safetensors' has no dtype {spec.dtype} (tensor {spec.name!r}): "
                "pass format='torch'",
                phase="configure",
            )
        size = spec.dtype.itemsize * _count(spec.shape)
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(target, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for spec, (name, tensor) in zip(weights.specs, weights.read(), strict=True):
            if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise CheckpointError(
                    f"tensor {name!r} is not what the checkpoint's metadata says", phase="resume"
                )
            if tensor.numel():
                file.write(_bytes_of(tensor).numpy().data)
        file.flush()
        os.fsync(file.fileno())


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
