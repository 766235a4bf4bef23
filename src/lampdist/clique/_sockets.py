"""A Gloo group's TCP connections, found when the group is built and shut down to end it.

Gloo has no abort that frees a collective in flight: ``ProcessGroupGloo.abort()`` returns,
and a collective waiting on a peer that is alive but silent (a stopped process, a machine
gone without closing its connections) stays blocked until its own timeout. What frees it at
once is the connection ending: Gloo's pair then fails every operation on it with "connection
closed by peer", on this rank and, because the shutdown reaches the peer as an end of stream,
on the rank at the other end too (a stalled rank that wakes up finds out at its first read).

So a clique notes the TCP connections that its Gloo group opened (the connected sockets of
this process that appear while the group is built; the ranks of a clique are all in the
group's construction then, so whatever else a rank of the same process opens meanwhile is a
socket pair, not a TCP connection) and, when it is aborted, shuts them down
with ``shutdown(SHUT_RDWR)``, which ends the connections without closing the descriptors
(Gloo still owns and closes them). Each descriptor is noted with its inode: a descriptor
whose inode changed was closed by Gloo and reused for another socket, and is left alone.

Linux and macOS list a process's descriptors (``/proc/self/fd``, ``/dev/fd``); elsewhere
nothing is noted and an abort falls back to the group's own timeout.

Known limit: a TCP connection that other code of this process opens while the group is
built (another clique built at the same time, an HTTP request accepted by a service that
embeds lampdist) is noted too, and an abort of this clique would shut it down. Keeping only
the connections of the group's own Gloo listeners would end that; it is not done yet.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import attrs

__all__ = ["TransportSockets", "noting_sockets"]

logger = logging.getLogger(__name__)

_FD_DIRECTORIES = ("/proc/self/fd", "/dev/fd")
_TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def _descriptors() -> list[int]:
    for directory in _FD_DIRECTORIES:
        try:
            return [int(name) for name in os.listdir(directory)]
        except (OSError, ValueError):
            continue
    return []


def _socket_inodes() -> dict[int, int]:
    """This process's socket descriptors with their inodes."""
    found: dict[int, int] = {}
    for fd in _descriptors():
        try:
            info = os.fstat(fd)
        except OSError:  # closed meanwhile, or the directory's own descriptor
            continue
        if stat.S_ISSOCK(info.st_mode):
            found[fd] = info.st_ino
    return found


def _is_connected_tcp(fd: int, inode: int) -> bool:
    """Whether ``fd`` is still the socket ``inode`` and a connected TCP socket. Another
    thread of this process (another clique's rank being built or ended) may close the
    descriptor, or close it and open another, between the listing and this probe."""
    try:
        probe = socket.socket(fileno=fd)
    except OSError:  # closed meanwhile, or reused for what is not a socket
        return False
    try:
        if os.fstat(fd).st_ino != inode:
            return False  # closed and reused for another socket meanwhile
        probe.getpeername()  # raises for a listener or an unconnected socket
    except OSError:
        return False
    else:  # TCP only: a socketpair of another rank of this process is none of Gloo's
        return probe.type == socket.SOCK_STREAM and probe.family in _TCP_FAMILIES
    finally:
        probe.detach()  # the descriptor stays open: it is not ours


@attrs.define(eq=False)
class TransportSockets:
    """The connected sockets a Gloo group opened, by descriptor and inode."""

    sockets: dict[int, int] = attrs.field(factory=dict)

    def shut_down(self) -> int:
        """End every noted connection that is still the one noted; how many were shut down.
        Idempotent; never raises (the group may be ending on its own meanwhile)."""
        ended = 0
        for fd, inode in self.sockets.items():
            try:
                if os.fstat(fd).st_ino != inode:
                    continue  # Gloo closed it and the number was reused
                probe = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                probe.shutdown(socket.SHUT_RDWR)
                ended += 1
            except OSError:
                pass  # not connected any more
            finally:
                probe.detach()
        self.sockets = {}
        return ended


@contextmanager
def noting_sockets(into: Callable[[TransportSockets], None]) -> Iterator[None]:
    """Hand ``into`` the connected sockets that appear in this process while the block runs
    (a Gloo group's construction, which connects every pair before it returns)."""
    before = _socket_inodes()
    yield
    new = {
        fd: inode
        for fd, inode in _socket_inodes().items()
        if before.get(fd) != inode and _is_connected_tcp(fd, inode)
    }
    into(TransportSockets(new))
