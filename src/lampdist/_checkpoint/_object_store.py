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

Client settings, and why:

- Uploads: files larger than a part as multipart uploads of ``PART_BYTES`` (16 MiB, the
  manifest's block size; more for files over ~150 GiB, to stay under S3's 10,000 parts)
  parts, ``MAX_CONCURRENCY`` (8) at once: 128 MiB of parts in flight, enough to fill a link
  of several Gbit/s; smaller ones as one PUT. Pieces are fed from the tensors' memory, the
  block checksums computed on the way.
- A deadline per request (``REQUEST_TIMEOUT``, 60 s: one part at 0.3 MB/s) and per connection
  attempt (``CONNECT_TIMEOUT``, 10 s), so a stalled server fails a request instead of hanging.
- Retries (obstore's RetryConfig) of what object stores are known to return transiently
  (5xx, throttling, dropped connections, timeouts) with exponential backoff and jitter from
  0.1 s up to 15 s, at most ``MAX_RETRIES`` (10) times and for at most ``RETRY_TIMEOUT``
  (3 min) per request: the credentials of a request stay valid that long.

``options`` hold the store's settings (obstore's config keys for the URL's store, e.g.
``{"endpoint": ..., "region": ...}``), its client's (obstore's ClientConfig keys, e.g.
``"timeout": "10s"``; they replace the defaults above) and the retries'
(``"max_retries"``, ``"retry_timeout"`` in seconds). Credentials come only from obstore's own
sources (environment variables, configuration files, instance metadata); no option is ever
written into a checkpoint or a log, and error messages drop URLs' query strings (where
signed tokens go).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .._errors import CheckpointError, ConfigError, Phase
from .._state import TrainingState
from ._block_writer import PlannedFile, _blocks
from ._files import block_hash, write_file
from ._format import (
    BLOCK_BYTES,
    MANIFEST,
    WRITE_CHECKSUM,
    CheckpointName,
    FileRecord,
    manifest_to_bytes,
)
from ._read import Loaded, Stream, read_newest
from ._rng import RngStates
from ._shards import SHARDS, ShardedState, write_rank_shards
from ._torch_io import save_tensors
from ._write import (
    PlannedFiles,
    name_to_write,
    plan_files,
    refuse_unwritable,
    state_json,
    superseded,
)

if TYPE_CHECKING:
    from obstore.store import ClientConfig, ObjectStore, RetryConfig

__all__ = [
    "CONNECT_TIMEOUT",
    "MAX_CONCURRENCY",
    "MAX_RETRIES",
    "PART_BYTES",
    "REQUEST_TIMEOUT",
    "RETRY_TIMEOUT",
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

PART_BYTES = BLOCK_BYTES
"""The part size of multipart uploads (S3 needs at least 5 MiB, at most 10,000 parts)."""
MAX_CONCURRENCY = 8
"""Parts of one file uploaded at once."""
REQUEST_TIMEOUT = "60s"
"""The deadline of one request, connection to the end of its body."""
CONNECT_TIMEOUT = "10s"
MAX_RETRIES = 10
RETRY_TIMEOUT = 180.0
"""Seconds after a request's first attempt past which it is not retried."""
_READ_CHUNK = 8 << 20
"""Downloads arrive in chunks of at least this many bytes."""
_MAX_PARTS = 9_000
"""Fewer parts than S3's limit of 10,000, so a file of any size fits."""

_SCHEMES = {
    "s3": "AWS_",
    "s3a": "AWS_",
    "gs": "GOOGLE_",
    "az": "AZURE_",
    "adl": "AZURE_",
    "azure": "AZURE_",
    "abfs": "AZURE_",
    "abfss": "AZURE_",
    "memory": "",
}
"""The URL schemes of object stores, and the prefix of their environment variables."""
_CLIENT_KEYS = frozenset(
    {
        "allow_http",
        "allow_invalid_certificates",
        "connect_timeout",
        "default_content_type",
        "http1_only",
        "http2_keep_alive_interval",
        "http2_keep_alive_timeout",
        "http2_keep_alive_while_idle",
        "http2_only",
        "pool_idle_timeout",
        "pool_max_idle_per_host",
        "proxy_ca_certificate",
        "proxy_excludes",
        "proxy_url",
        "randomize_addresses",
        "read_timeout",
        "root_certificate",
        "timeout",
        "user_agent",
    }
)
"""obstore's ClientConfig keys: given as client options, which replace (not extend) what the
store read from its environment, so those are read here from the same variables."""
_RETRY_KEYS = frozenset({"max_retries", "retry_timeout"})
_MEMORY_STORES: dict[str, ObjectStore] = {}
"""One in-process store per ``memory://`` URL, so that what is written there can be read."""
_QUERY = re.compile(r"(\w+://[^\s?\"']*)\?[^\s\"']*")


def is_url(location: object) -> bool:
    """Whether ``location`` is an object store URL (``s3://``, ``gs://``, ``az://``,
    ``abfs://``, ``memory://``...): False for paths, Path objects and ``file://``."""
    if not isinstance(location, str):
        return False
    scheme, separator, _ = location.partition("://")
    return bool(separator) and scheme.lower() in _SCHEMES


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ConfigError(
            'checkpoints in object stores need obstore: pip install "lampdist[object-store]"',
            phase="configure",
        ) from None
    return obstore


def _open_store(url: str, options: Mapping[str, str] | None, *, retries: int | None = None) -> Any:
    """The obstore store of ``url`` (its path the prefix of every key).

    Raises ConfigError for a bad URL or option (naming the URL, never an option's value).
    """
    obstore = _obstore()
    from obstore.store import from_url

    scheme = url.partition("://")[0].lower()
    if scheme == "memory":
        return _MEMORY_STORES.setdefault(url, from_url("memory://"))
    options = dict(options or {})
    retry = _retry_config(url, options, retries=retries)
    client = _client_options(_SCHEMES[scheme], options)
    config: Any = {k: v for k, v in options.items() if k not in _CLIENT_KEYS | _RETRY_KEYS}
    try:
        return from_url(url, config=config, client_options=client, retry_config=retry)
    except _store_errors(obstore) as exc:
        raise ConfigError(f"cannot open {url}: {_first_line(exc)}", phase="configure") from exc
    except BaseException as exc:  # obstore panics (PanicException) on some keys
        if type(exc).__name__ != "PanicException":
            raise
        raise ConfigError(
            f"cannot open {url}: bad options {sorted(config)}", phase="configure"
        ) from None


def _client_options(prefix: str, options: Mapping[str, str]) -> ClientConfig:
    client: dict[str, Any] = {"timeout": REQUEST_TIMEOUT, "connect_timeout": CONNECT_TIMEOUT}
    for key in sorted(_CLIENT_KEYS):
        value = os.environ.get(f"{prefix}{key.upper()}")
        if value is not None:
            client[key] = value
    client.update({k: v for k, v in options.items() if k in _CLIENT_KEYS})
    for key in ("allow_http", "allow_invalid_certificates", "http1_only", "http2_only"):
        if isinstance(client.get(key), str):
            client[key] = client[key].strip().lower() in ("1", "true", "yes", "on")
    return client  # type: ignore[return-value]  # a TypedDict built from strings


def _retry_config(url: str, options: Mapping[str, str], *, retries: int | None) -> RetryConfig:
    try:
        max_retries = int(options.get("max_retries", MAX_RETRIES))
        retry_timeout = float(options.get("retry_timeout", RETRY_TIMEOUT))
    except ValueError as exc:
        raise ConfigError(
            f"cannot open {url}: max_retries must be an int and retry_timeout seconds ({exc})",
            phase="configure",
        ) from None
    return {
        "max_retries": max_retries if retries is None else min(retries, max_retries),
        "retry_timeout": timedelta(seconds=retry_timeout),
        "backoff": {
            "init_backoff": timedelta(seconds=0.1),
            "max_backoff": timedelta(seconds=15),
            "base": 2,
        },
    }


def _store_errors(obstore: Any) -> tuple[type[Exception], ...]:
    """What obstore raises for a failed request (FileNotFoundError for a missing object)."""
    return (obstore.exceptions.BaseError, OSError)


def _first_line(exc: BaseException) -> str:
    """An obstore error's first line (the rest is a debug dump), without query strings."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return _QUERY.sub(r"\1?...", line)[:500]


def _failed(what: str, where: str, exc: BaseException, phase: Phase) -> CheckpointError:
    return CheckpointError(f"could not {what} {where}: {_first_line(exc)}", phase=phase)


# ---------------------------------------------------------------------------------------------
# listing


@attrs.frozen(kw_only=True)
class _Listing:
    """What is under a prefix: the keys of each ``epoch-*`` name."""

    keys: dict[CheckpointName, tuple[str, ...]]

    def committed(self) -> list[CheckpointName]:
        """Those with a manifest, newest first."""
        found = [n for n, keys in self.keys.items() if f"{n.name}/{MANIFEST}" in keys]
        return sorted(found, reverse=True)

    def leftovers(self) -> list[CheckpointName]:
        """Those without a manifest: an interrupted write's or an interrupted removal's."""
        return sorted(set(self.keys) - set(self.committed()))


def _scan(store: Any, url: str, phase: Phase) -> _Listing:
    obstore = _obstore()
    keys: dict[CheckpointName, list[str]] = {}
    try:
        for chunk in obstore.list(store):
            for meta in chunk:
                key = meta["path"]
                head, separator, _ = key.partition("/")
                name = CheckpointName.parse(head)
                if separator and name is not None:
                    keys.setdefault(name, []).append(key)
    except _store_errors(obstore) as exc:
        raise _failed("list the checkpoints in", url, exc, phase) from exc
    return _Listing(keys={name: tuple(found) for name, found in keys.items()})


def _delete(store: Any, url: str, keys: Iterable[str]) -> None:
    obstore = _obstore()
    keys = list(keys)
    if not keys:
        return
    try:
        obstore.delete(store, keys)
    except _store_errors(obstore) as exc:
        raise _failed("delete", f"{url}/{keys[0]}", exc, "checkpoint") from exc


def _remove(store: Any, url: str, name: CheckpointName) -> None:
    """Delete a checkpoint: its manifest first (it is no longer committed), then the rest."""
    obstore = _obstore()
    _delete(store, url, [f"{name.name}/{MANIFEST}"])
    try:
        keys = [meta["path"] for chunk in obstore.list(store, name.name) for meta in chunk]
    except _store_errors(obstore) as exc:
        raise _failed("list", f"{url}/{name.name}", exc, "checkpoint") from exc
    _delete(store, url, keys)


def store_checkpoints(
    url: str, options: Mapping[str, str] | None, *, phase: Phase
) -> list[StoreFiles]:
    """The committed checkpoints under ``url``, newest first."""
    url = url.rstrip("/")
    store = _open_store(url, options)
    listing = _scan(store, url, phase)
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
    store = _open_store(url, options)
    listing = _scan(store, url, "checkpoint")
    if shards is None:
        name = name_to_write(listing.committed(), epoch, url, kind="prefix")
        _remove_leftovers(store, url, listing, up_to=name)
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
        _put(store, url, f"{name.name}/{MANIFEST}", [manifest], len(manifest))
        committed = True
    finally:
        if not committed:
            _clean_up(url, options, uploaded)
    try:
        for doomed in superseded([*listing.committed(), name], name, keep=keep):
            _remove(store, url, doomed)
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


def _remove_leftovers(store: Any, url: str, listing: _Listing, *, up_to: CheckpointName) -> None:
    """Delete the leftovers (names without a manifest) up to ``up_to``: what interrupted
    writes and removals left."""
    for leftover in listing.leftovers():
        if leftover <= up_to:
            _log.info("removing leftover %s/%s of an interrupted checkpoint", url, leftover.name)
            _delete(store, url, listing.keys[leftover])


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
    store = _open_store(url, options)
    listing = _scan(store, url, "checkpoint")
    name = name_to_write(listing.committed(), epoch, url, kind="prefix")
    _remove_leftovers(store, url, listing, up_to=name)
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
    obstore = _obstore()
    prefix = f"{name.name}/{SHARDS}"
    try:
        sizes = {
            meta["path"]: int(meta["size"])
            for chunk in obstore.list(store, prefix)
            for meta in chunk
        }
    except _store_errors(obstore) as exc:
        raise _failed("list", f"{url}/{prefix}", exc, "checkpoint") from exc
    names = {record.name for record in shards.records}
    if f"{SHARDS}/.metadata" not in names:
        raise CheckpointError("the shards' metadata is missing", phase="checkpoint")
    for rank in range(shards.nranks):
        if not any(n.startswith(f"{SHARDS}/__{rank}_") for n in names):
            raise CheckpointError(f"rank {rank} uploaded no shard", phase="checkpoint")
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
            store = _open_store(checkpoint, shards.options)
            for record in records:
                pieces = _file_pieces(Path(scratch) / record.name, _no_check)
                _put(store, checkpoint, record.name, pieces, record.size)
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
    obstore = _obstore()
    with tempfile.TemporaryDirectory(prefix="lampdist-shards-") as scratch:
        target = Path(scratch) / SHARDS
        target.mkdir()
        store = _open_store(url, options)
        try:
            keys = [meta["path"] for chunk in obstore.list(store) for meta in chunk]
            for key in keys:
                destination = target / key
                if destination.parent != target:
                    raise CheckpointError(f"{url}/{key} is no shard file", phase="resume")
                with open(destination, "wb") as file:
                    for chunk in obstore.get(store, key).stream(min_chunk_size=_READ_CHUNK):
                        file.write(memoryview(chunk))
        except _store_errors(obstore) as exc:
            raise _failed("download", url, exc, "resume") from exc
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
                _put(store, url, f"{prefix}/{filename}", _file_pieces(path, check), record.size)
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

    _put(store, url, key, pieces(), plan.size)
    return FileRecord(name=plan.name, size=plan.size, digests=tuple(digests))


def _file_pieces(path: Path, check: Callable[[], None]) -> Iterator[bytes]:
    with open(path, "rb") as file:
        while piece := file.read(BLOCK_BYTES):
            check()
            yield piece


def _part_bytes(size: int) -> int:
    """The part size for a file of ``size`` bytes: at least PART_BYTES, whole MiB."""
    needed = -(-size // _MAX_PARTS)
    return max(PART_BYTES, -(-needed // (1 << 20)) << 20)


def _put(store: Any, url: str, key: str, pieces: Iterable[bytes | memoryview], size: int) -> None:
    """Upload ``size`` bytes to ``key``: one PUT up to a part, a multipart upload above.

    What ``pieces`` raises (``check``'s abort) propagates and aborts a multipart upload;
    a failed upload raises CheckpointError naming the object.
    """
    obstore = _obstore()
    part = _part_bytes(size)
    try:
        obstore.put(
            store,
            key,
            iter(pieces),
            use_multipart=size > part,
            chunk_size=part,
            max_concurrency=MAX_CONCURRENCY,
        )
    except _store_errors(obstore) as exc:
        raise _failed("upload", f"{url}/{key}", exc, "checkpoint") from exc


def _clean_up(url: str, options: Mapping[str, str] | None, keys: list[str]) -> None:
    """Best effort: delete what an aborted write uploaded (manifest first), retrying little
    (the store may be what failed)."""
    if not keys:
        return
    try:
        store = _open_store(url, options, retries=1)
        _delete(store, url, keys[:1])
        _delete(store, url, keys[1:])
    except Exception as exc:
        _log.warning(
            "could not remove the files of an aborted checkpoint from %s (%s): the next "
            "write removes them",
            url,
            exc.message if isinstance(exc, CheckpointError) else _first_line(exc),
        )


def check_store_writable(
    url: str, next_epoch: int, *, resumed: bool, options: Mapping[str, str] | None
) -> None:
    """Refuse, before training, a run whose checkpoints ``url`` cannot take: the rules of
    :func:`~lampdist._checkpoint._write.check_writable`. Raises CheckpointError (also when
    the store cannot be listed) and ConfigError."""
    url = url.rstrip("/")
    store = _open_store(url, options)
    existing = _scan(store, url, "configure").committed()
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
            return bytes(_obstore().get(self.store, f"{self.checkpoint}/{name}").bytes())

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[tuple[int, Stream]]:
        with self._translated(name):
            result = _obstore().get(self.store, f"{self.checkpoint}/{name}")
        size = int(result.meta["size"])
        yield size, _Download(result.stream(min_chunk_size=_READ_CHUNK), self, name)

    def committed(self) -> bool:
        obstore = _obstore()
        try:
            with self._translated(MANIFEST):
                obstore.head(self.store, f"{self.checkpoint}/{MANIFEST}")
        except FileNotFoundError:
            return False
        return True

    @contextlib.contextmanager
    def _translated(self, name: str) -> Iterator[None]:
        """obstore's errors as CheckpointFiles raises them."""
        obstore = _obstore()
        where = f"{self.location}/{name}"
        try:
            yield
        except FileNotFoundError as exc:  # what obstore raises for a missing object
            raise FileNotFoundError(errno.ENOENT, "no such object", where) from exc
        except _store_errors(obstore) as exc:
            raise _failed("read", where, exc, "resume") from exc


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
            while chunk := self.read(_READ_CHUNK):
                parts.append(chunk)
            return b"".join(parts)
        buffer = bytearray(size)
        count = self.readinto(memoryview(buffer))
        return bytes(buffer[:count])
