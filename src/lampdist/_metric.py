"""Metrics a pass reports: sums and counts that add up over batches and ranks.

A metric's value over a pass is the sum of its per-batch sums divided by the sum of its
per-batch counts, over every batch of every rank: the value one process computes on the
concatenation of every rank's batches, whatever the split (no padded or repeated example).
:class:`Metric` is lampdist's own kind; a torchmetrics ``Metric`` whose states all reduce by
sum works too (its states are summed over the ranks and ``compute()`` runs on the root).
torchmetrics is not a dependency: it is only looked at when a metric object comes from it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import attrs
import torch

from ._errors import ConfigError

__all__ = [
    "Metric",
    "MetricValue",
    "check_metrics",
    "is_torchmetric",
    "metric_layout",
    "sum_states",
    "to_metric_value",
]

MetricValue: TypeAlias = float | tuple[float, ...]
"""A reported metric: a float, or for a vector-valued metric its values in row-major order."""

RESERVED = frozenset({"loss"})
"""Names a metric may not take: ``training_loss`` and ``validation_loss`` are the losses."""


def _shape(value: object) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, tuple | list | torch.Size) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        raise ConfigError(
            f"Metric shape must be a tuple of ints >= 0, got {value!r}; "
            "pass () for a scalar metric or (classes,) for one value per class",
            phase="configure",
        )
    return tuple(value)


@attrs.frozen
class Metric:
    """A metric that a pass reports: ``function(output, target)`` returns a batch's
    ``(sum, count)``, and the pass reports the sum of the sums over the sum of the counts,
    over every batch of every rank.

    ``output`` is what the module returned for the batch (the forward the loss used: it runs
    once) and ``target`` the batch's target. With a :class:`~lampdist.LossModel` the call is
    ``function(output, batch)``: ``output`` is the second element of what its ``loss``
    returned, and ``batch`` the whole batch on the device. ``sum`` is a tensor of ``shape`` (a
    number for a scalar metric); ``count`` a tensor of ``shape``, or a number or scalar tensor
    that counts for every element. Both are summed in float64 on the rank's device, then over
    the ranks in the reduce that carries the loss: the reported value is the metric of the
    concatenated data, exact on uneven shards. A count of zero reports NaN::

        accuracy = lampdist.Metric(lambda out, y: ((out.argmax(1) == y).sum(), y.numel()))
        recall = lampdist.Metric(  # one value per class: correct / examples of the class
            lambda out, y: (
                torch.bincount(y[out.argmax(1) == y], minlength=10),
                torch.bincount(y, minlength=10),
            ),
            shape=(10,),
        )

    ``shape`` is declared, not learned, so that a rank without a batch still takes part.
    Raises :class:`~lampdist.ConfigError` for a ``function`` that is not callable or a
    ``shape`` that is not a tuple of ints.
    """

    function: Callable[[Any, Any], tuple[Any, Any]]
    shape: tuple[int, ...] = attrs.field(default=(), converter=_shape, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not callable(self.function):
            raise ConfigError(
                f"Metric needs a function (output, target) -> (sum, count), got {self.function!r}",
                phase="configure",
            )

    @property
    def numel(self) -> int:
        """Values of the metric (1 for a scalar)."""
        return int(torch.Size(self.shape).numel())


def is_torchmetric(value: object) -> bool:
    """Whether ``value`` is a torchmetrics ``Metric`` (without importing torchmetrics)."""
    module = sys.modules.get("torchmetrics")
    return module is not None and isinstance(value, module.Metric)


def sum_states(metric: Any) -> list[str]:
    """The state names of the torchmetrics metric ``metric``, in its order (every one a
    tensor that reduces by sum: :func:`check_metrics` checks)."""
    return list(metric._defaults)  # torchmetrics' registry of add_state() states


def _check_torchmetric(name: str, metric: Any) -> None:
    from torchmetrics.utilities import dim_zero_sum

    for state, default in metric._defaults.items():
        reduce = metric._reductions.get(state)
        if not isinstance(default, torch.Tensor) or reduce is not dim_zero_sum:
            how = getattr(reduce, "__name__", repr(reduce))
            raise ConfigError(
                f"metric {name!r} ({type(metric).__name__}) has state {state!r} that does "
                f"not reduce by sum (dist_reduce_fx {how}): lampdist sums every state over "
                "the ranks, which would change its value; use a metric whose states are "
                "summed counts or sums (for example accuracy with multidim_average='global'),"
                " or a lampdist.Metric",
                phase="configure",
            )


def check_metrics(metrics: Mapping[str, object]) -> dict[str, Any]:
    """``metrics`` as a dict, checked: names are strings other than ``"loss"``, values are
    :class:`Metric` or sum-reducible torchmetrics metrics. Raises :class:`ConfigError`
    naming the metric otherwise."""
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            f"metrics must be a mapping of names to metrics, got {type(metrics).__name__}",
            phase="configure",
        )
    checked: dict[str, Any] = {}
    for name, metric in metrics.items():
        if not isinstance(name, str) or not name or name in RESERVED:
            raise ConfigError(
                f"a metric's name must be a non-empty string other than 'loss', got {name!r}",
                phase="configure",
            )
        if is_torchmetric(metric):
            _check_torchmetric(name, metric)
        elif not isinstance(metric, Metric):
            raise ConfigError(
                f"metric {name!r} is a {type(metric).__name__}: give a "
                "lampdist.Metric(function) whose function returns (sum, count), or a "
                "torchmetrics Metric",
                phase="configure",
            )
        checked[name] = metric
    return checked


def metric_layout(metrics: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Each metric as (``"metric NAME"``, its kind and the shapes of what it sums): what
    every rank must share for the metrics' reduce."""
    layout = []
    for name, metric in metrics.items():
        if isinstance(metric, Metric):
            described = f"lampdist.Metric, shape {metric.shape}"
        else:
            states = ", ".join(
                f"{state} {tuple(metric._defaults[state].shape)}" for state in sum_states(metric)
            )
            described = f"{type(metric).__name__} ({states})"
        layout.append((f"metric {name!r}", described))
    return layout


def to_metric_value(value: object) -> MetricValue:
    """A computed metric as a float, or as a tuple of floats (a tensor of several values,
    flattened in row-major order). Raises :class:`TypeError` for anything else."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dim() == 0:
            return float(value.item())
        return tuple(float(v) for v in value.detach().reshape(-1).tolist())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"a metric's value must be a tensor or a number, got {type(value).__name__}")
