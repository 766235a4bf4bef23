"""Files: hashed and fsynced writes, checksummed reads, the writer lock, safe-load checks."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .._errors import CheckpointError
from ._format import FileRecord

__all__ = [
    "HashingWriter",
    "check_weights_only_loadable",
    "fsync_directory",
    "hash_file",
    "write_file",
    "writer_lock",
]

_CHUNK_BYTES = 64 << 20
"""Large writes go out in chunks this size, each checked for cancellation."""
_PARALLEL_HASH_BYTES = 1 << 20
"""Chunks at least this size are hashed on a helper thread while they are being written."""


class HashingWriter:
    """A write-only file object for ``torch.save`` that hashes what it writes.

    The sha256 of a large chunk runs on ``pool`` while the chunk is written, so hashing costs
    little extra time; ``check`` is called before every chunk (it raises to abort a write).
    An exception in ``write`` is not raised through ``torch.save`` (whose cleanup would
    replace it with a RuntimeError): it is kept in ``failure``, later writes are dropped,
    and :func:`write_file` raises it once ``torch.save`` has returned.
    """

    def __init__(
        self, file: BinaryIO, *, check: Callable[[], None], pool: ThreadPoolExecutor
    ) -> None:
        self._file = file
        self._check = check
        self._pool = pool
        self._hash = hashlib.sha256()
        self.size = 0
        self.failure: BaseException | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if self.failure is None:
            try:
                self._write(view)
            except BaseException as exc:  # re-raised by write_file, cancellation included
                self.failure = exc
        return len(view)

    def _write(self, view: memoryview) -> None:
        for start in range(0, len(view), _CHUNK_BYTES):
            self._check()
            chunk = view[start : start + _CHUNK_BYTES]
            if len(chunk) >= _PARALLEL_HASH_BYTES:
                hashed = self._pool.submit(self._hash.update, chunk)
                try:
                    self._file.write(chunk)
                finally:
                    hashed.result()  # the chunk is only valid until write returns
            else:
                self._hash.update(chunk)
                self._file.write(chunk)
            self.size += len(chunk)

    def flush(self) -> None:
        if self.failure is None:
            self._file.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def write_file(
    path: Path,
    produce: Callable[[HashingWriter], object],
    *,
    check: Callable[[], None],
    pool: ThreadPoolExecutor,
) -> FileRecord:
    """Create ``path``, let ``produce`` fill it, fsync it; its size and sha256."""
    with open(path, "xb") as file:
        writer = HashingWriter(file, check=check, pool=pool)
        try:
            produce(writer)
        finally:
            if writer.failure is not None:
                raise writer.failure
        file.flush()
        os.fsync(file.fileno())
    return FileRecord(name=path.name, size=writer.size, sha256=writer.hexdigest())


def hash_file(path: Path) -> tuple[int, str]:
    """The size and sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
            size += count
    return size, digest.hexdigest()


def fsync_directory(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable; a no-op on Windows."""
    if sys.platform == "win32":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def writer_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory/.lock`` exclusively; the kernel releases it if the writer dies.

    Raises CheckpointError when another writer holds it.
    """
    if sys.platform == "win32":
        yield
        return
    import fcntl

    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(
                f"another writer is writing a checkpoint into {directory}: give each run its "
                "own checkpoint directory",
                phase="checkpoint",
            ) from None
        yield
    finally:
        os.close(fd)


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
