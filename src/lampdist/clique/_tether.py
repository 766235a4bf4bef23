"""Liveness of the ranks: a star of plain TCP connections between rank 0 and every other rank.

The process groups cannot say that a peer died: Gloo reports a closed connection only to an
operation waiting on that very peer, NCCL not at all. So every clique opening also ties each
follower to rank 0 with one TCP connection. A peer that leaves cleanly writes a goodbye byte
before it closes; end-of-stream without a goodbye means its process died (or left abnormally,
in which case it also posted an abort notice). The watcher thread of the group selects on
these sockets; rank 0 relays a follower's death to the others through the store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import attrs

from .._errors import CliqueError
from .._store import POLL, wait_for_keys

__all__ = ["GOODBYE", "Tether"]

logger = logging.getLogger(__name__)

GOODBYE = b"B"
_KEY = "tether"
_HELLO = struct.Struct("!I32s")  # rank, token


def _local_address_towards(host: str, port: int) -> str:
    """The address of this machine on the route to ``host`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
        except OSError:
            return socket.gethostbyname(socket.gethostname())
        return str(probe.getsockname()[0])


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        data += chunk
    return data


@attrs.define(eq=False)
class Tether:
    """This rank's end of the star: peer rank -> socket (rank 0 holds one per follower)."""

    sockets: dict[int, socket.socket]

    @classmethod
    def connect(
        cls,
        *,
        keys: Any,
        rank: int,
        nranks: int,
        host: str,
        port: int,
        remaining: Callable[[], timedelta],
    ) -> Tether:
        """Tie this rank to rank 0 (blocking; ``remaining()`` gives the setup time left as a
        :class:`~datetime.timedelta` and raises once it is spent, or the setup was cancelled
        or abandoned by a peer: the waits here are short slices that call it)."""
        if nranks == 1:
            return cls(sockets={})
        if rank == 0:
            return cls._serve(keys=keys, nranks=nranks, host=host, port=port, remaining=remaining)
        wait_for_keys(keys, [_KEY], remaining)  # in slices: remaining() notices cancellation
        info = json.loads(keys.get(_KEY))
        sock = socket.create_connection(
            (info["host"], info["port"]), timeout=remaining().total_seconds()
        )
        try:
            sock.sendall(_HELLO.pack(rank, bytes.fromhex(info["token"]).ljust(32, b"\0")))
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return cls(sockets={0: sock})

    @classmethod
    def _serve(
        cls, *, keys: Any, nranks: int, host: str, port: int, remaining: Callable[[], timedelta]
    ) -> Tether:
        address = _local_address_towards(host, port)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        token = secrets.token_bytes(32)
        sockets: dict[int, socket.socket] = {}
        with socket.create_server(("", 0), family=family) as listener:
            keys.set(
                _KEY,
                json.dumps(
                    {"host": address, "port": listener.getsockname()[1], "token": token.hex()}
                ),
            )
            try:
                while len(sockets) < nranks - 1:
                    listener.settimeout(min(_seconds(remaining()), POLL))
                    try:
                        sock, _ = listener.accept()
                    except TimeoutError:
                        continue
                    try:
                        sock.settimeout(_seconds(remaining()))
                        peer, offered = _HELLO.unpack(_recv_exactly(sock, _HELLO.size))
                        sock.settimeout(None)
                    except (OSError, struct.error):
                        sock.close()
                        continue
                    if offered != token or not 0 < peer < nranks or peer in sockets:
                        logger.warning("refused a clique liveness connection (rank %s)", peer)
                        sock.close()
                        continue
                    sockets[peer] = sock
            except BaseException:
                for sock in sockets.values():
                    sock.close()
                raise
        return cls(sockets=sockets)

    def await_goodbyes(self, said: set[int], limit: float) -> None:
        """Rank 0, leaving cleanly: wait up to ``limit`` seconds until every follower not in
        ``said`` has said goodbye or closed its end. A follower says goodbye once its clique
        is released, so it no longer reads the clique's store, which this rank's rendezvous
        may close right after (a follower that still polled it would log the store's
        errors)."""
        waiting = {peer: sock for peer, sock in self.sockets.items() if peer not in said}
        deadline = time.monotonic() + limit
        with selectors.DefaultSelector() as selector:
            for peer, sock in waiting.items():
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ, peer)
            while waiting and (left := deadline - time.monotonic()) > 0:
                for key, _ in selector.select(left):
                    try:
                        data = waiting[key.data].recv(64)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if GOODBYE in data or not data:
                        selector.unregister(waiting.pop(key.data))

    def close(self, *, goodbye: bool) -> None:
        """Close every connection, saying goodbye first when leaving cleanly."""
        for sock in self.sockets.values():
            if goodbye:
                with contextlib.suppress(OSError):
                    sock.sendall(GOODBYE)
            sock.close()
        self.sockets.clear()


def _seconds(span: timedelta) -> float:
    if span.total_seconds() <= 0:
        raise CliqueError("no setup time left", phase="clique setup")
    return span.total_seconds()
