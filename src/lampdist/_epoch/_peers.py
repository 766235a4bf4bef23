"""What the step kernel asks of the other ranks of its clique, decided once when it is made.

A pass asks the clique three things: every rank's batch count (one all-gather, before a
training pass and a lockstep validation pass), whether any rank has a batch (one small
all-reduce before each forward of a lockstep validation pass whose lengths are not known), and
the pass's sums on the root (one reduce at its end). :class:`Peers` asks them through the
clique's collectives; :class:`Alone`, the peers of a rank alone in its clique, answers them
itself, with no collective, and keeps no lockstep.
"""

from __future__ import annotations

import attrs
import torch

from .._metric import MetricValue
from ..clique import Clique
from ._device import host_to_device
from ._metrics import MetricTally

__all__ = ["Alone", "Peers", "peers_of"]


@attrs.define(eq=False)
class Peers:
    """The other ranks of ``clique``, reached through its collectives (the compute thread)."""

    rank: int
    clique: Clique
    lockstep: bool
    """Whether every rank runs as many forwards as the others: the design's ``lockstep`` (its
    collectives run inside the model), among ranks that have peers."""

    def batch_counts(self, total: int | None) -> list[int] | None:
        """Every rank's batch count of the pass, by rank, when every rank's source has a
        length (``total``: this rank's), else ``None`` (one all-gather)."""
        local = -1 if total is None else total
        device = self.clique.device
        mine = host_to_device([local], torch.int64, device)
        gathered = torch.zeros(self.clique.nranks, dtype=torch.int64, device=device)
        self.clique.start_all_gather(gathered, mine).wait_blocking(None)
        lengths = [int(n) for n in gathered.tolist()]
        return None if min(lengths) < 0 else lengths

    def anyone(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether any rank's is set (one small all-reduce)."""
        values = host_to_device([float(flag) for flag in flags], torch.float64, self.clique.device)
        self.clique.start_all_reduce([values]).wait_blocking(None)
        return [value > 0 for value in values.tolist()]

    def sum_to_root(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the clique into the root's (one reduce; a follower's keeps
        what the reduce leaves there)."""
        self.clique.start_reduce([tensor], root=0).wait_blocking(None)

    def pass_sums(
        self, metrics: MetricTally | None, row: list[float]
    ) -> tuple[dict[str, MetricValue], list[list[float]]]:
        """A training pass's metrics over the clique and every rank's telemetry ``row`` (see
        ``_telemetry``), on the root, in one reduce (empty elsewhere)."""
        width = len(row)
        nranks = self.clique.nranks
        table = [0.0] * (nranks * width)
        table[self.rank * width : (self.rank + 1) * width] = row
        summed = host_to_device(table, torch.float64, self.clique.device)
        if metrics is not None:
            summed = torch.cat([metrics.local(), summed])
        self.clique.start_reduce([summed], root=0).wait_blocking(None)
        if self.rank != 0:
            return {}, []
        head = summed.numel() - nranks * width
        values = {} if metrics is None else metrics.values(summed[:head])
        flat = summed[head:].tolist()
        return values, [flat[r * width : (r + 1) * width] for r in range(nranks)]


class Alone(Peers):
    """The peers of a rank alone in its clique: every answer is the rank's own, and no
    collective runs."""

    def batch_counts(self, total: int | None) -> list[int] | None:
        return None if total is None or total < 0 else [total]

    def anyone(self, flags: list[bool]) -> list[bool]:
        return list(flags)

    def sum_to_root(self, tensor: torch.Tensor) -> None:
        return

    def pass_sums(
        self, metrics: MetricTally | None, row: list[float]
    ) -> tuple[dict[str, MetricValue], list[list[float]]]:
        values = {} if metrics is None else metrics.values(metrics.local())
        return values, [row]


def peers_of(clique: Clique, rank: int, *, lockstep: bool) -> Peers:
    """Rank ``rank``'s peers in ``clique``, under a design whose ``lockstep`` is given:
    :class:`Alone` where it is the only rank."""
    if clique.nranks == 1:
        return Alone(rank=rank, clique=clique, lockstep=False)
    return Peers(rank=rank, clique=clique, lockstep=lockstep)
