"""Initial weights stored as safetensors: :func:`from_safetensors` and :class:`StoredWeights`.

One ``.safetensors`` file, a sharded set with its index (``model.safetensors.index.json``, as
Hugging Face writes it) or a transformers model directory holding either. The stored names are
the module's ``state_dict`` names; tied parameters (a language model's head tied to its
embedding, which Hugging Face stores once) load from whichever of their names is stored.

:func:`load_stored` copies into each tensor of a module the part it holds: a DTensor (an fsdp
shard) reads only the slice of the stored tensor that this rank keeps, through safetensors'
lazy ``get_slice``, so no rank reads or holds the whole model; a plain tensor reads the whole.
``safetensors`` is imported when weights are read, never by ``import lampdist``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch

from ._errors import ConfigError, Phase
from ._words import counted

__all__ = ["StoredWeights", "from_safetensors", "load_stored"]

_PHASE: Phase = "configure"
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_SHOWN = 8
"""How many differences an error lists."""


@attrs.frozen(kw_only=True, repr=False)
class StoredWeights:
    """Weights in safetensors files, to start a run from (see :func:`from_safetensors`).

    ``path``: the ``.safetensors`` file, the index json of a sharded set, or a directory
    holding ``model.safetensors.index.json`` or ``model.safetensors``. ``strict``: every
    tensor of the module's ``state_dict`` must be stored and every stored tensor must be one
    of them (``False``: the missing keep the module's own initialization, the unexpected are
    ignored). Shapes must match either way; a stored dtype is cast to the module's.
    """

    path: Path
    strict: bool = True

    def __repr__(self) -> str:
        # The same text in every process: FsdpPolicy's agreement check compares it.
        return f"from_safetensors({str(self.path)!r}, strict={self.strict})"

    def files(self) -> dict[str, Path]:
        """Each stored tensor's name and the file that holds it.

        Raises :class:`~lampdist.ConfigError` when the path holds no safetensors weights or
        its index is not one."""
        path = self.path
        if path.is_dir():
            if (path / _INDEX).is_file():
                return _indexed(path / _INDEX)
            if (path / _SINGLE).is_file():
                path = path / _SINGLE
            else:
                present = sorted(p.name for p in path.iterdir())[:_SHOWN]
                raise ConfigError(
                    f"from_safetensors: directory {str(self.path)!r} holds neither {_INDEX} "
                    f"nor {_SINGLE} (it holds {present}); save the model with "
                    "save_pretrained(dir) (safetensors is its default) or pass the file",
                    phase=_PHASE,
                )
        if path.name.endswith(".json"):
            return _indexed(path)
        return {name: path for name in _keys(path)}

    def load_into(self, module: torch.nn.Module) -> None:
        """Check that the stored weights fit ``module`` and copy them in (every tensor whole:
        for a model that one process holds, e.g. on the root before a run under another
        design than fsdp, whose start broadcasts the root's weights). Raises
        :class:`~lampdist.ConfigError` as :func:`plan_load` does."""
        load_stored(self, module, plan_load(self, module, rank=None), rank=None)


def from_safetensors(path: str | os.PathLike[str], *, strict: bool = True) -> StoredWeights:
    """Weights stored as safetensors, to start from: one file, the index json of a sharded
    set, or a directory (a transformers ``save_pretrained`` one) with either. Give it to
    ``FsdpPolicy(initial_weights=...)``, or call :meth:`StoredWeights.load_into`.

    Raises :class:`~lampdist.ConfigError` when ``path`` does not exist."""
    where = Path(path)
    if not where.exists():
        raise ConfigError(
            f"from_safetensors: {str(where)!r} does not exist; pass a .safetensors file, "
            f"an index json or a directory with {_INDEX} or {_SINGLE}",
            phase=_PHASE,
        )
    if not isinstance(strict, bool):
        raise ConfigError(
            f"from_safetensors: strict must be True or False, got {strict!r}", phase=_PHASE
        )
    return StoredWeights(path=where, strict=strict)


def _indexed(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"from_safetensors: {str(index)!r} is not a safetensors index (a json object with "
            f"a 'weight_map' of tensor names to files): {type(exc).__name__}: {exc}",
            phase=_PHASE,
        ) from exc
    return {str(name): index.parent / str(file) for name, file in weight_map.items()}


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        return list(handle.keys())


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Each stored tensor's shape, from the files' headers (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file, names in _by_file(files).items():
        with safe_open(str(file), framework="pt") as handle:
            stored = set(handle.keys())
            for name in names:
                if name not in stored:
                    raise ConfigError(
                        f"from_safetensors: the index names {name!r} in {str(file)!r}, "
                        "which does not hold it",
                        phase=_PHASE,
                    )
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _by_file(files: dict[str, Path]) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for name, file in files.items():
        grouped.setdefault(file, []).append(name)
    return grouped


def plan_load(
    weights: StoredWeights, module: torch.nn.Module, *, rank: int | None
) -> dict[str, str]:
    """Which stored tensor each of ``module``'s ``state_dict`` entries loads from (names tied
    to one tensor share a stored one; with ``strict=False`` a name not stored is left out).
    Reads the files' headers only; ``module`` may be on the meta device or sharded.

    Raises :class:`~lampdist.ConfigError` listing the missing and unexpected names (unless
    ``strict=False``) and the shape mismatches."""
    shapes = _shapes(weights.files())
    state = module.state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}
    for name, tensor in state.items():
        tied.setdefault(id(tensor), []).append(name)
    plan: dict[str, str] = {}
    differences: list[str] = []
    for names in tied.values():
        stored = [name for name in names if name in shapes]
        if not stored:
            if weights.strict:
                differences += [f"{name!r}: in the model, not stored" for name in names]
            continue
        want = tuple(state[names[0]].shape)
        for name in stored:
            if shapes[name] != want:
                differences.append(f"{name!r}: shape {shapes[name]} stored, {want} in the model")
        plan.update(dict.fromkeys(names, stored[0]))
    if weights.strict:
        differences += [f"{n!r}: stored, not in the model" for n in shapes if n not in state]
    if differences:
        shown = "; ".join(differences[:_SHOWN])
        more = f"; and {len(differences) - _SHOWN} more" if len(differences) > _SHOWN else ""
        loose = "" if not weights.strict else " (strict=False keeps the model's own values)"
        raise ConfigError(
            f"initial weights {weights!r} do not fit the model ({type(module).__name__}): "
            f"{counted(len(differences), 'difference')}: {shown}{more}; store the model's "
            f"state_dict names and shapes{loose}",
            rank=rank,
            phase=_PHASE,
        )
    return plan


def load_stored(
    weights: StoredWeights, module: torch.nn.Module, plan: dict[str, str], *, rank: int | None
) -> None:
    """Copy into each of ``module``'s ``state_dict`` tensors that ``plan`` names (see
    :func:`plan_load`) its stored values: a DTensor only the slice this rank holds, read
    lazily from the file; a plain tensor the whole. Each tensor tied to others once."""
    from safetensors import safe_open

    state = module.state_dict(keep_vars=True)
    files = weights.files()
    loaded: set[int] = set()
    for file, names in _by_file({n: files[plan[n]] for n in plan}).items():
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                tensor = state[name]
                if id(tensor) in loaded:
                    continue
                loaded.add(id(tensor))
                for target, index in _parts(tensor):
                    with torch.no_grad():
                        target.copy_(_read(handle, plan[name], index))


def _parts(tensor: torch.Tensor) -> Iterator[tuple[torch.Tensor, tuple[slice, ...] | None]]:
    """The tensor this rank writes, and the slice of the stored one it holds (``None``: the
    whole); nothing for a shard without elements."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        yield tensor.data, None
        return
    local: torch.Tensor = getattr(tensor, "_local_tensor")  # noqa: B009  # untyped in torch
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    if local.numel() == 0:
        return
    yield local, tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def _read(handle: Any, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
    """The stored tensor ``name``, or its slice ``index`` (safetensors reads that alone)."""
    if index is None or not index:
        tensor: torch.Tensor = handle.get_tensor(name)
        return tensor
    part: torch.Tensor = handle.get_slice(name)[index]
    return part
