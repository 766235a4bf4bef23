"""Copies of a checkpoint's state, for a write that goes on beside training.

An asynchronous checkpoint must not read the model while the next steps change it, so every
tensor of the state is copied first, on the thread whose stream the steps run on (the
compute thread), before training goes on:

- A tensor on the CPU is copied into one host buffer, reused by every checkpoint (at most
  one write is in flight, so one buffer of the state's size is the whole pool).
- A tensor on a GPU is copied on that GPU, into one snapshot tensor per device, queued on
  the compute stream: at the GPU's memory bandwidth this takes about a millisecond per
  gigabyte, and the steps that follow run after it without the host waiting. The copy to
  the host (pinned memory, a second reused buffer, allocated and pinned on the writer's
  thread the first time) then runs on a stream of its own, beside the next steps, when the
  writer calls :meth:`Staged.finish`; the snapshot is freed once it is on the host. A GPU
  without room for the snapshot (out of memory) gets its tensors copied straight to pinned
  memory on the compute stream instead: the next steps then queue behind that copy.

The host buffer for the GPUs' part is pinned: a copy into pageable memory holds the
driver for its whole length, and the compute thread's kernel launches with it (measured on
an H200 with a 1.6 GB state: the first step after each checkpoint took 6-9 times the median,
against 1.1-1.9 times with pinned memory). Pinning that buffer (``cudaHostAlloc``, once per
run, at the first checkpoint) stalls the compute thread's CUDA calls too: 0.78 s for 1.6 GB
there.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from ._tensor_file import SAVED_DEVICE, device_of

__all__ = ["HostBuffer", "Staged", "Staging"]

_log = logging.getLogger("lampdist.checkpoint")

_ALIGN = 64
"""Every tensor's bytes start at a multiple of this in a buffer (any dtype's alignment)."""


@attrs.define(eq=False)
class Staged:
    """A staged copy of some values: :meth:`finish`, on the writer's thread, brings the GPU
    snapshots to the host and returns the values with every tensor replaced by a host copy."""

    _values: tuple[Any, ...]
    _copies: dict[int, torch.Tensor]
    _pending: list[_DeviceSnapshot]
    _staging: Staging
    _pinned_bytes: int
    nbytes: int

    def finish(self) -> tuple[Any, ...]:
        for snapshot in self._pending:
            snapshot.to_host(self._staging.pinned, self._pinned_bytes, self._copies)
        self._pending = []  # frees the snapshots on their GPUs
        return tuple(_rebuilt(value, self._copies) for value in self._values)


@attrs.define(eq=False)
class _DeviceSnapshot:
    """One GPU's tensors copied into one tensor on that GPU (or, with ``direct``, already
    queued for the host); ``event`` follows the copies on the compute stream."""

    tensors: list[torch.Tensor]
    offsets: list[int]
    nbytes: int
    event: Any
    snapshot: torch.Tensor | None
    host_offset: int

    def to_host(self, pinned: HostBuffer, size: int, copies: dict[int, torch.Tensor]) -> None:
        if self.snapshot is None:  # direct: the copies to the host are queued already
            self.event.synchronize()
            return
        host = pinned.room(size, pin=True)  # every device's part: one allocation
        stream = torch.cuda.Stream(device=self.snapshot.device)  # type: ignore[no-untyped-call]
        stream.wait_event(self.event)
        with torch.cuda.stream(stream):
            for tensor, offset in zip(self.tensors, self.offsets, strict=True):
                nbytes = tensor.numel() * tensor.element_size()
                source = self.snapshot[offset : offset + nbytes]
                target = _view(host, self.host_offset + offset, tensor)
                target.copy_(source.view(tensor.dtype).view(tensor.shape), non_blocking=True)
                copies[id(tensor)] = _noting_device(target, tensor)
        stream.synchronize()
        self.snapshot = None


def _aligned(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """``like``'s dtype and shape over ``buffer``'s bytes from ``offset``."""
    return buffer[offset : offset + _nbytes(like)].view(like.dtype).view(like.shape)


def _noting_device(copy_: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    if original.device.type != "cpu":  # the checkpoint records where it was
        setattr(copy_, SAVED_DEVICE, device_of(original))
    return copy_


def _copied_whole(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is copied on its own, not into a buffer (sparse and other layouts,
    tensor subclasses)."""
    return tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, torch.nn.Parameter)


def _tensors(value: Any, found: dict[int, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.setdefault(id(value), value)  # a tensor held twice stays one tensor
    elif isinstance(value, Mapping):
        for item in value.values():
            _tensors(item, found)
    elif isinstance(value, list | tuple):
        for item in value:
            _tensors(item, found)


@attrs.define(eq=False)
class HostBuffer:
    """One reusable host buffer (pinned when asked), grown only when a state needs more."""

    _buffer: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    @property
    def pinned(self) -> bool:
        return self._buffer is not None and self._buffer.is_pinned()

    def room(self, needed: int, *, pin: bool) -> torch.Tensor:
        """The buffer, with at least ``needed`` bytes (pinned with ``pin``)."""
        if self._buffer is None or self.capacity < needed or (pin and not self.pinned):
            self._buffer = None  # free the old buffer before allocating the new one
            self._buffer = torch.empty(max(needed, 1), dtype=torch.uint8, pin_memory=pin)
        return self._buffer


@attrs.define(eq=False)
class Staging:
    """The buffers of one run's asynchronous checkpoints: :meth:`stage` copies a state."""

    host: HostBuffer = attrs.field(factory=HostBuffer)
    """For tensors on the CPU."""
    pinned: HostBuffer = attrs.field(factory=HostBuffer)
    """For tensors on GPUs, on their way to the host."""

    def stage(self, *values: Any) -> Staged:
        """Copy every tensor of ``values`` (state dicts, lists, tuples, tensors, plain values)
        as the module's docstring says; call on the compute thread. Not thread-safe: the
        previous :class:`Staged` must be finished before the next :meth:`stage`."""
        found: dict[int, torch.Tensor] = {}
        for value in values:
            _tensors(value, found)
        copies: dict[int, torch.Tensor] = {}
        on_host: list[torch.Tensor] = []
        on_devices: dict[torch.device, list[torch.Tensor]] = {}
        for tensor in found.values():
            if _copied_whole(tensor):
                whole = tensor.detach().to("cpu", copy=True)
                copies[id(tensor)] = _noting_device(whole, tensor)
            elif tensor.device.type == "cuda":
                on_devices.setdefault(tensor.device, []).append(tensor)
            else:
                on_host.append(tensor)
        nbytes = self._copy_on_host(on_host, copies)
        layouts = {device: _layout(tensors) for device, tensors in on_devices.items()}
        pinned_bytes = sum(total for _, total in layouts.values())
        pending = []
        host_offset = 0
        for device, tensors in on_devices.items():
            offsets, total = layouts[device]
            pending.append(
                self._snapshot(device, tensors, offsets, total, host_offset, pinned_bytes, copies)
            )
            host_offset += total
        return Staged(values, copies, pending, self, pinned_bytes, nbytes + pinned_bytes)

    def _copy_on_host(self, tensors: list[torch.Tensor], copies: dict[int, torch.Tensor]) -> int:
        offsets, total = _layout(tensors)
        buffer = self.host.room(total, pin=False)
        for tensor, offset in zip(tensors, offsets, strict=True):
            target = _view(buffer, offset, tensor)
            target.copy_(tensor.detach())
            copies[id(tensor)] = target
        return total

    def _snapshot(
        self,
        device: torch.device,
        tensors: list[torch.Tensor],
        offsets: list[int],
        total: int,
        host_offset: int,
        pinned_bytes: int,
        copies: dict[int, torch.Tensor],
    ) -> _DeviceSnapshot:
        try:
            snapshot: torch.Tensor | None = torch.empty(total, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            _log.info(
                "rank 0: no room on %s for a %.1f MB snapshot of the checkpoint: its tensors go "
                "to the host on the compute stream",
                device,
                total / 1e6,
            )
            snapshot = None
        if snapshot is not None:
            for tensor, offset in zip(tensors, offsets, strict=True):
                _view(snapshot, offset, tensor).copy_(tensor.detach())
        else:  # straight to pinned memory (all of it: the earlier devices' part too)
            host = self.pinned.room(pinned_bytes, pin=True)
            for tensor, offset in zip(tensors, offsets, strict=True):
                target = _view(host, host_offset + offset, tensor)
                target.copy_(tensor.detach(), non_blocking=True)
                copies[id(tensor)] = _noting_device(target, tensor)
        with torch.cuda.device(device):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch
            event.record()  # on the current stream: after the copies
        return _DeviceSnapshot(tensors, offsets, total, event, snapshot, host_offset)


def _layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's aligned offset in one buffer, and the buffer's size."""
    offsets = []
    total = 0
    for tensor in tensors:
        offsets.append(total)
        total += _aligned(_nbytes(tensor))
    return offsets, total


def _rebuilt(value: Any, copies: Mapping[int, torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by its copy; containers rebuilt, other values
    copied (plain numbers and strings are immutable and kept)."""
    if isinstance(value, torch.Tensor):
        return copies[id(value)]
    if isinstance(value, Mapping):
        items = {key: _rebuilt(item, copies) for key, item in value.items()}
        return items if type(value) is dict else _same_mapping(value, items)
    if isinstance(value, list):
        return [_rebuilt(item, copies) for item in value]
    if isinstance(value, tuple):
        rebuilt = [_rebuilt(item, copies) for item in value]
        return tuple(rebuilt) if type(value) is tuple else type(value)(*rebuilt)
    if value is None or isinstance(value, bool | int | float | str | bytes | torch.dtype):
        return value
    return copy.deepcopy(value)


def _same_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` in ``original``'s mapping type where it can be built from a dict (an
    OrderedDict, as ``state_dict`` returns, keeps its ``_metadata``), else a plain dict."""
    try:
        rebuilt = type(original)(items)  # type: ignore[call-arg]  # a dict's own type
    except Exception:
        return items
    metadata = getattr(original, "_metadata", None)
    if metadata is not None:
        rebuilt._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
    return rebuilt
