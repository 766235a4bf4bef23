"""Connections against a root from a process of their own, whose descriptors do not count
against the root's limit: ``python _flood.py MODE N HOST PORT``.

- ``hold``: waits for a line on stdin, then opens N idle connections and prints ``connected
  N``; then, for each further line, prints ``closed K``: how many of them the root has
  closed. At the end of stdin it closes them all (with a reset, leaving no TIME_WAIT).
- ``scan``: connects and at once closes (a reset) N times, within 60 s, and prints
  ``scanned K``.

127.0.0.1 only: the tests aim it at a root on loopback.
"""

from __future__ import annotations

import contextlib
import errno
import resource
import socket
import struct
import sys
import time

_LINGER_RESET = struct.pack("ii", 1, 0)
_SCAN_DEADLINE = 60.0


def _close_with_reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError as exc:
        return exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN)


def _raise_own_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def hold(n: int, address: tuple[str, int]) -> None:
    _raise_own_limit(n)
    sys.stdin.readline()
    with contextlib.ExitStack() as stack:
        socks = []
        for _ in range(n):
            sock = socket.create_connection(address, timeout=10)
            stack.callback(_close_with_reset, sock)
            sock.setblocking(False)  # a timeout would make each look below wait for data
            socks.append(sock)
        print(f"connected {len(socks)}", flush=True)
        for _ in sys.stdin:
            print(f"closed {sum(_closed_by_peer(sock) for sock in socks)}", flush=True)


def scan(n: int, address: tuple[str, int]) -> None:
    deadline = time.monotonic() + _SCAN_DEADLINE
    done = 0
    while done < n and time.monotonic() < deadline:
        sock = socket.socket()
        try:
            sock.settimeout(5)
            sock.connect(address)
            done += 1
        finally:
            _close_with_reset(sock)
    print(f"scanned {done}", flush=True)


if __name__ == "__main__":
    mode, count, host, port = sys.argv[1:5]
    assert host.startswith("127."), "loopback only"
    {"hold": hold, "scan": scan}[mode](int(count), (host, int(port)))
