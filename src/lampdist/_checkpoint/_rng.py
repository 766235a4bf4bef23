"""Random-number-generator states: captured at save time, restored on request at resume."""

from __future__ import annotations

import logging
import random
from typing import Any

import attrs
import numpy as np
import torch

__all__ = ["RngStates", "capture_rng_states", "restore_rng_states"]

_log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True, eq=False)
class RngStates:
    """The global generators of one process: torch CPU and CUDA, python ``random``, numpy."""

    torch_cpu: torch.Tensor
    torch_cuda: tuple[torch.Tensor, ...]
    python: Any
    numpy: Any

    def tensors(self) -> dict[str, Any]:
        """What goes into ``rng.pt``."""
        return {"torch_cpu": self.torch_cpu, "torch_cuda": list(self.torch_cuda)}

    def to_json(self) -> dict[str, Any]:
        """What goes into ``state.json``."""
        version, internal, gauss = self.python
        numpy_state = self.numpy
        if isinstance(numpy_state, tuple):
            name, keys, pos, has_gauss, cached = numpy_state
            numpy_json: Any = {
                "legacy": [str(name), keys.tolist(), int(pos), int(has_gauss), float(cached)]
            }
        else:
            numpy_json = {"dict": numpy_state}
        return {"python": [version, list(internal), gauss], "numpy": numpy_json}

    @classmethod
    def from_stored(cls, tensors: dict[str, Any], data: dict[str, Any]) -> RngStates:
        version, internal, gauss = data["python"]
        numpy_json = data["numpy"]
        if "legacy" in numpy_json:
            name, keys, pos, has_gauss, cached = numpy_json["legacy"]
            numpy_state: Any = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
        else:
            numpy_state = numpy_json["dict"]
        return cls(
            torch_cpu=tensors["torch_cpu"],
            torch_cuda=tuple(tensors["torch_cuda"]),
            python=(version, tuple(internal), gauss),
            numpy=numpy_state,
        )


def capture_rng_states() -> RngStates:
    """The current global RNG states.

    CUDA ones only when this process has initialised CUDA: otherwise its CUDA generators
    were never used, and reading them would create a CUDA context on every device.
    """
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # unannotated in torch
    used_cuda = torch.cuda.is_available() and initialized
    cuda = tuple(torch.cuda.get_rng_state_all()) if used_cuda else ()
    numpy_state = np.random.get_state(legacy=True)
    if isinstance(numpy_state, dict):  # a non-MT19937 bit generator: keep it JSON-able
        numpy_state = _plain(numpy_state)
    return RngStates(
        torch_cpu=torch.get_rng_state(),
        torch_cuda=cuda,
        python=random.getstate(),
        numpy=numpy_state,
    )


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def restore_rng_states(states: RngStates) -> None:
    """Set the global generators back to ``states``."""
    torch.set_rng_state(states.torch_cpu)
    if states.torch_cuda:
        if not torch.cuda.is_available():
            _log.warning("the checkpoint holds CUDA RNG states but CUDA is not available here")
        else:
            count = min(len(states.torch_cuda), torch.cuda.device_count())
            if count != len(states.torch_cuda):
                _log.warning(
                    "the checkpoint holds RNG states for %d CUDA devices, this machine has %d",
                    len(states.torch_cuda),
                    torch.cuda.device_count(),
                )
            for index in range(count):
                torch.cuda.set_rng_state(states.torch_cuda[index], index)
    random.setstate(states.python)
    np.random.set_state(states.numpy)
