"""Host values onto a device without waiting for it.

Writing a Python number into a CUDA tensor (``t[0] = n``, ``torch.tensor(..., device=cuda)``)
copies from pageable memory, which waits for all work queued on the stream. On the event loop
that stalls every rank of the process, and when another in-process rank still has to queue
its part of a collective the stream is waiting for, it deadlocks. These helpers copy from
pinned memory instead, which returns at once.

The pinned buffer comes from ``torch.empty(..., pin_memory=True)``, which lets go of the GIL
while the driver allocates, not from ``torch.tensor(..., pin_memory=True)``, which holds it:
a driver call that waits under the GIL stops every other rank of the process from queuing
its part of a collective. (A pinned allocation can still wait for a driver lock: see the
local loop on several GPUs in one process.)
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
