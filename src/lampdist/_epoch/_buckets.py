"""Gradient exchange overlapped with backward: bucket collectives started from autograd hooks.

The flat gradient buffers are cut into buckets of about ``bucket_cap_mb`` megabytes, each a
contiguous slice covering whole parameters, in reverse parameter order (backward produces the
last layers' gradients first). During the backward of a step's last batch a hook on every
parameter marks its gradient complete; a bucket's collective starts once all of its
parameters are marked *and* every bucket before it in the fixed order has started, so every
rank issues the same collectives in the same order whatever order autograd ran in. After the
backward, buckets still waiting (parameters that got no gradient this step, a rank without a
batch) start in that same order.

Sharded, the flat buffers are laid out one per bucket already (see ``_flat``): each bucket is
a whole padded buffer, reduce-scattered so that each rank gets the slice it owns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import attrs
import torch

from .._errors import TrainingError
from ..clique import PendingCollective
from ._flat import FlatParameters

__all__ = ["GradientBuckets", "StartCollective"]

StartCollective = Callable[[Sequence[torch.Tensor]], PendingCollective]
"""Starts the gradient collective (``clique.start_all_reduce`` or a reduce to the root)."""


@attrs.define(eq=False)
class _Bucket:
    gradients: torch.Tensor
    """A contiguous slice of one flat gradient buffer."""
    parameters: tuple[int, ...]
    """Indices into ``FlatParameters.parameters`` of the parameters it covers."""
    waiting: int = 0


def whole_buffer_buckets(flat: FlatParameters) -> list[_Bucket]:
    """One bucket per flat gradient buffer (padding included), the last buffer first."""
    buckets: list[_Bucket] = []
    for buffer_index in reversed(range(len(flat.padded_gradients))):
        members = tuple(
            index
            for index in reversed(range(len(flat.parameters)))
            if flat.slots[index][0] == buffer_index
        )
        buckets.append(_Bucket(gradients=flat.padded_gradients[buffer_index], parameters=members))
    return buckets


def plan_buckets(flat: FlatParameters, cap_bytes: int) -> list[_Bucket]:
    """Buckets in launch order: from the last parameter backwards, at most ``cap_bytes`` each
    unless one parameter alone is larger; a bucket never spans two flat buffers."""
    buckets: list[_Bucket] = []
    current: list[int] = []
    current_bytes = 0

    def close() -> None:
        nonlocal current, current_bytes
        if not current:
            return
        buffer_index, first, _ = flat.slots[current[-1]]
        _, last, last_numel = flat.slots[current[0]]
        gradients = flat.gradient_buffers[buffer_index][first : last + last_numel]
        buckets.append(_Bucket(gradients=gradients, parameters=tuple(current)))
        current, current_bytes = [], 0

    for index in reversed(range(len(flat.parameters))):
        buffer_index, _, numel = flat.slots[index]
        size = numel * flat.gradient_buffers[buffer_index].element_size()
        if current and (
            flat.slots[current[-1]][0] != buffer_index or current_bytes + size > cap_bytes
        ):
            close()
        current.append(index)
        current_bytes += size
    close()
    return buckets


@attrs.define(eq=False)
class GradientBuckets:
    """The gradient buckets of one rank and the hooks that start them during backward.

    Use :meth:`attached` around a pass, :meth:`arm` before the backward of each step's last
    batch and :meth:`start_remaining` after the step's backward work, then await what it
    returns. Hooks run on autograd's thread; everything here is guarded by a lock.
    """

    rank: int
    flat: FlatParameters
    start: StartCollective
    buckets: list[_Bucket]
    _bucket_of: list[int] = attrs.field(init=False)
    _marked: list[bool] = attrs.field(init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _armed: bool = attrs.field(default=False, init=False)
    _next: int = attrs.field(default=0, init=False)
    _pending: list[PendingCollective] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        self._bucket_of = [0] * len(self.flat.parameters)
        for position, bucket in enumerate(self.buckets):
            for index in bucket.parameters:
                self._bucket_of[index] = position
        self._marked = [False] * len(self.flat.parameters)

    @classmethod
    def create(
        cls,
        rank: int,
        flat: FlatParameters,
        start: StartCollective,
        *,
        cap_bytes: int,
        whole_buffers: bool = False,
    ) -> GradientBuckets:
        """Buckets of about ``cap_bytes`` over ``flat``'s gradients, or with ``whole_buffers``
        (sharded: the buffers were cut to that size), one per buffer."""
        buckets = whole_buffer_buckets(flat) if whole_buffers else plan_buckets(flat, cap_bytes)
        return cls(rank=rank, flat=flat, start=start, buckets=buckets)

    @contextmanager
    def attached(self) -> Iterator[GradientBuckets]:
        """Register the hooks for the duration of the block; they are removed on every path."""
        handles = [
            parameter.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]  # torch: unannotated
                self._hook(index)
            )
            for index, parameter in enumerate(self.flat.parameters)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            with self._lock:
                self._armed = False

    def arm(self) -> None:
        """The next backward is the step's last: start buckets as their gradients complete."""
        with self._lock:
            self._armed = True
            self._next = 0
            self._pending = []
            self._marked = [False] * len(self._marked)
            for bucket in self.buckets:
                bucket.waiting = len(bucket.parameters)

    def start_remaining(self) -> list[PendingCollective]:
        """Start every bucket not started yet, in order; return the step's collectives."""
        with self._lock:
            if not self._armed:
                self._next = 0
                self._pending = []
            self._armed = False
            while self._next < len(self.buckets):
                self._start_next()
            pending, self._pending = self._pending, []
        return pending

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient(_: torch.Tensor) -> None:
            self._mark(index)

        return on_gradient

    def _mark(self, index: int) -> None:
        with self._lock:
            if not self._armed:
                return
            position = self._bucket_of[index]
            if self._marked[index]:
                if position < self._next:
                    raise TrainingError(
                        f"parameter {index} received a second gradient in one backward after "
                        "its bucket was sent (a parameter reused across checkpointed "
                        "segments?); pass bucket_cap_mb=None to exchange gradients after "
                        "backward",
                        rank=self.rank,
                        phase="train",
                    )
                return
            self._marked[index] = True
            bucket = self.buckets[position]
            bucket.waiting -= 1
            while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
                self._start_next()

    def _start_next(self) -> None:
        bucket = self.buckets[self._next]
        self._next += 1
        for index in bucket.parameters:
            self.flat.ensure_gradient_view(index)
        self._pending.append(self.start([bucket.gradients]))
