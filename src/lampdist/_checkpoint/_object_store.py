"""Checkpoints in object stores (S3, GCS, Azure) through obstore: the local format, uploaded.

Every file of a checkpoint goes to ``<prefix>/epoch-000012/`` (``epoch-000012.1`` and up when
the same epoch is written again) under the name and with the bytes it has in a local
checkpoint directory, ``manifest.json`` included: a directory copied up with ``aws s3 sync``
loads from the store, and one copied down loads from disk.

The commit protocol (there is no rename in an object store): every file is uploaded first,
each a single atomic PUT or multipart upload; the manifest is uploaded last and is the commit.
A checkpoint counts only once its manifest object exists, and loads only when every file
matches the manifest's sizes and block checksums (a damaged one is skipped with a WARNING).
Only after the commit are superseded and surplus checkpoints deleted, each manifest first
and its files after it, so a crash mid-delete leaves files without a manifest: leftovers,
like those of a killed writer, which the next writer deletes (those named up to the name it
writes). An abort (``check`` raising, an upload failing) uploads no manifest and deletes
what it uploaded. There is no lock: one writer per prefix.

The client (deadlines, retries, part sizes, options) is in :mod:`._store_client`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from .._errors import CheckpointError, Phase
from .._state import TrainingState
from ._block_writer import PlannedFile, _blocks
from ._files import block_hash, write_file
from ._format import MANIFEST, WRITE_CHECKSUM, CheckpointName, FileRecord, manifest_to_bytes
from ._read import Loaded, Stream, read_newest
from ._rng import RngStates
from ._shards import SHARDS, ShardedState, check_every_rank_wrote, write_rank_shards
from ._store_client import (
    READ_CHUNK,
    clean_up,
    failed,
    file_pieces,
    is_url,
    obstore_module,
    open_store,
    put,
    remove,
    remove_leftovers,
    scan,
    store_errors,
)
from ._torch_io import save_tensors
from ._write import (
    PlannedFiles,
    name_to_write,
    plan_files,
    refuse_unwritable,
    state_json,
    superseded,
)

__all__ = [
    "StoreFiles",
    "check_store_writable",
    "is_url",
    "local_shards",
    "new_store_shards",
    "read_latest_from_store",
    "store_checkpoints",
    "upload_rank_shards",
    "write_to_store",
]

_log = logging.getLogger("lampdist.checkpoint")


def store_checkpoints(
    url: str, options: Mapping[str, str] | None, *, phase: Phase
) -> list[StoreFiles]:
    """The committed checkpoints under ``url``, newest first."""
    url = url.rstrip("/")
    store = open_store(url, options)
    listing = scan(store, url, phase)
    return [StoreFiles(store=store, url=url, checkpoint=name.name) for name in listing.committed()]


# ---------------------------------------------------------------------------------------------
# writing


def write_to_store(
    url: str,
    training_state: TrainingState,
    lr_state: Any,
    rng: RngStates,
    *,
    keep: int,
    check: Callable[[], None],
    options: Mapping[str, str] | None,
) -> str:
    """Commit one checkpoint of ``training_state`` under ``url``; its URL. Blocks.

    ``check`` is called between pieces and parts until the commit and raises to abort
    (cancellation): nothing is committed, and what was uploaded is deleted (as far as the
    store lets). Raises CheckpointError (naming the object and the cause) when a file cannot
    be uploaded, for a sharded state, and for an epoch older than the newest one there;
    ConfigError for bad ``options`` or without obstore.
    """
    started = time.perf_counter()
    url = url.rstrip("/")
    epoch = training_state.loop_state.epoch
    if epoch < 0:
        raise CheckpointError(f"cannot checkpoint a negative epoch {epoch}", phase="checkpoint")
    shards = training_state.shards
    files = plan_files(training_state, rng, state_json(training_state, lr_state, rng))
    store = open_store(url, options)
    listing = scan(store, url, "checkpoint")
    if shards is None:
        name = name_to_write(listing.committed(), epoch, url, kind="prefix")
        remove_leftovers(store, url, listing, up_to=name)
    else:  # the ranks uploaded their shards where new_store_shards said
        name = _shards_name(url, shards)
    uploaded: list[str] = [] if shards is None else list(_shard_keys(name, shards))
    committed = False
    try:
        if shards is not None:
            _verify_shards(store, url, name, shards)
        records = _upload_files(store, url, name.name, files, check, uploaded)
        manifest = manifest_to_bytes(records)
        check()  # the last point at which a cancellation aborts the write
        uploaded.insert(0, f"{name.name}/{MANIFEST}")  # a failed PUT may have landed: first
        put(store, url, f"{name.name}/{MANIFEST}", [manifest], len(manifest))
        committed = True
    finally:
        if not committed:
            clean_up(url, options, uploaded)
    try:
        for doomed in superseded([*listing.committed(), name], name, keep=keep):
            remove(store, url, doomed)
    except CheckpointError as exc:
        _log.warning("could not remove old checkpoints from %s: %s", url, exc.message)
    target = f"{url}/{name.name}"
    _log.info(
        "checkpoint %s written (%.1f MB in %.2f s)",
        target,
        sum(record.size for record in records) / 1e6,
        time.perf_counter() - started,
        extra={"epoch": epoch},
    )
    return target


def new_store_shards(
    url: str,
    epoch: int,
    nranks: int,
    precision: Mapping[str, Any],
    options: Mapping[str, str] | None,
) -> ShardedState:
    """Where the ranks upload their shards of the checkpoint of ``epoch`` (the ``shards``
    prefix of the name it will be committed under; leftovers up to that name are removed
    first), for :func:`write_to_store` to commit."""
    url = url.rstrip("/")
    store = open_store(url, options)
    listing = scan(store, url, "checkpoint")
    name = name_to_write(listing.committed(), epoch, url, kind="prefix")
    remove_leftovers(store, url, listing, up_to=name)
    return ShardedState(
        path=f"{url}/{name.name}/{SHARDS}", nranks=nranks, precision=precision, options=options
    )


def _shards_name(url: str, shards: ShardedState) -> CheckpointName:
    """The checkpoint name that :func:`new_store_shards` chose for ``shards``."""
    path = str(shards.path)
    checkpoint, _, leaf = path.rpartition("/")
    base, _, last = checkpoint.rpartition("/")
    name = CheckpointName.parse(last)
    if leaf != SHARDS or base != url or name is None:
        raise CheckpointError(
            f"the shards at {path} are not a checkpoint's of {url}", phase="checkpoint"
        )
    return name


def _shard_keys(name: CheckpointName, shards: ShardedState) -> Iterator[str]:
    for record in shards.records:
        yield f"{name.name}/{record.name}"


def _verify_shards(store: Any, url: str, name: CheckpointName, shards: ShardedState) -> None:
    """Raise CheckpointError unless every rank's shard files are there with the sizes its
    records say (their bytes are checked against the records' checksums when read)."""
    obstore = obstore_module()
    prefix = f"{name.name}/{SHARDS}"
    try:
        sizes = {
            meta["path"]: int(meta["size"])
            for chunk in obstore.list(store, prefix)
            for meta in chunk
        }
    except store_errors(obstore) as exc:
        raise failed("list", f"{url}/{prefix}", exc, "checkpoint") from exc
    check_every_rank_wrote(shards)
    for record in shards.records:
        key = f"{name.name}/{record.name}"
        if sizes.get(key) != record.size:
            raise CheckpointError(
                f"{url}/{key} is not what its rank uploaded ({sizes.get(key)} bytes, not "
                f"{record.size})",
                phase="checkpoint",
            )


def upload_rank_shards(
    shards: ShardedState, module: Any, optimizer: Any, *, rank: int
) -> list[FileRecord]:
    """Write this rank's shards (a collective: every rank calls it) into a scratch
    directory, upload its own files to ``shards.path`` and remove the scratch; their
    records, named relative to the checkpoint."""
    checkpoint = str(shards.path).rpartition("/")[0]
    with tempfile.TemporaryDirectory(prefix="lampdist-shards-") as scratch:
        records = write_rank_shards(Path(scratch), module, optimizer, rank=rank)
        try:
            store = open_store(checkpoint, shards.options)
            for record in records:
                pieces = file_pieces(Path(scratch) / record.name, _no_check)
                put(store, checkpoint, record.name, pieces, record.size)
        except CheckpointError as exc:
            raise CheckpointError(exc.message, rank=rank, phase="checkpoint") from exc
    return records


def _no_check() -> None:
    pass


@contextlib.contextmanager
def local_shards(path: Path | str, options: Mapping[str, str] | None) -> Iterator[Path]:
    """The shards at ``path`` in a local directory: ``path`` itself, or a scratch directory
    the shards of an object store's checkpoint are downloaded into (removed afterwards).
    Raises CheckpointError (phase ``resume``) when a download fails."""
    if not is_url(path):
        yield Path(path)
        return
    url = str(path).rstrip("/")
    obstore = obstore_module()
    with tempfile.TemporaryDirectory(prefix="lampdist-shards-") as scratch:
        target = Path(scratch) / SHARDS
        target.mkdir()
        store = open_store(url, options)
        try:
            keys = [meta["path"] for chunk in obstore.list(store) for meta in chunk]
            for key in keys:
                destination = target / key
                if destination.parent != target:
                    raise CheckpointError(f"{url}/{key} is no shard file", phase="resume")
                with open(destination, "wb") as file:
                    for chunk in obstore.get(store, key).stream(min_chunk_size=READ_CHUNK):
                        file.write(memoryview(chunk))
        except store_errors(obstore) as exc:
            raise failed("download", url, exc, "resume") from exc
        yield target


def _upload_files(
    store: Any,
    url: str,
    prefix: str,
    files: PlannedFiles,
    check: Callable[[], None],
    uploaded: list[str],
) -> list[FileRecord]:
    """Upload every file of ``files`` under ``prefix`` (adding each key to ``uploaded`` as
    it starts); their records, in the order the local writer lists them."""
    records = []
    for plan in files.tensor_files:
        uploaded.append(f"{prefix}/{plan.name}")
        records.append(_upload_planned(store, url, f"{prefix}/{plan.name}", plan, check))
    if files.fallbacks:
        with (
            tempfile.TemporaryDirectory(prefix="lampdist-checkpoint-") as scratch,
            ThreadPoolExecutor(2, thread_name_prefix="lampdist-checkpoint") as pool,
        ):
            for filename, value in files.fallbacks:
                path = Path(scratch) / filename
                save = functools.partial(save_tensors, value)
                record = write_file(path, save, check=check, pool=pool, algorithm=WRITE_CHECKSUM)
                uploaded.append(f"{prefix}/{filename}")
                put(store, url, f"{prefix}/{filename}", file_pieces(path, check), record.size)
                records.append(record)
    return records


def _upload_planned(
    store: Any, url: str, key: str, plan: PlannedFile, check: Callable[[], None]
) -> FileRecord:
    """Upload one planned file straight from the tensors' memory; its record (the block
    checksums are computed as the pieces go out)."""
    digests: list[str] = []

    def pieces() -> Iterator[memoryview]:
        for block in _blocks(plan):
            checksum = block_hash(WRITE_CHECKSUM)
            for piece in block:
                check()
                checksum.update(piece)
                if len(piece):
                    yield piece
            digests.append(checksum.hexdigest())

    put(store, url, key, pieces(), plan.size)
    return FileRecord(name=plan.name, size=plan.size, digests=tuple(digests))


def check_store_writable(
    url: str, next_epoch: int, *, resumed: bool, options: Mapping[str, str] | None
) -> None:
    """Refuse, before training, a run whose checkpoints ``url`` cannot take: the rules of
    :func:`~lampdist._checkpoint._write.check_writable`. Raises CheckpointError (also when
    the store cannot be listed) and ConfigError."""
    url = url.rstrip("/")
    store = open_store(url, options)
    existing = scan(store, url, "configure").committed()
    refuse_unwritable(existing, url, next_epoch, resumed=resumed, kind="prefix")


# ---------------------------------------------------------------------------------------------
# reading


def read_latest_from_store(
    url: str, *, map_location: Any, options: Mapping[str, str] | None
) -> Loaded | None:
    """The newest intact checkpoint under ``url``, or None when there is none; damaged ones
    are skipped with a WARNING log. Raises as :func:`~lampdist._checkpoint.read_latest`
    does, and CheckpointError when the store fails."""
    url = url.rstrip("/")
    listed = functools.partial(store_checkpoints, url, options, phase="resume")
    return read_newest(url, listed, map_location=map_location)


@attrs.frozen(kw_only=True, eq=False)
class StoreFiles:
    """The files of a checkpoint in an object store (a ``CheckpointFiles``)."""

    store: Any
    url: str
    """The prefix's URL."""
    checkpoint: str
    """``epoch-000012``."""

    @property
    def name(self) -> str:
        return self.checkpoint

    @property
    def location(self) -> str:
        return f"{self.url}/{self.checkpoint}"

    @property
    def directory(self) -> None:
        return None

    def read(self, name: str) -> bytes:
        with self._translated(name):
            return bytes(obstore_module().get(self.store, f"{self.checkpoint}/{name}").bytes())

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[tuple[int, Stream]]:
        with self._translated(name):
            result = obstore_module().get(self.store, f"{self.checkpoint}/{name}")
        size = int(result.meta["size"])
        yield size, _Download(result.stream(min_chunk_size=READ_CHUNK), self, name)

    def committed(self) -> bool:
        obstore = obstore_module()
        try:
            with self._translated(MANIFEST):
                obstore.head(self.store, f"{self.checkpoint}/{MANIFEST}")
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def _translated(self, name: str) -> Iterator[None]:
        """obstore's errors as CheckpointFiles raises them."""
        obstore = obstore_module()
        where = f"{self.location}/{name}"
        try:
            yield
        except FileNotFoundError as exc:  # what obstore raises for a missing object
            raise FileNotFoundError(errno.ENOENT, "no such object", where) from exc
        except store_errors(obstore) as exc:
            raise failed("read", where, exc, "resume") from exc


class _Download:
    """A GET's body as a :class:`Stream`."""

    def __init__(self, chunks: Iterator[Any], files: StoreFiles, name: str) -> None:
        self._chunks = chunks
        self._files = files
        self._name = name
        self._current = memoryview(b"")

    def readinto(self, buffer: memoryview, /) -> int:
        filled = 0
        while filled < len(buffer):
            if not self._current:
                with self._files._translated(self._name):
                    chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._current = memoryview(chunk).cast("B")
                continue
            count = min(len(buffer) - filled, len(self._current))
            buffer[filled : filled + count] = self._current[:count]
            self._current = self._current[count:]
            filled += count
        return filled

    def read(self, size: int = -1, /) -> bytes:
        if size < 0:
            parts = []
            while chunk := self.read(READ_CHUNK):
                parts.append(chunk)
            return b"".join(parts)
        buffer = bytearray(size)
        count = self.readinto(memoryview(buffer))
        return bytes(buffer[:count])
