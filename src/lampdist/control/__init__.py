"""The control plane: the low-traffic channel that carries the rendezvous (the clique id) and
one command per pass from the root to the followers.

Two implementations behind one pair of protocols, :class:`RootChannel` and
:class:`FollowerChannel`: :func:`local_channels` (in one process, over anyio memory object
streams) and :func:`tcp_root` / :func:`tcp_follower` (over TCP, authenticated with a shared
secret, optionally TLS). See ``docs/control.md``.
"""

from ._command import Command as Command
from ._command import CommandKind as CommandKind
from ._memory import local_channels as local_channels
from ._protocols import DEFAULT_BROADCAST_TIMEOUT as DEFAULT_BROADCAST_TIMEOUT
from ._protocols import DEFAULT_JOIN_TIMEOUT as DEFAULT_JOIN_TIMEOUT
from ._protocols import USE_CHANNEL_DEFAULT as USE_CHANNEL_DEFAULT
from ._protocols import FollowerChannel as FollowerChannel
from ._protocols import RecoverableRootChannel as RecoverableRootChannel
from ._protocols import RootChannel as RootChannel
from ._protocols import UseChannelDefault as UseChannelDefault
from ._settings import DEFAULT_HANDSHAKE_TIMEOUT as DEFAULT_HANDSHAKE_TIMEOUT
from ._settings import DEFAULT_HEARTBEAT_INTERVAL as DEFAULT_HEARTBEAT_INTERVAL
from ._settings import DEFAULT_HEARTBEAT_TIMEOUT as DEFAULT_HEARTBEAT_TIMEOUT
from ._tcp_follower import TcpFollowerChannel as TcpFollowerChannel
from ._tcp_follower import tcp_follower as tcp_follower
from ._tcp_root import TcpRootChannel as TcpRootChannel
from ._tcp_root import tcp_root as tcp_root
from ._wire import DEFAULT_MAX_FRAME_BYTES as DEFAULT_MAX_FRAME_BYTES
from ._wire import PROTOCOL_VERSION as PROTOCOL_VERSION

__all__ = [  # noqa: RUF022  # plain sorted(), as tests/test_public_api.py checks
    "Command",
    "CommandKind",
    "DEFAULT_BROADCAST_TIMEOUT",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_MAX_FRAME_BYTES",
    "FollowerChannel",
    "PROTOCOL_VERSION",
    "RecoverableRootChannel",
    "RootChannel",
    "TcpFollowerChannel",
    "TcpRootChannel",
    "USE_CHANNEL_DEFAULT",
    "UseChannelDefault",
    "local_channels",
    "tcp_follower",
    "tcp_root",
]
