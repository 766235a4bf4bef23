"""The warning about several GPUs in one process.

The check only reads devices, so it runs without a GPU; the deadlock it warns about is
described in docs/performance.md (it needs 2 GPUs in one process).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lampdist._roles._local import warn_several_gpus_in_one_process

TWO_GPUS = [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_two_gpus_warn() -> None:
    """The warning does not look at ``CUDA_MODULE_LOADING``: EAGER loading is no cure (a
    teardown after a collective timeout hung with it)."""
    with pytest.warns(RuntimeWarning, match="one process per GPU"):
        warn_several_gpus_in_one_process(TWO_GPUS)


@pytest.mark.parametrize(
    "devices",
    [
        [torch.device("cuda", 0)] * 2,  # one GPU twice: no peer on another GPU
        [torch.device("cpu")] * 3,
        [torch.device("cuda", 0), torch.device("cpu")],
    ],
)
def test_no_warning_without_two_gpus(devices: list[torch.device]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_several_gpus_in_one_process(devices)
