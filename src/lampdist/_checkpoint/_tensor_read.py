"""The parts of reading a tensor file that ``_read`` builds on: a reader that checks the
file's block checksums as it goes, front to back, and the placing of each tensor read where
``map_location`` says."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ._files import BlockHash, block_hash
from ._format import BLOCK_BYTES, Damaged, FileRecord

__all__ = ["CheckedReader", "Stream", "place"]


class Stream(Protocol):
    """One file's bytes, front to back (``readinto`` returns 0 at its end)."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...

    def read(self, size: int = -1, /) -> bytes | None: ...


class CheckedReader:
    """Reads a file front to back, checking every block against the manifest's checksum."""

    def __init__(self, file: Stream, record: FileRecord, checksum: str) -> None:
        self._file = file
        self._record = record
        self._checksum = checksum
        self._position = 0
        self._block: BlockHash = block_hash(checksum)
        self._blocks = 0  # blocks checked

    def readinto(self, view: memoryview) -> None:
        filled = 0
        while filled < len(view):
            count = self._file.readinto(view[filled:])
            if not count:
                raise Damaged(f"{self._record.name} ends early, at byte {self._position}")
            self._hash(view[filled : filled + count])
            filled += count

    def read(self, count: int) -> bytes:
        buffer = bytearray(count)
        self.readinto(memoryview(buffer))
        return bytes(buffer)

    def skip_to(self, position: int) -> None:
        if position < self._position:
            raise Damaged(f"{self._record.name}: cannot go back to byte {position}")
        while self._position < position:
            self.read(min(BLOCK_BYTES, position - self._position))

    def _hash(self, data: memoryview) -> None:
        while len(data):
            room = BLOCK_BYTES - self._position % BLOCK_BYTES
            piece, data = data[:room], data[room:]
            self._block.update(piece)
            self._position += len(piece)
            if self._position % BLOCK_BYTES == 0:
                self._end_block()

    def _end_block(self) -> None:
        digests = self._record.digests
        if self._blocks >= len(digests) or self._block.hexdigest() != digests[self._blocks]:
            raise Damaged(f"{self._record.name} does not match its {self._checksum} checksums")
        self._blocks += 1
        self._block = block_hash(self._checksum)

    def finish(self) -> None:
        if self._file.read(1):
            raise Damaged(f"{self._record.name} is longer than its header says")
        if self._position % BLOCK_BYTES:
            self._end_block()
        if self._blocks != len(self._record.digests):
            raise Damaged(f"{self._record.name} does not match its {self._checksum} checksums")


def place(tensor: torch.Tensor, saved_device: str, map_location: Any) -> torch.Tensor:
    """``tensor`` (on the CPU) where ``torch.load(map_location=...)`` would put it."""
    target: Any
    if map_location is None:
        target = saved_device
    elif isinstance(map_location, str | torch.device):
        target = map_location
    elif isinstance(map_location, dict):
        target = map_location.get(saved_device, saved_device)
    elif callable(map_location):
        storage = map_location(tensor.untyped_storage(), saved_device)
        if storage is None:
            target = saved_device
        else:
            placed = torch.empty(0, dtype=tensor.dtype, device=storage.device)
            return placed.set_(storage, 0, tensor.shape, tensor.stride())
    else:
        raise TypeError(
            f"map_location must be a str, device, dict or callable, not {map_location!r}"
        )
    device = torch.device(target)
    return tensor if device.type == "cpu" else tensor.to(device)
