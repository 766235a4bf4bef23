"""Breaking a group: an abort on purpose (this rank's), a peer that died or aborted (the
watcher's), and what either does: fail everything here, tell the peers, end the NCCL
communicator or the Gloo connections. Also the end of a peer's process on this machine."""

from __future__ import annotations

import logging

import torch.distributed as dist

from .._errors import CollectiveFailed
from ._group_issue import IssuingGroup
from ._process import end_if_local

__all__ = ["AbortingGroup"]

logger = logging.getLogger(__name__)


class AbortingGroup(IssuingGroup):
    """The group's break, from any thread (see the module docstring)."""

    __slots__ = ()

    # -- a peer that died or aborted (the watcher thread) ----------------------------------

    def _break(self, message: str, *, relay: bool) -> None:
        """A peer died or aborted: fail everything here, tell the others, drop the group."""
        self._fail((CollectiveFailed, message))
        if relay:
            self._link.post_notice(message)
        self._abort_nccl()
        self._end_connections()
        with self._pg_lock:
            pg, self._pg = self._pg, None
        # Gloo: dropping the group closes its sockets, so peers blocked on us fail at once.
        del pg

    # -- an abort on purpose (any thread) --------------------------------------------------

    def abandon(self, reason: str) -> None:
        """Abort (see :meth:`_announce_abort`), and have the teardown leave the collectives
        in flight behind rather than wait for them: a stalled peer may hold them until they
        time out."""
        self._abandoned = True
        self._announce_abort(reason)

    def _announce_abort(self, reason: str) -> None:
        self._fail((CollectiveFailed, f"the clique was torn down on rank {self.rank}: {reason}"))
        self._link.post_notice(reason)
        self._abort_nccl()
        self._end_connections()

    # -- ending the backend's collectives --------------------------------------------------

    def _abort_nccl(self) -> None:
        """Abort the NCCL communicator: its kernels stop and the enqueue thread unblocks.

        Deliberately without the group lock: an enqueue blocked inside NCCL holds it, and
        only the abort can set it free. Once only, and never beside a shutdown: the watcher (a
        peer died) and the teardown may both ask, from different threads.
        """
        if self.backend != "nccl":
            return
        with self._end_lock:
            if self._ended:
                return
            self._ended = True
            pg = self._pg
            try:
                if pg is not None:
                    pg.abort()
                if self.owns_default and dist.is_initialized():
                    dist.distributed_c10d._abort_process_group()
            except Exception:
                logger.exception("rank %d: aborting the NCCL communicator failed", self.rank)
            finally:
                del pg

    def _end_connections(self) -> None:
        """Gloo: shut this rank's connections down, so that its collectives in flight fail at
        once here and at the other end, a stalled peer included (see ``_sockets``). After the
        notice is posted: a peer whose collective fails then reads it and names this rank."""
        with self._sockets_lock:
            ended = self._sockets.shut_down()
        if ended:
            logger.debug("rank %d: shut down %d Gloo connections", self.rank, ended)

    # -- a peer's process ------------------------------------------------------------------

    def end_process(self, peer: int) -> int | None:
        """SIGKILL rank ``peer``'s process if it runs on this machine (see ``_process``); its
        PID, or ``None``. Blocking (a store read): run it in a worker thread."""
        keys = self._keys
        try:
            noted = "" if keys is None else keys.get(f"process/{peer}").decode()
        except Exception as exc:  # the store is gone or the key never came
            logger.debug("rank %d: no process noted for rank %d: %s", self.rank, peer, exc)
            return None
        return end_if_local(noted)
