"""What the entry points accept as a device, read once into a :class:`torch.device`."""

from __future__ import annotations

import torch

from ._errors import ConfigError, Phase

__all__ = ["resolve_device"]


def resolve_device(
    device: torch.device | str | int, *, rank: int | None = None, phase: Phase | None = None
) -> torch.device:
    """``device`` as a :class:`torch.device`: a device as it is, a string (``"cuda:1"``) as
    torch reads it, an int as the CUDA device of that index.

    Raises :class:`~lampdist.ConfigError` (naming ``rank`` and ``phase`` when given) for a
    string that is no device, a bool, or any other type.
    """
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool):
        raise ConfigError(
            f"device must be a torch.device, a string or a CUDA index, got {device}",
            rank=rank,
            phase=phase,
        )
    if isinstance(device, int):
        return torch.device("cuda", device)
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ConfigError(
                f"device {device!r} is not a device string like 'cuda:0'", rank=rank, phase=phase
            ) from exc
    raise ConfigError(
        f"device must be a torch.device, a string or a CUDA index, got {type(device).__name__}",
        rank=rank,
        phase=phase,
    )
