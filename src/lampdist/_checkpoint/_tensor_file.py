"""The tensor file: a JSON header and the raw bytes of every tensor (format 2).

Layout (all integers little-endian)::

    b"LDTENSOR"                 8 bytes, the magic
    header length               8 bytes, unsigned
    header                      UTF-8 JSON, see below
    zero padding                up to the next multiple of ALIGN bytes: the data start
    tensor bytes                each tensor's contiguous bytes at data start + its offset,
                                offsets multiples of ALIGN, zero padding between them

The header is ``{"byteorder": "little", "tensors": [...], "value": ...}``: each tensor is
``{"dtype": "float32", "shape": [4, 5], "device": "cpu", "offset": 0}`` and ``value`` is
the state dict in a tagged JSON form: ``None``, booleans, numbers, strings and lists are
themselves, every JSON object is one tag: ``{"tensor": index}``, ``{"tuple": [...]}``,
``{"dict": [[key, value], ...]}`` (keys of any of these types, order kept),
``{"odict": [...], "attrs": {...}}`` (an ``OrderedDict`` and its attributes, such as
``_metadata``), ``{"size": [...]}``, ``{"dtype": "float32"}``, ``{"device": "cuda:0"}``.

Reading one never runs code from the file (no pickle): the header is JSON whose every
value is checked against this grammar, and tensors are created from their dtype, shape and
bytes. A value outside the grammar (a tensor subclass, a sparse tensor, a type registered
with ``torch.serialization.add_safe_globals``) makes :func:`encode` return None, and the
writer falls back to ``torch.save`` for that file.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ._format import Damaged

__all__ = [
    "ALIGN",
    "MAGIC",
    "SAVED_DEVICE",
    "Encoded",
    "Layout",
    "decode",
    "device_of",
    "encode",
    "parse_header",
]

MAGIC = b"LDTENSOR"
ALIGN = 64
"""Tensor bytes start at multiples of this (friendly to vectorised copies and to mmap)."""
_PREFIX = struct.Struct("<8sQ")


def _raw_dtypes() -> dict[str, torch.dtype]:
    """The dtypes whose tensors are plain bytes: those a byte tensor can be viewed as."""
    found = {}
    for dtype in vars(torch).values():
        if not isinstance(dtype, torch.dtype):
            continue
        try:
            torch.empty(dtype.itemsize, dtype=torch.uint8).view(dtype).view(torch.uint8)
        except (RuntimeError, TypeError):
            continue
        found[str(dtype).removeprefix("torch.")] = dtype
    for quantized in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4"):
        found.pop(quantized, None)
    return found


_DTYPES = _raw_dtypes()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _tensor_fits(tensor: torch.Tensor) -> bool:
    """Whether a tensor round-trips through its dtype, shape and bytes alone."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.is_nested
        and tensor.device.type != "meta"
        and str(tensor.dtype).removeprefix("torch.") in _DTYPES
    )


@attrs.frozen(kw_only=True, eq=False)
class Encoded:
    """A value ready to write: the file's first bytes, then the tensors at their offsets."""

    head: bytes
    """Magic, header length, header and padding: the data starts right after."""
    tensors: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    """Each tensor's offset in the file (not relative to the data start)."""
    size: int
    """The size of the whole file."""


SAVED_DEVICE = "_lampdist_saved_device"
"""The attribute of a host copy of a tensor staged for an asynchronous checkpoint that names
the device of the tensor it copies: the file records that device, as a synchronous write of
the tensor itself would."""


def device_of(tensor: torch.Tensor) -> str:
    """The device a tensor file records for ``tensor`` (see :data:`SAVED_DEVICE`)."""
    saved = getattr(tensor, SAVED_DEVICE, None)
    return saved if isinstance(saved, str) else str(tensor.device)


def encode(value: Any) -> Encoded | None:
    """The tensor-file form of ``value``, or None when it holds something outside the grammar."""
    tensors: list[torch.Tensor] = []

    def tag(item: Any) -> Any:
        kind = type(item)
        if item is None or kind in (bool, str):
            return item
        if kind is int:
            return item
        if kind is float:
            return item
        if kind is list:
            return [tag(x) for x in item]
        if kind is tuple:
            return {"tuple": [tag(x) for x in item]}
        if kind is dict:
            return {"dict": [[tag(k), tag(v)] for k, v in item.items()]}
        if kind is OrderedDict:
            extra = vars(item)
            if any(not isinstance(name, str) or name.startswith("__") for name in extra):
                raise _Unfit
            return {
                "odict": [[tag(k), tag(v)] for k, v in item.items()],
                "attrs": {name: tag(v) for name, v in extra.items()},
            }
        if kind is torch.Tensor:
            if not _tensor_fits(item):
                raise _Unfit
            tensors.append(item)
            return {"tensor": len(tensors) - 1}
        if kind is torch.Size:
            return {"size": list(item)}
        if kind is torch.dtype and str(item).removeprefix("torch.") in _DTYPES:
            return {"dtype": str(item).removeprefix("torch.")}
        if kind is torch.device:
            return {"device": str(item)}
        raise _Unfit

    try:
        tagged = tag(value)
    except _Unfit:
        return None
    relative = []
    position = 0
    for tensor in tensors:
        relative.append(position)
        position = _align(position + tensor.numel() * tensor.element_size())
    header = json.dumps(
        {
            "byteorder": sys.byteorder,
            "tensors": [
                {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "device": device_of(t),
                    "offset": offset,
                }
                for t, offset in zip(tensors, relative, strict=True)
            ],
            "value": tagged,
        },
        allow_nan=True,
        separators=(",", ":"),
    ).encode()
    data_start = _align(_PREFIX.size + len(header))
    head = _PREFIX.pack(MAGIC, len(header)) + header
    head += bytes(data_start - len(head))
    ends = [
        data_start + o + t.numel() * t.element_size()
        for t, o in zip(tensors, relative, strict=True)
    ]
    return Encoded(
        head=head,
        tensors=tuple(tensors),
        offsets=tuple(data_start + offset for offset in relative),
        size=max([data_start, *ends]),
    )


class _Unfit(Exception):
    """The value holds something the tensor file cannot represent."""


@attrs.frozen(kw_only=True)
class TensorSpec:
    """One tensor as the header describes it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str
    offset: int
    """From the start of the file."""
    nbytes: int


@attrs.frozen(kw_only=True, eq=False)
class Layout:
    """A parsed, checked header: where every tensor is, and the tagged value."""

    data_start: int
    tensors: tuple[TensorSpec, ...]
    value: Any


def read_prefix(data: bytes, *, file_size: int) -> int:
    """The header length from the file's first 16 bytes; raises Damaged."""
    if len(data) != _PREFIX.size:
        raise Damaged("the tensor file is shorter than its prefix")
    magic, header_length = _PREFIX.unpack(data)
    if magic != MAGIC:
        raise Damaged("not a tensor file (bad magic)")
    if header_length > file_size - _PREFIX.size:
        raise Damaged(f"header length {header_length} exceeds the file size {file_size}")
    return int(header_length)


def parse_header(header: bytes, *, file_size: int) -> Layout:
    """Check a header against the grammar and the file size; raises Damaged.

    Raises CheckpointError (not damage) when the file was written on a machine of the other
    byte order.
    """
    try:
        parsed = json.loads(header)
        byteorder, specs, value = parsed["byteorder"], parsed["tensors"], parsed["value"]
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise Damaged(f"unreadable tensor file header ({exc!r})") from exc
    if byteorder != sys.byteorder:
        from .._errors import CheckpointError

        raise CheckpointError(
            f"the tensor file was written on a {byteorder!r}-endian machine, this one is "
            f"{sys.byteorder!r}-endian: load it on a machine like the writer's",
            phase="resume",
        )
    if not isinstance(specs, list):
        raise Damaged("malformed tensor file header: 'tensors' is no list")
    data_start = _align(_PREFIX.size + len(header))
    tensors = []
    end = data_start
    for index, spec in enumerate(specs):
        try:
            tensor = _spec(spec, data_start)
        except (ValueError, TypeError, KeyError) as exc:
            raise Damaged(f"malformed header entry of tensor {index} ({exc!r})") from exc
        if tensor.offset < end or tensor.offset % ALIGN:
            raise Damaged(f"tensor {index} overlaps another or is misaligned")
        end = tensor.offset + tensor.nbytes
        if end > file_size:
            raise Damaged(f"tensor {index} ends at byte {end}, past the file's {file_size}")
        tensors.append(tensor)
    if max(end, data_start) != file_size:
        raise Damaged(f"the tensors end at byte {end}, the file has {file_size}")
    return Layout(data_start=data_start, tensors=tuple(tensors), value=value)


def _spec(spec: Any, data_start: int) -> TensorSpec:
    if type(spec) is not dict:
        raise TypeError("not an object")
    dtype = _DTYPES[spec["dtype"]]
    shape, device, offset = spec["shape"], spec["device"], spec["offset"]
    if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"bad shape {shape!r}")
    if type(device) is not str or type(offset) is not int or offset < 0:
        raise ValueError("bad device or offset")
    nbytes = math.prod(shape) * dtype.itemsize
    return TensorSpec(
        dtype=dtype,
        shape=tuple(shape),
        device=device,
        offset=data_start + offset,
        nbytes=nbytes,
    )


def decode(tagged: Any, tensors: list[torch.Tensor]) -> Any:
    """The value a tagged JSON value stands for, with ``tensors`` in place; raises Damaged."""
    try:
        return _untag(tagged, tensors)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
        raise Damaged(f"malformed value in a tensor file ({exc!r})") from exc
    except RecursionError as exc:
        raise Damaged("a value in a tensor file is nested too deeply") from exc


def _untag(item: Any, tensors: list[torch.Tensor]) -> Any:
    kind = type(item)
    if item is None or kind in (bool, int, float, str):
        return item
    if kind is list:
        return [_untag(x, tensors) for x in item]
    if kind is not dict or not 1 <= len(item) <= 2:
        raise ValueError(f"not a tagged value: {item!r:.80}")
    if len(item) == 2 and set(item) != {"odict", "attrs"}:
        raise ValueError(f"unknown tags {sorted(item)}")
    name = "odict" if len(item) == 2 else next(iter(item))
    handler = _TAGS.get(name)
    if handler is None:
        raise ValueError(f"unknown tag {name!r}")
    return handler(item, tensors)


def _pairs(body: Any, tensors: list[torch.Tensor]) -> list[tuple[Any, Any]]:
    if type(body) is not list:
        raise TypeError("dict items are no list")
    pairs = []
    for pair in body:
        if type(pair) is not list or len(pair) != 2:
            raise TypeError("a dict item is no pair")
        pairs.append((_untag(pair[0], tensors), _untag(pair[1], tensors)))
    return pairs


def _odict(item: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    result = OrderedDict(_pairs(item["odict"], tensors))
    extra = item.get("attrs", {})
    if type(extra) is not dict or any(name.startswith("__") for name in extra):
        raise ValueError("bad OrderedDict attributes")
    result.__dict__.update({name: _untag(v, tensors) for name, v in extra.items()})
    return result


def _tensor(item: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    index = item["tensor"]
    if type(index) is not int or index < 0:
        raise ValueError(f"bad tensor index {index!r}")
    return tensors[index]


def _sized(item: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    dims = item["size"]
    if type(dims) is not list or not all(type(n) is int for n in dims):
        raise TypeError("bad torch.Size")
    return torch.Size(dims)


def _list_of(item: Any) -> list[Any]:
    if type(item) is not list:
        raise TypeError("expected a list")
    return item


_TAGS: dict[str, Callable[[dict[str, Any], list[torch.Tensor]], Any]] = {
    "tuple": lambda item, ts: tuple(_untag(x, ts) for x in _list_of(item["tuple"])),
    "dict": lambda item, ts: dict(_pairs(item["dict"], ts)),
    "odict": _odict,
    "tensor": _tensor,
    "size": _sized,
    "dtype": lambda item, ts: _DTYPES[item["dtype"]],
    "device": lambda item, ts: torch.device(item["device"]),
}
