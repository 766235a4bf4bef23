"""Host values onto a device without waiting for it.

Writing a Python number into a CUDA tensor (``t[0] = n``, ``torch.tensor(..., device=cuda)``)
copies from pageable memory, which waits for all work queued on the stream. On the event loop
that stalls every rank of the process, and when another in-process rank still has to queue
its part of a collective the stream is waiting for, it deadlocks. These helpers copy from
pinned memory instead, which returns at once.

The pinned buffer comes from ``torch.empty(..., pin_memory=True)``, which lets go of the GIL
while the driver allocates, never from ``torch.tensor(..., pin_memory=True)``, which holds it.
With several ranks in one process, a driver call made under the GIL can wait for a lock that
another rank's thread holds while its GPU waits for a collective whose peer part is still to
be queued by a thread that needs the GIL: on 2 H200 that hung the two-GPU exactness test in
about 1 run in 5 (a pinned allocation under the GIL, the other rank inside a kernel launch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["host_to_device"]


def host_to_device(
    values: Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A 1-d tensor of ``values`` on ``device``, copied without blocking the host."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype)  # pageable: no driver call under the GIL
    pinned = torch.empty(len(values), dtype=dtype, pin_memory=True)  # the GIL let go
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)
