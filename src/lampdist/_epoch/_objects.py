"""Small Python values over the clique, between passes: ``torch.save`` bytes in a uint8 tensor.

Used for what is not a flat buffer: the optimizer state a follower starts from, and the parts
of a checkpoint each rank holds (its place in its data, its RNG states). Values are read back
with ``weights_only=True``: tensors, numbers, strings and containers of them, no code.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from .._errors import CheckpointError
from ..clique import Clique
from ._device import host_to_device

__all__ = ["broadcast_object", "gather_objects"]


def _encode(value: Any, device: torch.device) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(device)


def _decode(payload: torch.Tensor, map_location: Any) -> Any:
    return torch.load(
        io.BytesIO(payload.cpu().numpy().tobytes()), map_location=map_location, weights_only=True
    )


def broadcast_object(clique: Clique, value: Any, *, rank: int, map_location: Any = "cpu") -> Any:
    """The root's ``value`` on every rank (``None`` when the root's is ``None``); its length
    first, then its bytes. Every rank calls it."""
    if clique.nranks == 1:
        return value
    device = clique.device
    payload = torch.zeros(0, dtype=torch.uint8, device=device)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == 0 and value is not None:
        payload = _encode(value, device)
        length = host_to_device([payload.numel()], torch.int64, device)
    clique.start_broadcast([length]).wait_blocking(None)
    count = int(length.item())
    if count == 0:
        return None
    if rank != 0:
        payload = torch.zeros(count, dtype=torch.uint8, device=device)
    clique.start_broadcast([payload]).wait_blocking(None)
    return value if rank == 0 else _decode(payload, map_location)


def gather_objects(clique: Clique, value: Any, *, rank: int) -> list[Any] | None:
    """Every rank's ``value``, in rank order, on the root (``None`` elsewhere): the lengths
    gathered first, then the bytes padded to the longest. Every rank calls it (for a
    checkpoint: a value the root cannot read back raises :class:`CheckpointError` naming the
    rank that sent it)."""
    device, nranks = clique.device, clique.nranks
    if nranks == 1:
        return [value]
    payload = _encode(value, device)
    mine = host_to_device([payload.numel()], torch.int64, device)
    lengths = torch.zeros(nranks, dtype=torch.int64, device=device)
    clique.start_all_gather(lengths, mine).wait_blocking(None)
    counts = [int(n) for n in lengths.tolist()]
    longest = max(counts)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()].copy_(payload)
    everything = torch.zeros(nranks * longest, dtype=torch.uint8, device=device)
    clique.start_all_gather(everything, padded).wait_blocking(None)
    if rank != 0:
        return None
    rows = everything.view(nranks, longest)
    values = []
    for sender in range(nranks):
        try:
            values.append(_decode(rows[sender, : counts[sender]], "cpu"))
        except Exception as exc:
            raise CheckpointError(
                f"rank {sender}'s part of the checkpoint (its place in its training data and "
                f"its RNG states) cannot be read back with weights_only=True: {exc}; a "
                "source's state_dict() may hold tensors, numbers, strings and containers of "
                "them only",
                rank=sender,
                phase="checkpoint",
            ) from exc
    return values
