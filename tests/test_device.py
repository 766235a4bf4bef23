"""What the entry points accept as a device."""

from __future__ import annotations

import pytest
import torch

import lampdist
from lampdist._device import resolve_device


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        (torch.device("cpu"), torch.device("cpu")),
        ("cpu", torch.device("cpu")),
        ("cuda:1", torch.device("cuda", 1)),
        ("cuda", torch.device("cuda")),
        (2, torch.device("cuda", 2)),
    ],
)
def test_devices_strings_and_cuda_indices_are_read(
    device: torch.device | str | int, expected: torch.device
) -> None:
    assert resolve_device(device) == expected


@pytest.mark.parametrize(
    ("device", "match"),
    [
        ("gpu0", "not a device string"),
        (True, "got True"),
        (1.5, "got float"),
    ],
)
def test_anything_else_is_a_config_error_naming_rank_and_phase(device: object, match: str) -> None:
    with pytest.raises(lampdist.ConfigError, match=match) as caught:
        resolve_device(device, rank=3, phase="configure")  # type: ignore[arg-type]  # on purpose
    assert (caught.value.rank, caught.value.phase) == (3, "configure")
