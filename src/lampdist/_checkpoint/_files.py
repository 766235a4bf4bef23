"""Files: checksummed and fsynced writes, checksummed reads, the writer lock."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Protocol

from .._errors import CheckpointError
from ._format import BLOCK_BYTES, FileRecord

__all__ = [
    "BlockHash",
    "HashingWriter",
    "block_hash",
    "fsync_directory",
    "hash_file",
    "start_writeback",
    "write_file",
    "writer_lock",
]

_PARALLEL_HASH_BYTES = 1 << 20
"""Pieces at least this size are hashed on the pool while they are being written."""


class BlockHash(Protocol):
    """The checksum of one block: fed piece by piece, read as hex."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """zlib's CRC-32 as a hashlib-like object (twice as fast as sha256 on one core)."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def block_hash(algorithm: str) -> BlockHash:
    """A fresh checksum of ``algorithm`` ("crc32" or "sha256"); KeyError for others."""
    factory: dict[str, Callable[[], BlockHash]] = {"crc32": _Crc32, "sha256": hashlib.sha256}
    return factory[algorithm]()


def _load_sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux's ``sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)``, if there is one.

    Python's ``os`` has no binding for it, so it comes from the C library through ctypes
    (which releases the GIL around the call).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    sync_file_range_write = 2

    def start(fd: int, offset: int, length: int) -> None:
        function(fd, offset, length, sync_file_range_write)  # advice: failures are harmless

    return start


def _start_writeback_with_fadvise(fd: int, offset: int, length: int) -> None:
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


_fadvise = _start_writeback_with_fadvise if hasattr(os, "posix_fadvise") else None
_writeback = _load_sync_file_range() or _fadvise


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a finished range of a file to disk now, so the final fsync has little left.

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` on Linux, ``POSIX_FADV_DONTNEED`` (which also
    starts writeback of dirty pages) elsewhere; only advice: the fsync still makes it durable.
    """
    if _writeback is not None:
        _writeback(fd, offset, length)


class HashingWriter:
    """A write-only file object for ``torch.save`` that hashes what it writes.

    Every ``BLOCK_BYTES`` block of the file gets its own checksum, so the blocks of a large
    write are hashed on ``pool``'s threads in parallel while this thread writes them: the
    checksums cost little extra time. ``check`` is called before every block written (it
    raises to abort). An exception in ``write`` is not raised through ``torch.save`` (whose
    cleanup would replace it with a RuntimeError): it is kept in ``failure``, later writes
    are dropped, and :func:`write_file` raises it once ``torch.save`` has returned.
    """

    def __init__(
        self,
        file: BinaryIO,
        *,
        check: Callable[[], None],
        pool: ThreadPoolExecutor,
        algorithm: str = "sha256",
    ) -> None:
        self._file = file
        self._check = check
        self._pool = pool
        self._algorithm = algorithm
        self._blocks: list[BlockHash] = []
        self.size = 0
        self.failure: BaseException | None = None
        self._writeback_from = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if self.failure is None:
            try:
                self._write(view)
            except BaseException as exc:  # re-raised by write_file, cancellation included
                self.failure = exc
        return len(view)

    def _write(self, view: memoryview) -> None:
        # Split at block boundaries of the file: each block gets at most one piece per call,
        # so the pieces can be hashed concurrently.
        pieces = []
        offset = 0
        while offset < len(view):
            index, within = divmod(self.size + offset, BLOCK_BYTES)
            if index == len(self._blocks):
                self._blocks.append(block_hash(self._algorithm))
            piece = view[offset : offset + min(BLOCK_BYTES - within, len(view) - offset)]
            pieces.append((self._blocks[index], piece))
            offset += len(piece)
        hashing = [
            self._pool.submit(block.update, piece)
            for block, piece in pieces
            if len(piece) >= _PARALLEL_HASH_BYTES
        ]
        written = self.size
        try:
            for block, piece in pieces:
                if len(piece) < _PARALLEL_HASH_BYTES:
                    block.update(piece)
                self._check()
                self._file.write(piece)
                written += len(piece)
                self._start_writeback(written)
        except BaseException:
            for future in hashing:  # the write is abandoned: skip what has not started
                future.cancel()
            raise
        finally:
            for future in hashing:  # the data is only valid until write returns
                if not future.cancelled():
                    future.result()
        self.size += len(view)

    def _start_writeback(self, position: int) -> None:
        """Start writing finished blocks to disk now, so the final fsync has little left.

        ``POSIX_FADV_DONTNEED`` starts asynchronous writeback of dirty pages on Linux (and
        drops pages already clean); it is only advice, so nothing changes where it does not.
        """
        done = position // BLOCK_BYTES * BLOCK_BYTES
        if done > self._writeback_from:
            self._file.flush()
            start_writeback(self._file.fileno(), self._writeback_from, done - self._writeback_from)
            self._writeback_from = done

    def flush(self) -> None:
        if self.failure is None:
            self._file.flush()

    def digests(self) -> tuple[str, ...]:
        return tuple(block.hexdigest() for block in self._blocks)


def write_file(
    path: Path,
    produce: Callable[[HashingWriter], object],
    *,
    check: Callable[[], None],
    pool: ThreadPoolExecutor,
    algorithm: str = "sha256",
) -> FileRecord:
    """Create ``path``, let ``produce`` fill it, fsync it; its size and block checksums."""
    with open(path, "xb") as file:
        writer = HashingWriter(file, check=check, pool=pool, algorithm=algorithm)
        try:
            produce(writer)
        finally:
            if writer.failure is not None:
                raise writer.failure
        file.flush()
        os.fsync(file.fileno())
    return FileRecord(name=path.name, size=writer.size, digests=writer.digests())


def hash_file(path: Path, algorithm: str = "sha256") -> tuple[int, tuple[str, ...]]:
    """The size and the checksum of every ``BLOCK_BYTES`` block of a file."""
    digests = []
    size = 0
    buffer = bytearray(BLOCK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            filled = count
            while filled < BLOCK_BYTES and (more := file.readinto(view[filled:])):
                filled += more
            block = block_hash(algorithm)
            block.update(view[:filled])
            digests.append(block.hexdigest())
            size += filled
    return size, tuple(digests)


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
