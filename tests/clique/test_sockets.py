"""The Gloo group's connections noted while it is built and shut down when it is aborted,
on real TCP sockets over 127.0.0.1."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lampdist.clique._sockets import TransportSockets, _is_connected_tcp, noting_sockets

pytestmark = pytest.mark.skipif(
    not any(os.path.isdir(d) for d in ("/proc/self/fd", "/dev/fd")),
    reason="needs a listing of the process's descriptors",
)


@contextmanager
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected TCP pair on 127.0.0.1 (the client end first)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    with client, server:
        yield client, server


def noted_while(open_inside: bool) -> tuple[dict[int, int], list[socket.socket]]:
    noted: list[TransportSockets] = []
    kept: list[socket.socket] = []
    with connection() as (old, _):
        with noting_sockets(noted.append):
            listener = socket.create_server(("127.0.0.1", 0))
            pair = socket.socketpair()
            kept += [listener, *pair]
            if open_inside:
                client = socket.create_connection(listener.getsockname())
                server, _ = listener.accept()
                kept += [client, server]
        assert old.fileno() not in noted[0].sockets  # connected before the block
    return noted[0].sockets, kept


def test_the_tcp_connections_opened_in_the_block_are_noted_and_nothing_else() -> None:
    sockets, kept = noted_while(open_inside=True)
    try:
        client, server = kept[3:]  # after the listener and the socket pair
        assert set(sockets) == {client.fileno(), server.fileno()}
        assert sockets[client.fileno()] == os.fstat(client.fileno()).st_ino
    finally:
        for one in kept:
            one.close()
    sockets, kept = noted_while(open_inside=False)
    for one in kept:
        one.close()
    assert sockets == {}  # a listener and a socket pair are none of Gloo's


def test_a_descriptor_closed_before_its_probe_is_not_noted() -> None:
    """Another clique's thread may close a descriptor between the listing and the probe."""
    with connection() as (client, _):
        fd, inode = client.fileno(), os.fstat(client.fileno()).st_ino
        assert _is_connected_tcp(fd, inode)
        client.close()
        assert not _is_connected_tcp(fd, inode)  # no EBADF


def test_a_descriptor_reused_for_another_connection_is_neither_noted_nor_shut_down() -> None:
    with connection() as (first, _):
        fd, inode = first.fileno(), os.fstat(first.fileno()).st_ino
        first.close()
        with connection() as (second, peer):
            if second.fileno() != fd:
                pytest.skip("the descriptor number was not reused")
            assert not _is_connected_tcp(fd, inode)
            assert TransportSockets({fd: inode}).shut_down() == 0
            second.sendall(b"x")
            assert peer.recv(1) == b"x"  # still connected


def test_shutting_down_ends_the_connection_for_the_peer_and_keeps_the_descriptor() -> None:
    with connection() as (client, server):
        noted = TransportSockets({client.fileno(): os.fstat(client.fileno()).st_ino})
        assert noted.shut_down() == 1
        server.settimeout(10)
        assert server.recv(1) == b""  # the peer sees the end of the stream
        os.fstat(client.fileno())  # the descriptor is still open: its owner closes it
        assert noted.shut_down() == 0  # idempotent
