"""The rendezvous store of one run, served by the root."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import anyio
import anyio.to_thread
from torch._C._distributed_c10d import TCPStore  # what torch.distributed re-exports

from .._clique_id import CliqueId
from .._errors import CliqueError, ConfigError, Phase

__all__ = ["serve_rendezvous"]

logger = logging.getLogger(__name__)

_PHASE: Phase = "clique rendezvous"
_STORE_TIMEOUT = timedelta(seconds=30)  # the server's own client; it never waits on peers


@asynccontextmanager
async def serve_rendezvous(
    *, nranks: int, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[CliqueId]:
    """Serve the rendezvous store of one run and yield a :class:`~lampdist.CliqueId` for it.

    Only the root (rank 0) calls this, once per run; it publishes the yielded id over the
    control channel, and every rank (the root included) passes it to
    :func:`~lampdist.clique.open_clique`. Each id carries a fresh random key prefix, so runs
    and cliques never see each other's keys. Keep the context open until every rank has
    closed its clique.

    ``host`` is the address the other ranks dial (the store itself, torch's TCPStore, listens
    on every interface); ``port=0`` picks a free port. The store is not authenticated: bind
    it where only the run's machines can reach it.

    Raises :class:`~lampdist.ConfigError` for a bad ``nranks`` or ``port`` and
    :class:`~lampdist.CliqueError` when the store cannot listen (port in use).
    """
    if nranks < 1:
        raise ConfigError(f"nranks must be at least 1, got {nranks}", rank=0, phase=_PHASE)
    if not 0 <= port < 65536:
        raise ConfigError(
            f"port must be in 0..65535 (0: any free port), got {port}", rank=0, phase=_PHASE
        )
    box: list[Any] = []

    def start() -> int:
        store = TCPStore(host, port, None, True, timeout=_STORE_TIMEOUT, wait_for_workers=False)
        box.append(store)
        return int(store.port)

    def stop() -> None:
        box.clear()  # the last reference: the server closes here

    try:
        bound = await anyio.to_thread.run_sync(start)
    except RuntimeError as exc:
        raise CliqueError(
            f"the rendezvous store cannot listen on port {port}: {exc}", rank=0, phase=_PHASE
        ) from exc
    logger.debug("rendezvous store for %d ranks on %s:%d", nranks, host, bound)
    try:
        yield CliqueId.new(host, bound, nranks=nranks)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stop)
