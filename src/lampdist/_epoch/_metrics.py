"""A pass's metrics on one rank: sums and counts kept on the device, reduced once.

Every batch's metric sums and counts are added into float64 tensors on the rank's device (or,
when a metric function returns plain numbers, into floats on the host), with no host sync; a
torchmetrics metric updates its own states. At the end of the pass :meth:`MetricTally.local`
lays them out in one float64 vector, which the kernel sums over the clique to the root: behind
the validation loss in the pass's one reduce, or in one reduce of its own at the end of a
training pass (see ``_peers``). The root turns the sums into values
(:meth:`MetricTally.values`). Everything here runs on the rank's compute thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from .._errors import LampdistError, TrainingError
from .._metric import Metric, MetricValue, sum_states, to_metric_value
from .._model import BatchModel
from .._source import PassKind
from ._device import host_to_device

__all__ = ["MetricTally"]


@attrs.define(eq=False)
class _Sums:
    """One :class:`Metric`'s running sums and counts over a pass."""

    shape: tuple[int, ...]
    device: torch.device
    sum: torch.Tensor | None = None
    count: torch.Tensor | None = None
    host_sum: float = 0.0
    host_count: float = 0.0

    def add(self, name: str, value: Any, count: Any) -> None:
        if isinstance(value, torch.Tensor):
            if tuple(value.shape) != self.shape:
                raise ValueError(
                    f"metric {name!r} returned a sum of shape {tuple(value.shape)}, but it was "
                    f"declared with shape {self.shape}: pass Metric(..., shape=...) to match"
                )
            value = value.detach().to(self.device, torch.float64)
            self.sum = value if self.sum is None else self.sum + value
        elif self.shape == () and isinstance(value, int | float):
            self.host_sum += float(value)
        else:
            raise TypeError(
                f"metric {name!r} returned a sum of type {type(value).__name__}; return a "
                f"tensor of shape {self.shape} (or a number for a scalar metric)"
            )
        if isinstance(count, torch.Tensor):
            try:
                shape = torch.broadcast_shapes(count.shape, self.shape)  # type: ignore[no-untyped-call]  # untyped in torch
            except RuntimeError:
                shape = None
            if shape != torch.Size(self.shape):
                raise ValueError(
                    f"metric {name!r} returned a count of shape {tuple(count.shape)}, which "
                    f"does not fit its shape {self.shape}: return a count of that shape or a "
                    "scalar"
                )
            count = count.detach().to(self.device, torch.float64).expand(self.shape)
            self.count = count if self.count is None else self.count + count
        elif isinstance(count, int | float) and not isinstance(count, bool):
            self.host_count += float(count)
        else:
            raise TypeError(
                f"metric {name!r} returned a count of type {type(count).__name__}; return a "
                "number or a tensor"
            )

    def local(self) -> list[torch.Tensor]:
        """``[sums, counts]`` as flat float64 tensors on the device."""
        parts = []
        for device_part, host_part in ((self.sum, self.host_sum), (self.count, self.host_count)):
            if device_part is None:
                values = host_to_device([host_part], torch.float64, self.device)
                parts.append(values.reshape(()).expand(self.shape).reshape(-1))
            elif host_part:
                parts.append((device_part + host_part).reshape(-1))
            else:
                parts.append(device_part.reshape(-1))
        return parts


@attrs.define(eq=False)
class MetricTally:
    """One rank's metrics over one pass (the compute thread). Create it with :meth:`start`."""

    rank: int
    phase: PassKind
    epoch: int
    device: torch.device
    metrics: Mapping[str, Any]
    _sums: dict[str, _Sums] = attrs.field(factory=dict, init=False)

    @classmethod
    def start(
        cls, model: BatchModel, device: torch.device, *, rank: int, phase: PassKind, epoch: int
    ) -> MetricTally | None:
        """A tally for ``model``'s metrics (``None`` when it has none); torchmetrics metrics
        are moved to ``device`` and reset."""
        if not model.metrics:
            return None
        tally = cls(rank=rank, phase=phase, epoch=epoch, device=device, metrics=model.metrics)
        for name, metric in model.metrics.items():
            if isinstance(metric, Metric):
                tally._sums[name] = _Sums(metric.shape, device)
            else:
                torchmetric: Any = metric
                torchmetric.to(device)
                torchmetric.reset()
        return tally

    def update(self, output: Any, target: Any) -> None:
        """Add one batch (without gradients). Raises :class:`TrainingError` naming the
        metric when a metric fails or returns what it cannot sum."""
        for name, metric in self.metrics.items():
            try:
                if isinstance(metric, Metric):
                    value, count = metric.function(output, target)
                    self._sums[name].add(name, value, count)
                else:
                    metric.update(output, target)
            except LampdistError:
                raise
            except Exception as exc:
                raise self._error(name, exc) from exc

    def local(self) -> torch.Tensor:
        """This rank's sums, counts and states as one float64 vector on the device."""
        parts: list[torch.Tensor] = []
        for name, metric in self.metrics.items():
            if isinstance(metric, Metric):
                parts += self._sums[name].local()
            else:
                parts += [
                    getattr(metric, state).detach().to(torch.float64).reshape(-1)
                    for state in sum_states(metric)
                ]
        return torch.cat(parts)

    def carried(self) -> dict[str, list[Any]]:
        """The sums, counts and states so far, on the host, to go on from (a segment's end)."""

        def host(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.detach().to("cpu", copy=True)

        carried: dict[str, list[Any]] = {}
        for name, metric in self.metrics.items():
            if isinstance(metric, Metric):
                sums = self._sums[name]
                carried[name] = [host(sums.sum), host(sums.count), sums.host_sum, sums.host_count]
            else:
                carried[name] = [host(getattr(metric, state)) for state in sum_states(metric)]
        return carried

    def carry_on(self, carried: dict[str, list[Any]]) -> None:
        """Go on from :meth:`carried`'s sums (a new tally of the same pass)."""

        def on_device(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(self.device, copy=True)

        for name, metric in self.metrics.items():
            if isinstance(metric, Metric):
                sums = self._sums[name]
                total, count, sums.host_sum, sums.host_count = carried[name]
                sums.sum, sums.count = on_device(total), on_device(count)
            else:
                for state, value in zip(sum_states(metric), carried[name], strict=True):
                    setattr(metric, state, on_device(value))

    def values(self, summed: torch.Tensor) -> dict[str, MetricValue]:
        """The metrics' values from ``summed``, what :meth:`local` laid out summed over the
        clique (the root; one host sync). A torchmetrics metric takes the summed states and
        ``compute()`` gives its value."""
        host = summed.tolist()
        values: dict[str, MetricValue] = {}
        offset = 0
        for name, metric in self.metrics.items():
            if isinstance(metric, Metric):
                n = metric.numel
                sums, counts = host[offset : offset + n], host[offset + n : offset + 2 * n]
                offset += 2 * n
                ratios = [s / c if c else math.nan for s, c in zip(sums, counts, strict=True)]
                values[name] = ratios[0] if metric.shape == () else tuple(ratios)
                continue
            for state in sum_states(metric):
                current = getattr(metric, state)
                n = current.numel()
                total = summed[offset : offset + n].view(current.shape).to(current.dtype)
                setattr(metric, state, total)
                offset += n
            try:
                values[name] = to_metric_value(_compute(metric))
            except Exception as exc:
                raise self._error(name, exc) from exc
        return values

    def _error(self, name: str, exc: Exception) -> TrainingError:
        return TrainingError(
            f"epoch {self.epoch}: metric {name!r} raised {type(exc).__name__}: {exc}",
            rank=self.rank,
            phase=self.phase,
        )


def _compute(metric: Any) -> Any:
    """``metric.compute()`` on the states lampdist summed: without torchmetrics' own sync
    (the clique did it; a default process group, if any, spans other processes), and with an
    update count of at least one (a root without a batch of its own holds the others')."""
    to_sync, metric._to_sync = metric._to_sync, False  # torchmetrics' switch for compute()
    metric._update_count = max(metric._update_count, 1)
    metric._computed = None
    try:
        return metric.compute()
    finally:
        metric._to_sync = to_sync  # the user's object syncs as before once lampdist is done
