"""A model that computes its own loss from a batch of any shape: :class:`LossModel`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
import torch

from ._errors import BadBatch
from ._metric import Metric, check_metrics
from ._model import (
    MeanOver,
    _check_flops,
    _check_mean_over,
    count_tokens,
    move_to_device,
    weight_of,
)

__all__ = ["LossModel", "first_leading_size", "first_token_count"]

_DEPTH = 4
"""How deep the default counts look into a batch's nesting."""


def _children(value: Any) -> Iterator[Any]:
    """The items of a dict, tuple or list, or the fields of an attrs or dataclass instance,
    in order (nothing for anything else)."""
    if isinstance(value, Mapping):
        yield from value.values()
    elif isinstance(value, tuple | list):
        yield from value
    elif attrs.has(type(value)):
        for field in attrs.fields(type(value)):
            yield getattr(value, field.name)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield getattr(value, field.name)


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor of ``value``, depth first, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < _DEPTH:
        for child in _children(value):
            yield from _tensors(child, depth + 1)


def first_leading_size(batch: Any) -> int:
    """The default example count of a :class:`LossModel`'s batch: the leading size of the
    first tensor found (dicts, tuples, lists, attrs and dataclass instances walked in order;
    a scalar tensor is one example). Raises :class:`BadBatch` for a batch without a tensor."""
    for tensor in _tensors(batch):
        return int(tensor.shape[0]) if tensor.dim() > 0 else 1
    raise BadBatch(
        f"a LossModel batch of type {type(batch).__name__} holds no tensor to count its "
        "examples by: pass examples=, a function that counts them"
    )


def first_token_count(batch: Any) -> int | None:
    """The default token count of a :class:`LossModel`'s batch: the element count of the
    first integer tensor of two or more dimensions found (token ids, one a position; see
    :func:`~lampdist._model.count_tokens`), else ``None``. For the throughput only: a loss
    that is a mean over tokens needs its own count (``tokens=``)."""
    for tensor in _tensors(batch):
        found = count_tokens(tensor)
        if found is not None:
            return found
    return None


def _move(value: Any, device: torch.device) -> Any:
    """``value`` on ``device``: as :func:`move_to_device`, and attrs and dataclass instances
    rebuilt with their fields moved."""
    if attrs.has(type(value)):
        moved = {
            field.name: _move(getattr(value, field.name), device)
            for field in attrs.fields(type(value))
            if field.init
        }
        return attrs.evolve(value, **moved)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = {
            field.name: _move(getattr(value, field.name), device)
            for field in dataclasses.fields(value)
            if field.init
        }
        return dataclasses.replace(value, **moved)
    if isinstance(value, Mapping):
        return {key: _move(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [_move(item, device) for item in value]
    if type(value) is tuple:
        return tuple(_move(item, device) for item in value)
    return move_to_device(value, device)


def _count(name: str, value: object, *, optional: bool) -> int | None:
    """A count a user's function returned, as an int >= 0 (a 0-dim integer CPU tensor
    too); :class:`BadBatch` for anything else."""
    if value is None and optional:
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise BadBatch(
        f"LossModel.{name} must return an int >= 0"
        + (" or None" if optional else "")
        + f", got {value!r}"
    )


@attrs.define(eq=False)
class LossModel:
    """A module and a loss computed from a whole batch: ``loss(module, batch)`` is the mean
    loss of one batch of any shape (a dict of tensors, a tuple, an attrs or dataclass
    instance), as a model that computes its own loss gives it::

        lampdist.LossModel(gpt, lambda module, batch: module(**batch).loss,
                           tokens=count_labels, mean_over="tokens")

    ``loss`` returns a scalar tensor, or ``(loss, output)`` where ``output`` is what the
    metrics see: with ``metrics`` it must return the pair (else :class:`BadBatch`), and
    every metric is called with ``(output, batch)``, the batch as the loading thread moved it
    to the device (a :class:`~lampdist.Metric`'s ``function(output, batch)``, a
    torchmetrics metric's ``update(output, batch)``). The forward runs once for both.

    ``examples(batch)`` counts a batch's examples (default :func:`first_leading_size`: the
    leading size of its first tensor); ``tokens(batch)`` its tokens, or ``None`` where it
    does not say (default :func:`first_token_count`: the element count of its first integer
    tensor of two or more dimensions). Both run on the loading thread, before the batch is
    moved to the device, and must not read the device; they may return an int or a 0-dim
    integer CPU tensor.

    ``mean_over`` says what the loss is a mean over, and so what weights it: ``"examples"``
    (the default) or ``"tokens"`` (a language model's loss over the positions whose labels
    are not ignored, whose count differs from batch to batch). lampdist weights each batch's
    loss, the gradient average and the reported losses by that count, summed over the whole
    accumulation window and every rank: n ranks with accumulation k train exactly like one
    process on the concatenated batches, whose loss is the mean over all their examples (or
    tokens). With ``"tokens"``, give ``tokens`` the count the loss averages over (for a
    causal LM with ``-100`` labels, ``int((batch["labels"][:, 1:] != -100).sum())``): a
    batch whose count is ``None`` raises :class:`BadBatch`, and a batch of zero tokens is
    skipped like an empty batch.

    Under ``step_on="fsdp"`` the module's own output must hold its tensors in a tensor, a
    dict, a tuple or a dataclass (as a transformers output does), where FSDP2 finds them to
    gather the parameters again for backward.

    ``metrics`` and ``flops_per_example`` are :class:`~lampdist.SupervisedModel`'s. Raises
    :class:`~lampdist.ConfigError` for a ``mean_over`` other than the two.
    """

    module: torch.nn.Module
    loss: Callable[[torch.nn.Module, Any], Any]
    examples: Callable[[Any], Any] | None = attrs.field(default=None, kw_only=True)
    tokens: Callable[[Any], Any] | None = attrs.field(default=None, kw_only=True)
    metrics: Mapping[str, Metric | torch.nn.Module] = attrs.field(
        factory=dict, converter=check_metrics, kw_only=True
    )
    flops_per_example: float | Literal["count"] | None = attrs.field(
        default=None, validator=_check_flops, kw_only=True
    )
    mean_over: MeanOver = attrs.field(default="examples", validator=_check_mean_over, kw_only=True)

    def load(self, batch: object, device: torch.device) -> tuple[Any, int, int | None, int]:
        """``batch`` counted (on the host) and moved to ``device``."""
        if self.examples is None:
            examples = first_leading_size(batch)
        else:
            examples = _count("examples", self.examples(batch), optional=False) or 0
        if self.tokens is None:
            tokens = first_token_count(batch)
        else:
            tokens = _count("tokens", self.tokens(batch), optional=True)
        weight = weight_of(examples, tokens, self.mean_over)
        return _move(batch, device), examples, tokens, weight

    def batch_loss(self, data: Any) -> torch.Tensor:
        """The batch's mean loss (the module's mode and grad mode are the caller's)."""
        result = self.loss(self.module, data)
        if isinstance(result, torch.Tensor):
            return _scalar(result)
        return self._pair(result)[0]

    def batch_loss_and_output(self, data: Any) -> tuple[torch.Tensor, Any]:
        """The batch's mean loss and the output the metrics see (see the class docstring)."""
        result = self.loss(self.module, data)
        if isinstance(result, torch.Tensor):
            raise BadBatch(
                "LossModel.loss returned a tensor, but the model has metrics, which see the "
                "output of the same forward: return (loss, output), for example "
                "(out.loss, out) for a module whose output carries its loss"
            )
        return self._pair(result)

    def metric_target(self, data: Any) -> Any:
        """The whole batch: a metric gets ``(output, batch)``."""
        return data

    @staticmethod
    def _pair(result: object) -> tuple[torch.Tensor, Any]:
        if isinstance(result, tuple | list) and len(result) == 2:
            loss, output = result
            if isinstance(loss, torch.Tensor):
                return _scalar(loss), output
        raise BadBatch(
            "LossModel.loss must return a scalar tensor (the mean loss of the batch) or "
            f"(loss, output), got {_kind(result)}; for a module whose output carries its "
            "loss, return module(**batch).loss"
        )


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of length {len(value)}"
    return type(value).__name__


def _scalar(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` as a 0-dim tensor; :class:`BadBatch` unless it has one element."""
    if loss.dim() == 0:
        return loss
    if loss.numel() != 1:
        raise BadBatch(
            "LossModel.loss must return a scalar tensor (the mean loss of the batch), got "
            f"{_kind(loss)}"
        )
    return loss.reshape(())
