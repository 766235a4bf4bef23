"""Writing files block by block on a pool of threads, checksummed, flushed as they go.

Every ``BLOCK_BYTES`` block of every file is one task: checksum the block's pieces straight
from the tensors' memory, ``pwritev`` them at the block's offset (no intermediate copy),
then start the kernel's writeback of that range. The pool runs as many blocks at once as
there are threads, so checksums, copies into the page cache and the disk all work in
parallel; the fsync of every file at the end finds little left to flush. The calling
thread only plans the blocks, calls ``check`` between them (cancellation) and waits.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import attrs
import torch

from ._files import block_hash, start_writeback
from ._format import BLOCK_BYTES, FileRecord

__all__ = ["PlannedFile", "Source", "write_planned"]

_IOV_MAX = 512
"""At most this many buffers per ``pwritev`` call (POSIX guarantees 16, Linux takes 1024)."""
_ZEROS = memoryview(bytes(BLOCK_BYTES))

Source = bytes | torch.Tensor


@attrs.frozen(kw_only=True, eq=False)
class PlannedFile:
    """A file to write: its size and what goes where; the gaps are zeros."""

    name: str
    size: int
    parts: tuple[tuple[int, Source], ...]
    """``(offset, bytes or tensor)`` in increasing, non-overlapping order."""


def _host_bytes(source: Source) -> memoryview:
    """The bytes of ``source``: a view of a CPU tensor's memory, a copy of any other's."""
    if isinstance(source, bytes):
        return memoryview(source)
    tensor = source.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.numel() == 0:
        return memoryview(b"")
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data  # the view keeps the (host copy of the) tensor alive


def _blocks(plan: PlannedFile) -> Iterator[list[memoryview]]:
    """The pieces of every block of ``plan``, in order; tensors are read only when reached."""
    pieces: list[memoryview] = []
    filled = 0  # bytes in the current block
    position = 0  # bytes of the file planned so far

    def spans(view: memoryview) -> Iterator[list[memoryview]]:
        nonlocal pieces, filled, position
        offset = 0
        while offset < len(view):
            piece = view[offset : offset + min(BLOCK_BYTES - filled, len(view) - offset)]
            pieces.append(piece)
            filled += len(piece)
            offset += len(piece)
            position += len(piece)
            if filled == BLOCK_BYTES:
                yield pieces
                pieces, filled = [], 0

    for offset, source in plan.parts:
        if offset < position:
            raise ValueError(f"{plan.name}: part at {offset} overlaps the one before")
        yield from spans(_ZEROS[: offset - position])
        yield from spans(_host_bytes(source))
    if position > plan.size:
        raise ValueError(f"{plan.name}: parts end at {position}, past the size {plan.size}")
    while position < plan.size:
        yield from spans(_ZEROS[: min(BLOCK_BYTES, plan.size - position)])
    if pieces:
        yield pieces


def _pwrite_all(fd: int, pieces: Sequence[memoryview], offset: int) -> None:
    remaining = [piece for piece in pieces if len(piece)]
    while remaining:
        batch = remaining[:_IOV_MAX]
        written = os.pwritev(fd, batch, offset)
        if written <= 0:
            raise OSError(f"pwritev wrote {written} bytes")
        offset += written
        consumed = 0
        while consumed < len(batch) and written >= len(batch[consumed]):
            written -= len(batch[consumed])
            consumed += 1
        remaining = remaining[consumed:]
        if written:
            remaining[0] = remaining[0][written:]


def _write_block(fd: int, offset: int, pieces: list[memoryview], algorithm: str) -> str:
    checksum = block_hash(algorithm)
    for piece in pieces:
        checksum.update(piece)
    _pwrite_all(fd, pieces, offset)
    start_writeback(fd, offset, sum(len(piece) for piece in pieces))
    return checksum.hexdigest()


def write_planned(
    directory: Path,
    plans: Sequence[PlannedFile],
    *,
    check: Callable[[], None],
    pool: ThreadPoolExecutor,
    window: int,
    algorithm: str,
) -> list[FileRecord]:
    """Create, fill and fsync every planned file in ``directory``; their records.

    At most ``window`` blocks are in flight (so at most that many blocks of tensors not on
    the CPU are copied to host memory at once). ``check`` runs on the calling thread before
    every block and after every wait; what it raises aborts the write: the blocks not
    started are dropped, those running are waited for, every file is closed, and the
    exception propagates (the caller removes the files). OSError from any write or fsync
    propagates the same way.
    """
    fds: list[int] = []
    in_flight: collections.deque[Future[str]] = collections.deque()
    digests: list[list[Future[str]]] = []
    try:
        for plan in plans:
            fd = os.open(directory / plan.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            fds.append(fd)
            futures: list[Future[str]] = []
            digests.append(futures)
            for index, pieces in enumerate(_blocks(plan)):
                check()
                while len(in_flight) >= window:
                    in_flight.popleft().result()
                    check()
                future = pool.submit(_write_block, fd, index * BLOCK_BYTES, pieces, algorithm)
                in_flight.append(future)
                futures.append(future)
        while in_flight:
            in_flight.popleft().result()
            check()
        for _ in pool.map(os.fsync, fds):  # at once: a journalling file system batches them
            pass
    finally:
        for future in in_flight:
            future.cancel()
        for future in in_flight:
            if not future.cancelled():
                future.exception()  # wait: its pieces point into the tensors
        for fd in fds:
            os.close(fd)
    return [
        FileRecord(
            name=plan.name,
            size=plan.size,
            digests=tuple(future.result() for future in futures),
        )
        for plan, futures in zip(plans, digests, strict=True)
    ]
