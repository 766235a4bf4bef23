"""The warning about lazy CUDA module loading with several GPUs in one process.

The check only reads devices and the environment, so it runs without a GPU; the deadlock it
warns about is described in docs/performance.md (it needs 2 GPUs and lazy loading).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lampdist.roles._local import warn_lazy_module_loading

TWO_GPUS = [torch.device("cuda", 0), torch.device("cuda", 1)]


@pytest.mark.parametrize("setting", [None, "LAZY", "DEFAULT", "lazy"])
def test_two_gpus_without_eager_loading_warn(
    monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    if setting is None:
        monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    else:
        monkeypatch.setenv("CUDA_MODULE_LOADING", setting)
    with pytest.warns(RuntimeWarning, match="CUDA_MODULE_LOADING=EAGER"):
        warn_lazy_module_loading(TWO_GPUS)


@pytest.mark.parametrize(
    ("devices", "setting"),
    [
        (TWO_GPUS, "EAGER"),
        (TWO_GPUS, "eager"),
        ([torch.device("cuda", 0)] * 2, "LAZY"),  # one GPU twice: no peer in the process
        ([torch.device("cpu")] * 3, "LAZY"),
        ([torch.device("cuda", 0), torch.device("cpu")], "LAZY"),
    ],
)
def test_no_warning_when_no_deadlock_is_possible(
    monkeypatch: pytest.MonkeyPatch, devices: list[torch.device], setting: str
) -> None:
    monkeypatch.setenv("CUDA_MODULE_LOADING", setting)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_lazy_module_loading(devices)
