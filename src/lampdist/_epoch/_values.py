"""A step's small values and where they travel: behind the flat buffers when they can.

``meta`` (every rank to the stepping ranks, summed with the gradients): the examples of the
step, their loss sum and whether the rank has more batches. The root values (the root to the
followers, with the parameters): whether any rank has more batches, the fp16 loss scale,
whether the root asks every rank for its own loss of the step (see ``_blame``), and the fp16
nominal step (see :class:`~lampdist._epoch._stepper.LossScale`).

Each goes into a tail of a flat buffer (see :class:`FlatParameters`), so a step sends no collective
of its own for them. The meta tail of a float32 buffer holds the example count as two parts
(``high * 4096 + low``), each summed exactly up to 2**24, and the loss sum rounded to float32
(about 7 significant digits; a float64 buffer keeps all of them). The root values' tail is a bit
copy of four float64 values, exact in any dtype. Without a tail the values travel as a float64
tensor of their own.
"""

from __future__ import annotations

import torch

from ._device import host_to_device
from ._flat import FlatParameters

__all__ = [
    "EXAMPLES",
    "read_meta",
    "read_root_values",
    "root_values_receiver",
    "write_meta",
    "write_root_values",
]

EXAMPLES, LOSS = 0, 1  # positions in the float64 meta that read_meta returns (then: more)
_SPLIT = 4096  # examples = high * _SPLIT + low
_TAIL_LOSS = 2  # the tail holds [examples high, examples low, loss sum, more]


def write_meta(
    flat: FlatParameters, examples: int, loss_sum: torch.Tensor, more: bool, *, tail: bool
) -> torch.Tensor | None:
    """Write the step's meta values; return the float64 tensor to exchange on its own when
    ``tail`` is False or the gradients have no meta tail, else ``None`` (they ride along)."""
    device = loss_sum.device
    if not tail or flat.meta_tail is None:
        meta = host_to_device([examples, 0.0, 1.0 if more else 0.0], torch.float64, device)
        meta[LOSS] = loss_sum  # device to device: no wait
        return meta
    destination = flat.meta_tail
    high, low = divmod(examples, _SPLIT)
    values = host_to_device([high, low, 0.0, 1.0 if more else 0.0], destination.dtype, device)
    destination.copy_(values)
    destination[_TAIL_LOSS] = loss_sum
    return None


def read_meta(flat: FlatParameters, meta: torch.Tensor | None) -> torch.Tensor:
    """The exchanged meta values as float64 ``[examples, loss sum, more]`` on the device."""
    if meta is not None:
        return meta
    assert flat.meta_tail is not None
    high, low, loss, more = flat.meta_tail.to(torch.float64).unbind()
    return torch.stack((high * _SPLIT + low, loss, more))


def write_root_values(
    flat: FlatParameters,
    more: bool,
    scale: float,
    device: torch.device,
    *,
    ask: bool = False,
    nominal: int = 0,
) -> torch.Tensor | None:
    """Write the root values behind the parameters; return them as a float64 tensor to
    broadcast on its own when the parameters have no root values' tail, else ``None``."""
    values = host_to_device(
        [1.0 if more else 0.0, scale, 1.0 if ask else 0.0, float(nominal)], torch.float64, device
    )
    if flat.root_values is None:
        return values
    flat.root_values.copy_(values)
    return None


def root_values_receiver(flat: FlatParameters, device: torch.device) -> torch.Tensor | None:
    """Where a follower receives the root values: ``None`` when they ride behind the
    parameters, else a float64 tensor to broadcast into."""
    if flat.root_values is not None:
        return None
    return torch.zeros(4, dtype=torch.float64, device=device)


def read_root_values(flat: FlatParameters, values: torch.Tensor | None) -> torch.Tensor:
    """The broadcast root values as float64 ``[more, scale, ask, nominal]`` on the device."""
    if values is not None:
        return values
    assert flat.root_values is not None
    return flat.root_values
