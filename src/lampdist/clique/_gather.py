"""Reduce on Gloo as a gather to the root and a sum there, for tensors up to 4 MiB.

Up to that size a gather and a sum beat Gloo's own ``reduce``; larger tensors keep Gloo's
reduce, which wins from 16 MiB on (docs/performance.md has the timings).

The root gathers into tensors that it keeps for the next reduce of the same size, and sums
them in rank order into its own tensor on the thread that completes the gather. The other
ranks' tensors are left as they were (the clique's contract only says they are scratch).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ._bridge import Then

__all__ = ["GATHER_MAX_BYTES", "GatherReduce"]

GATHER_MAX_BYTES = 4 << 20


@attrs.define(eq=False)
class GatherReduce:
    """One rank's gather-and-sum reduces on Gloo, with the root's gather buffers kept."""

    rank: int
    nranks: int
    _spare: dict[tuple[torch.dtype, int], list[list[torch.Tensor]]] = attrs.field(
        factory=dict, init=False
    )
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def issue(
        self, pg: Any, tensor: torch.Tensor, root: int, timeout: timedelta, works: list[Any]
    ) -> None:
        """Start the reduce of ``tensor`` to ``root``; append its work to ``works``."""
        options = dist.GatherOptions()
        options.rootRank, options.timeout = root, timeout
        if self.rank != root:
            works.append(pg.gather([], [tensor], options))
            return
        gathered = self._take(tensor)

        def sum_up() -> None:
            try:
                if root != 0:
                    tensor.copy_(gathered[0])
                for peer in range(1, self.nranks):
                    tensor.add_(gathered[peer])
            finally:
                self._give_back(tensor, gathered)

        works.append(Then(pg.gather([gathered], [tensor], options), sum_up))

    def clear(self) -> None:
        """Drop the kept gather buffers (the clique has closed)."""
        with self._lock:
            self._spare.clear()

    def _take(self, like: torch.Tensor) -> list[torch.Tensor]:
        with self._lock:
            spare = self._spare.get((like.dtype, like.numel()))
            if spare:
                return [buffer.view(like.shape) for buffer in spare.pop()]
        return [torch.empty_like(like) for _ in range(self.nranks)]

    def _give_back(self, like: torch.Tensor, gathered: list[torch.Tensor]) -> None:
        with self._lock:
            self._spare.setdefault((like.dtype, like.numel()), []).append(gathered)
