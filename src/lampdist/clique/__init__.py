"""The clique: the tensor channel of a run, an explicit torch.distributed process group.

The root serves the rendezvous store with :func:`serve_rendezvous` and publishes the
:class:`~lampdist.CliqueId` it yields; every rank opens the clique with :func:`open_clique`
and awaits collectives on the :class:`Clique` without blocking its event loop.
"""

from .._clique_id import CliqueId as CliqueId
from ._bridge import PendingCollective as PendingCollective
from ._clique import Clique as Clique
from ._clique import open_clique as open_clique
from ._rendezvous import serve_rendezvous as serve_rendezvous

__all__ = ["Clique", "CliqueId", "PendingCollective", "open_clique", "serve_rendezvous"]
