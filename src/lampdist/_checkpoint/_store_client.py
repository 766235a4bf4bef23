"""The object store client of checkpoints in object stores (obstore): opening a store from a
URL and options, uploads, deletes, listing the checkpoint names under a prefix, and errors that
name the object without leaking a signed URL.

Client settings, and why:

- Uploads: files larger than a part as multipart uploads of ``PART_BYTES`` (16 MiB, the
  manifest's block size; more for files over ~150 GiB, to stay under S3's 10,000 parts)
  parts, ``MAX_CONCURRENCY`` (8) at once: 128 MiB of parts in flight, enough to fill a link
  of several Gbit/s; smaller ones as one PUT.
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

import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .._errors import CheckpointError, ConfigError, Phase
from ._format import BLOCK_BYTES, MANIFEST, CheckpointName

if TYPE_CHECKING:
    from obstore.store import ClientConfig, ObjectStore, RetryConfig

__all__ = [
    "CONNECT_TIMEOUT",
    "MAX_CONCURRENCY",
    "MAX_RETRIES",
    "PART_BYTES",
    "READ_CHUNK",
    "REQUEST_TIMEOUT",
    "RETRY_TIMEOUT",
    "Listing",
    "clean_up",
    "delete",
    "failed",
    "file_pieces",
    "first_line",
    "is_url",
    "obstore_module",
    "open_store",
    "part_bytes",
    "put",
    "remove",
    "remove_leftovers",
    "scan",
    "store_errors",
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
READ_CHUNK = 8 << 20
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


def obstore_module() -> Any:
    try:
        import obstore
    except ImportError:
        raise ConfigError(
            'checkpoints in object stores need obstore: pip install "lampdist[object-store]"',
            phase="configure",
        ) from None
    return obstore


def open_store(url: str, options: Mapping[str, str] | None, *, retries: int | None = None) -> Any:
    """The obstore store of ``url`` (its path the prefix of every key).

    Raises ConfigError for a bad URL or option (naming the URL, never an option's value).
    """
    obstore = obstore_module()
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
    except store_errors(obstore) as exc:
        raise ConfigError(f"cannot open {url}: {first_line(exc)}", phase="configure") from exc
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


def store_errors(obstore: Any) -> tuple[type[Exception], ...]:
    """What obstore raises for a failed request (FileNotFoundError for a missing object)."""
    return (obstore.exceptions.BaseError, OSError)


def first_line(exc: BaseException) -> str:
    """An obstore error's first line (the rest is a debug dump), without query strings."""
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return _QUERY.sub(r"\1?...", line)[:500]


def failed(what: str, where: str, exc: BaseException, phase: Phase) -> CheckpointError:
    return CheckpointError(f"could not {what} {where}: {first_line(exc)}", phase=phase)


# ---------------------------------------------------------------------------------------------
# listing


@attrs.frozen(kw_only=True)
class Listing:
    """What is under a prefix: the keys of each ``epoch-*`` name."""

    keys: dict[CheckpointName, tuple[str, ...]]

    def committed(self) -> list[CheckpointName]:
        """Those with a manifest, newest first."""
        found = [n for n, keys in self.keys.items() if f"{n.name}/{MANIFEST}" in keys]
        return sorted(found, reverse=True)

    def leftovers(self) -> list[CheckpointName]:
        """Those without a manifest: an interrupted write's or an interrupted removal's."""
        return sorted(set(self.keys) - set(self.committed()))


def scan(store: Any, url: str, phase: Phase) -> Listing:
    obstore = obstore_module()
    keys: dict[CheckpointName, list[str]] = {}
    try:
        for chunk in obstore.list(store):
            for meta in chunk:
                key = meta["path"]
                head, separator, _ = key.partition("/")
                name = CheckpointName.parse(head)
                if separator and name is not None:
                    keys.setdefault(name, []).append(key)
    except store_errors(obstore) as exc:
        raise failed("list the checkpoints in", url, exc, phase) from exc
    return Listing(keys={name: tuple(found) for name, found in keys.items()})


def delete(store: Any, url: str, keys: Iterable[str]) -> None:
    obstore = obstore_module()
    keys = list(keys)
    if not keys:
        return
    try:
        obstore.delete(store, keys)
    except store_errors(obstore) as exc:
        raise failed("delete", f"{url}/{keys[0]}", exc, "checkpoint") from exc


def remove(store: Any, url: str, name: CheckpointName) -> None:
    """Delete a checkpoint: its manifest first (it is no longer committed), then the rest."""
    obstore = obstore_module()
    delete(store, url, [f"{name.name}/{MANIFEST}"])
    try:
        keys = [meta["path"] for chunk in obstore.list(store, name.name) for meta in chunk]
    except store_errors(obstore) as exc:
        raise failed("list", f"{url}/{name.name}", exc, "checkpoint") from exc
    delete(store, url, keys)


def remove_leftovers(store: Any, url: str, listing: Listing, *, up_to: CheckpointName) -> None:
    """Delete the leftovers (names without a manifest) up to ``up_to``: what interrupted
    writes and removals left."""
    for leftover in listing.leftovers():
        if leftover <= up_to:
            _log.info("removing leftover %s/%s of an interrupted checkpoint", url, leftover.name)
            delete(store, url, listing.keys[leftover])


def file_pieces(path: Path, check: Callable[[], None]) -> Iterator[bytes]:
    with open(path, "rb") as file:
        while piece := file.read(BLOCK_BYTES):
            check()
            yield piece


def part_bytes(size: int) -> int:
    """The part size for a file of ``size`` bytes: at least PART_BYTES, whole MiB."""
    needed = -(-size // _MAX_PARTS)
    return max(PART_BYTES, -(-needed // (1 << 20)) << 20)


def put(store: Any, url: str, key: str, pieces: Iterable[bytes | memoryview], size: int) -> None:
    """Upload ``size`` bytes to ``key``: one PUT up to a part, a multipart upload above.

    What ``pieces`` raises (``check``'s abort) propagates and aborts a multipart upload;
    a failed upload raises CheckpointError naming the object.
    """
    obstore = obstore_module()
    part = part_bytes(size)
    try:
        obstore.put(
            store,
            key,
            iter(pieces),
            use_multipart=size > part,
            chunk_size=part,
            max_concurrency=MAX_CONCURRENCY,
        )
    except store_errors(obstore) as exc:
        raise failed("upload", f"{url}/{key}", exc, "checkpoint") from exc


def clean_up(url: str, options: Mapping[str, str] | None, keys: list[str]) -> None:
    """Best effort: delete what an aborted write uploaded (manifest first), retrying little
    (the store may be what failed)."""
    if not keys:
        return
    try:
        store = open_store(url, options, retries=1)
        delete(store, url, keys[:1])
        delete(store, url, keys[1:])
    except Exception as exc:
        _log.warning(
            "could not remove the files of an aborted checkpoint from %s (%s): the next "
            "write removes them",
            url,
            exc.message if isinstance(exc, CheckpointError) else first_line(exc),
        )
