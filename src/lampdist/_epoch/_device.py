"""Host values onto a device without waiting for it.

Writing a Python number into a CUDA tensor (``t[0] = n``, ``torch.tensor(..., device=cuda)``)
copies from pageable memory, which waits for all work queued on the stream: on the event loop
that stalls every rank of the process, and it deadlocks when another in-process rank has yet
to queue its part of a collective the stream waits for. :func:`host_to_device` copies from
pinned memory instead, which returns at once.
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
    # torch.empty lets go of the GIL while the driver allocates (torch.tensor(...,
    # pin_memory=True) holds it), so the other ranks of the process can queue their work.
    pinned = torch.empty(len(values), dtype=dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)
