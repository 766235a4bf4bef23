"""The clique: the tensor channel of a run.

Across processes it is an explicit torch.distributed process group: the root serves the
rendezvous store with :func:`serve_rendezvous` and publishes the :class:`~lampdist.CliqueId`
it yields; every rank opens the clique with :func:`open_clique`. The ranks of one process
share an in-process clique instead (:func:`in_process`). Either way a rank awaits its
collectives on the :class:`Clique` without blocking its event loop, or waits for them on its
compute thread.
"""

from .._clique_id import CliqueId as CliqueId
from ._bridge import PendingCollective as PendingCollective
from ._clique import Clique as Clique
from ._clique import open_clique as open_clique
from ._factories import CliqueFactory as CliqueFactory
from ._factories import InProcess as InProcess
from ._factories import ProcessGroups as ProcessGroups
from ._factories import in_process as in_process
from ._rendezvous import serve_rendezvous as serve_rendezvous

__all__ = [
    "Clique",
    "CliqueFactory",
    "CliqueId",
    "InProcess",
    "PendingCollective",
    "ProcessGroups",
    "in_process",
    "open_clique",
    "serve_rendezvous",
]


def __getattr__(name: str) -> object:
    """``Cliques``, the old name of :class:`CliqueFactory`, with a deprecation warning."""
    if name == "Cliques":
        import warnings

        warnings.warn(
            "lampdist.clique.Cliques is now lampdist.clique.CliqueFactory; the old name goes "
            "in 2.0",
            DeprecationWarning,
            stacklevel=2,
        )
        return CliqueFactory
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
