"""The clique id: how followers find the collective-communication group of a run.

It is a plain value that the control channel carries; it lives at the bottom of the package so
that both the control plane and the clique can use it without importing each other.
"""

from __future__ import annotations

import secrets
from typing import Any

import attrs

from ._errors import ProtocolError

__all__ = ["CliqueId"]


@attrs.frozen(kw_only=True)
class CliqueId:
    """Address of the rendezvous store of one run, a random per-run key prefix, and the
    number of ranks of the clique (the root included).

    Create one with :meth:`new` on the root (``lampdist.clique.serve_rendezvous`` does);
    followers receive it over the control channel and nowhere else, and check ``nranks``
    against their own setting before they open the clique.
    """

    host: str
    port: int
    prefix: str
    nranks: int

    @classmethod
    def new(cls, host: str, port: int, *, nranks: int) -> CliqueId:
        """A clique id for a store at ``host:port`` with a fresh random prefix."""
        return cls(host=host, port=port, prefix=secrets.token_hex(16), nranks=nranks)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the control channel's wire form)."""
        return {"host": self.host, "port": self.port, "prefix": self.prefix, "nranks": self.nranks}

    @classmethod
    def from_json(cls, data: object) -> CliqueId:
        """Parse :meth:`to_json`'s output; raises :class:`ProtocolError` on anything else."""
        if not isinstance(data, dict):
            raise ProtocolError(f"a clique id must be an object, got {type(data).__name__}")
        host, port, prefix = data.get("host"), data.get("port"), data.get("prefix")
        nranks = data.get("nranks")
        if not isinstance(host, str) or not isinstance(prefix, str):
            raise ProtocolError("a clique id needs string 'host' and 'prefix'")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ProtocolError(f"a clique id needs an integer 'port' in 1..65535, got {port!r}")
        if not isinstance(nranks, int) or isinstance(nranks, bool) or nranks < 1:
            raise ProtocolError(f"a clique id needs a positive integer 'nranks', got {nranks!r}")
        return cls(host=host, port=port, prefix=prefix, nranks=nranks)
