"""torch.save without the redundant zip CRC32s, and the check that a value loads safely."""

from __future__ import annotations

import inspect
import pickle
from collections import OrderedDict
from typing import Any

import torch

from .._errors import CheckpointError
from ._files import HashingWriter

__all__ = ["check_weights_only_loadable", "save_tensors"]


def _crc_free_save_available() -> bool:
    try:
        parameters = list(inspect.signature(torch.serialization._save).parameters)
        torch.serialization._get_storage_alignment()
    except (AttributeError, TypeError, ValueError):
        return False
    expected = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]
    return parameters == expected and hasattr(torch._C, "PyTorchFileWriter")


_CRC_FREE_SAVE = _crc_free_save_available()


def save_tensors(obj: Any, file: HashingWriter) -> None:
    """``torch.save(obj, file)``, minus the zip CRC32 of every record where possible.

    torch.save spends most of its time on those CRC32s; the manifest's sha256 checksums
    cover every byte already, and torch.load does not need them. This goes through torch's
    private ``_save`` (what ``torch.save`` calls) with a CRC-free writer, and falls back to
    plain ``torch.save`` when that private function is not what it was in torch 2.11-2.13.
    """
    # torch only calls write() and flush() on the file: a HashingWriter is file enough.
    if not _CRC_FREE_SAVE:
        torch.save(obj, file)  # type: ignore[arg-type]  # see above
        return
    alignment = torch.serialization._get_storage_alignment()
    zip_file = torch._C.PyTorchFileWriter(file, False, alignment)  # type: ignore[call-overload]  # see above
    protocol = torch.serialization.DEFAULT_PROTOCOL
    torch.serialization._save(obj, zip_file, pickle, protocol, False)  # type: ignore[no-untyped-call]  # private, untyped
    zip_file.write_end_of_file()


_LEAVES: tuple[type, ...] = (
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
)


def check_weights_only_loadable(value: Any, where: str) -> None:
    """Raise CheckpointError unless ``torch.load(weights_only=True)`` can load ``value``.

    Checked before writing, so that a checkpoint which could only be loaded by running code
    from the file is never written in the first place.
    """
    if isinstance(value, torch.Tensor):
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            check_weights_only_loadable(key, f"{where} key {key!r}")
            check_weights_only_loadable(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple, torch.Size):
        for index, item in enumerate(value):
            check_weights_only_loadable(item, f"{where}[{index}]")
        return
    if type(value) in _LEAVES:
        return
    safe = tuple(g for g in torch.serialization.get_safe_globals() if isinstance(g, type))
    if isinstance(value, safe):
        return
    raise CheckpointError(
        f"cannot checkpoint {where}: a {type(value).__qualname__} cannot be loaded with "
        "torch.load(weights_only=True); keep state dicts to tensors, numbers, strings and "
        "containers, or register the type with torch.serialization.add_safe_globals",
        phase="checkpoint",
    )
