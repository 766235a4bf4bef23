"""Where the ranks of a run get their cliques: process groups, or the ranks of one process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import attrs
import torch

from .._clique_id import CliqueId
from .._defaults import COLLECTIVE_TIMEOUT
from .._errors import ConfigError, MismatchError, Phase
from ._clique import Clique, open_clique
from ._local import LocalHub
from ._rendezvous import serve_rendezvous

__all__ = ["CliqueFactory", "InProcess", "ProcessGroups", "in_process"]

_SETUP: Phase = "clique setup"


class CliqueFactory(Protocol):
    """Where the ranks of a run get their clique (process groups, or the ranks of one
    process). The root calls :meth:`rendezvous` once and
    publishes the id on the control channel; every rank then calls :meth:`open`."""

    def rendezvous(self, nranks: int) -> AbstractAsyncContextManager[CliqueId]:
        """The root's rendezvous for ``nranks`` ranks, open until every rank has closed."""
        ...

    def open(
        self,
        *,
        rank: int,
        nranks: int,
        device: torch.device,
        clique_id: CliqueId,
        setup_timeout: float | None,
        collective_timeout: float | None,
    ) -> AbstractAsyncContextManager[Clique]:
        """Rank ``rank``'s clique on ``device``, closed with the block."""
        ...


@attrs.frozen
class ProcessGroups:
    """Cliques over explicit torch process groups (NCCL or Gloo), one per rank, which meet at
    a rendezvous store that the root serves at ``host``: ranks in any processes and machines.
    """

    host: str = "127.0.0.1"
    """The address the other ranks dial to reach the root's rendezvous store."""
    default_group: bool = False
    """Also open torch's default process group with each clique (see
    :func:`~lampdist.clique.open_clique`): ``step_on="fsdp"`` sets it."""

    def rendezvous(self, nranks: int) -> AbstractAsyncContextManager[CliqueId]:
        return serve_rendezvous(nranks=nranks, host=self.host)

    def open(
        self,
        *,
        rank: int,
        nranks: int,
        device: torch.device,
        clique_id: CliqueId,
        setup_timeout: float | None,
        collective_timeout: float | None,
    ) -> AbstractAsyncContextManager[Clique]:
        return open_clique(
            nranks=nranks,
            rank=rank,
            device=device,
            clique_id=clique_id,
            setup_timeout=setup_timeout,
            collective_timeout=collective_timeout,
            default_group=self.default_group,
        )


@attrs.frozen
class InProcess:
    """Cliques of the ranks of this process, which issue every collective together (see
    :func:`in_process`)."""

    hub: LocalHub

    @asynccontextmanager
    async def rendezvous(self, nranks: int) -> AsyncIterator[CliqueId]:
        self._check_nranks(nranks, 0)
        # Nothing to dial: the id only carries nranks for the followers' checks.
        yield CliqueId.new("127.0.0.1", 1, nranks=nranks)

    def open(
        self,
        *,
        rank: int,
        nranks: int,
        device: torch.device,
        clique_id: CliqueId,
        setup_timeout: float | None,
        collective_timeout: float | None,
    ) -> AbstractAsyncContextManager[Clique]:
        self._check_nranks(nranks, rank)
        self._check_nranks(clique_id.nranks, rank)
        if not 0 <= rank < nranks:
            raise ConfigError(
                f"rank must be in 0..{nranks - 1}, got {rank}", rank=rank, phase=_SETUP
            )
        expected = self.hub.devices[rank]
        if device != expected:
            raise ConfigError(
                f"rank {rank} trains on {device} but its in-process clique is on {expected}",
                rank=rank,
                phase=_SETUP,
            )
        return self.hub.open(rank)

    def _check_nranks(self, nranks: int, rank: int) -> None:
        if nranks != self.hub.nranks:
            raise MismatchError(
                f"this rank expects nranks={nranks} but the in-process clique has "
                f"{self.hub.nranks} ranks",
                rank=rank,
                phase=_SETUP,
            )


def in_process(
    devices: Sequence[torch.device | str], *, collective_timeout: float | None = COLLECTIVE_TIMEOUT
) -> InProcess:
    """Cliques for ranks that are tasks of this process, rank ``r`` on ``devices[r]``: every
    rank on the CPU, or every rank on a GPU of its own.

    Each collective starts once every rank has started it, on the thread of the last one,
    for all of them at once: torch ops on the CPU, one NCCL group over the GPUs (as
    ``DataParallel`` does). No process group, store, socket or thread is involved, and no
    rank's GPU ever runs a collective that a peer has not launched, which is what makes
    several GPUs in one process safe. ``collective_timeout`` bounds each rank's wait for the
    others. Raises :class:`~lampdist.ConfigError` for devices that cannot share a clique.
    """
    return InProcess(
        LocalHub.create(
            [_device(device) for device in devices], collective_timeout=collective_timeout
        )
    )


def _device(device: torch.device | str) -> torch.device:
    """``device`` as a torch.device; raises :class:`~lampdist.ConfigError` for what is none."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(
            f"{device!r} is no device ({exc}): give 'cpu', 'cuda:0', ... or torch.device values",
            phase=_SETUP,
        ) from exc
