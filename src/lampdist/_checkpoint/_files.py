"""Files: hashed and fsynced writes, checksummed reads, the writer lock."""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from .._errors import CheckpointError
from ._format import BLOCK_BYTES, FileRecord

__all__ = [
    "HashingWriter",
    "fsync_directory",
    "hash_file",
    "write_file",
    "writer_lock",
]

_PARALLEL_HASH_BYTES = 1 << 20
"""Pieces at least this size are hashed on the pool while they are being written."""


def _start_writeback_with_fadvise(fd: int, offset: int, length: int) -> None:
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


_fadvise = _start_writeback_with_fadvise if hasattr(os, "posix_fadvise") else None


class HashingWriter:
    """A write-only file object for ``torch.save`` that hashes what it writes.

    Every ``BLOCK_BYTES`` block of the file gets its own sha256, so the blocks of a large
    write are hashed on ``pool``'s threads in parallel while this thread writes them: the
    checksums cost little extra time. ``check`` is called before every block written (it
    raises to abort). An exception in ``write`` is not raised through ``torch.save`` (whose
    cleanup would replace it with a RuntimeError): it is kept in ``failure``, later writes
    are dropped, and :func:`write_file` raises it once ``torch.save`` has returned.
    """

    def __init__(
        self, file: BinaryIO, *, check: Callable[[], None], pool: ThreadPoolExecutor
    ) -> None:
        self._file = file
        self._check = check
        self._pool = pool
        self._blocks: list[Any] = []  # one hashlib.sha256 per block
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
                self._blocks.append(hashlib.sha256())
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
        if done > self._writeback_from and _fadvise is not None:
            _fadvise(self._file.fileno(), self._writeback_from, done - self._writeback_from)
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
) -> FileRecord:
    """Create ``path``, let ``produce`` fill it, fsync it; its size and block checksums."""
    with open(path, "xb") as file:
        writer = HashingWriter(file, check=check, pool=pool)
        try:
            produce(writer)
        finally:
            if writer.failure is not None:
                raise writer.failure
        file.flush()
        os.fsync(file.fileno())
    return FileRecord(name=path.name, size=writer.size, sha256=writer.digests())


def hash_file(path: Path) -> tuple[int, tuple[str, ...]]:
    """The size and the sha256 of every ``BLOCK_BYTES`` block of a file."""
    digests = []
    size = 0
    buffer = bytearray(BLOCK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            filled = count
            while filled < BLOCK_BYTES and (more := file.readinto(view[filled:])):
                filled += more
            digests.append(hashlib.sha256(view[:filled]).hexdigest())
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
