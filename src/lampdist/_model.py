"""The model a training loop runs: a module, its loss, how to count a batch's examples, and
the metrics its passes report."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias

import attrs
import torch

from ._errors import BadBatch, ConfigError
from ._metric import Metric, check_metrics

__all__ = [
    "MEAN_OVER",
    "BatchModel",
    "Loaded",
    "MeanOver",
    "SupervisedModel",
    "check_mean_over",
    "count_examples",
    "count_tokens",
    "move_to_device",
    "original_module",
]


def count_examples(target: Any) -> int:
    """``len(target)``: the number of examples of a batch whose target is ``target``."""
    if isinstance(target, torch.Tensor):
        return int(target.shape[0]) if target.dim() > 0 else 1
    return len(target)


def count_tokens(target: Any) -> int | None:
    """The tokens of a batch whose target is ``target``: its element count when it is an
    integer tensor of two or more dimensions (a class index per position of a sequence, as a
    language model's next-token target is), else ``None`` (the batch does not say)."""
    if (
        isinstance(target, torch.Tensor)
        and target.dim() >= 2
        and not target.is_floating_point()
        and not target.is_complex()
        and target.dtype is not torch.bool
    ):
        return target.numel()
    return None


MeanOver: TypeAlias = Literal["examples", "tokens"]
"""What a model's loss is a mean over, and so what weights it (see :class:`BatchModel`)."""

MEAN_OVER: tuple[MeanOver, ...] = ("examples", "tokens")


Loaded: TypeAlias = tuple[Any, int, int | None, int]
"""A batch as the loading thread hands it on (see :meth:`BatchModel.load`): ``(data,
examples, tokens, weight)``. ``data`` is the batch on the rank's device, as the model's other
methods take it; ``examples`` its examples and ``tokens`` its tokens when it says (reported:
events, throughput); ``weight`` the count its mean loss is a mean over (its examples or its
tokens, by ``mean_over``): what weights its loss, its gradients and the reported losses."""


class BatchModel(Protocol):
    """What the step kernel sees of a model, :class:`SupervisedModel` and
    :class:`~lampdist.LossModel` alike: one interface, whatever a batch looks like.

    :meth:`load` runs on the loading thread (it must not read the device); the others on the
    compute thread, in the mode and grad mode the caller set.
    """

    module: torch.nn.Module
    metrics: Mapping[str, Any]
    flops_per_example: float | Literal["count"] | None
    mean_over: MeanOver

    def load(self, batch: object, device: torch.device) -> Loaded:
        """``batch`` checked (:class:`BadBatch`), counted and moved to ``device``."""
        ...

    def batch_loss(self, data: Any) -> torch.Tensor:
        """The mean loss (a scalar tensor) of a loaded batch's ``data``."""
        ...

    def batch_loss_and_output(self, data: Any) -> tuple[torch.Tensor, Any]:
        """The mean loss and what the metrics see of the same forward."""
        ...

    def metric_target(self, data: Any) -> Any:
        """The second argument of the metrics' calls (the target, or the whole batch)."""
        ...


def check_mean_over(owner: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is ``"examples"`` or ``"tokens"``."""
    if value not in MEAN_OVER:
        raise ConfigError(
            f"{owner}.mean_over must be 'examples' or 'tokens', got {value!r}: pass 'tokens' "
            "for a loss that is a mean over tokens (a language model's), else 'examples'",
            phase="configure",
        )


def weight_of(examples: int, tokens: int | None, mean_over: MeanOver) -> int:
    """A batch's weight: its ``examples``, or its ``tokens`` (:class:`BadBatch` when the
    batch does not say how many)."""
    if mean_over == "examples":
        return examples
    if tokens is None:
        raise BadBatch(
            "mean_over='tokens' weights each batch by its tokens, but a batch did not say "
            "how many it holds (its token count gave None): pass tokens=, a function that "
            "counts the positions its loss is a mean over"
        )
    return tokens


def _check_flops(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None or value == "count":
        return
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return
    raise ConfigError(
        f"{type(instance).__name__}.flops_per_example must be a number > 0, 'count' or None, "
        f"got {value!r}: pass 'count' to count them once on the first batch",
        phase="configure",
    )


def _check_mean_over(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_mean_over(type(instance).__name__, value)


def original_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module that ``torch.compile`` wrapped (``module._orig_mod``, through every layer of
    wrapping), else ``module`` itself.

    Its parameter and state-dict names are the model's own (``0.weight``, where the wrapper's
    are ``_orig_mod.0.weight``): lampdist stores, loads and compares state dicts and layouts
    of this module, so that compiled and eager runs share checkpoints and agree.
    """
    # A module can only be an OptimizedModule once torch._dynamo is loaded: no import here.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized: type[torch.nn.Module] | None = getattr(eval_frame, "OptimizedModule", None)
    while optimized is not None and isinstance(module, optimized):
        module = module.get_submodule("_orig_mod")
    return module


@attrs.define(eq=False)
class SupervisedModel:
    """A module and its loss: ``loss_fn(module(inputs), target)`` is the mean loss of a batch.

    A batch is ``(inputs, target)``: ``inputs`` a tensor, or a tuple or dict of tensors (a
    tuple is passed as positional arguments, a dict as keyword arguments); ``target`` anything
    ``loss_fn`` takes. Its example count is ``len(target)`` unless ``example_count`` says
    otherwise. The loss must be the *mean* over the batch's examples: lampdist weights it by
    the example count so that n ranks train exactly like one process on all their examples.

    ``metrics`` maps names to what every training and validation pass reports beside the
    loss, from the same forward: :class:`~lampdist.Metric` values (a function of ``(output,
    target)`` returning a sum and a count) or torchmetrics metrics whose states reduce by
    sum. They are exact over uneven shards: see :class:`~lampdist.Metric`. Every rank gives
    the same names and shapes (checked when the ranks agree), and a torchmetrics object of its
    own. Raises :class:`~lampdist.ConfigError` for a metric named ``"loss"``, of another kind,
    or with a state that does not reduce by sum (``dist_reduce_fx="cat"``, ``"mean"``, ...).

    ``token_count`` says how many tokens a batch holds, from its target (default
    :func:`count_tokens`: an integer target of two or more dimensions holds one a position;
    return ``None`` for a batch that does not say). It runs on the loading thread and must not
    read the device. ``flops_per_example`` is the model's floating-point operations for one
    example's forward and backward, for the model FLOPs utilization
    (:attr:`~lampdist.PassEvent.mfu`): a number, ``"count"`` to have the root count them once
    with ``torch.utils.flop_counter`` on its first training batch (the matrix products of
    forward and backward), or ``None`` (no MFU).
    """

    module: torch.nn.Module
    loss_fn: Callable[[Any, Any], torch.Tensor]
    example_count: Callable[[Any], int] = count_examples
    metrics: Mapping[str, Metric | torch.nn.Module] = attrs.field(
        factory=dict, converter=check_metrics, kw_only=True
    )
    token_count: Callable[[Any], int | None] = attrs.field(default=count_tokens, kw_only=True)
    flops_per_example: float | Literal["count"] | None = attrs.field(
        default=None, validator=_check_flops, kw_only=True
    )
    mean_over: MeanOver = attrs.field(default="examples", validator=_check_mean_over, kw_only=True)

    def load(self, batch: object, device: torch.device) -> tuple[Any, int, int | None, int]:
        """``batch`` as ``(inputs, target)`` (:class:`BadBatch` for anything else), counted
        from its target, and moved to ``device``: the loaded data is the pair."""
        inputs, target = check_batch(batch)
        examples = self.example_count(target)
        tokens = self.token_count(target)
        weight = examples if self.mean_over == "examples" else weight_of(examples, tokens, "tokens")
        data = (move_to_device(inputs, device), move_to_device(target, device))
        return data, examples, tokens, weight

    def batch_loss(self, data: tuple[Any, Any]) -> torch.Tensor:
        """:meth:`forward_loss` of a loaded ``(inputs, target)`` pair."""
        inputs, target = data
        return self.forward_loss(inputs, target)

    def batch_loss_and_output(self, data: tuple[Any, Any]) -> tuple[torch.Tensor, Any]:
        """:meth:`forward_loss_and_output` of a loaded ``(inputs, target)`` pair."""
        inputs, target = data
        return self.forward_loss_and_output(inputs, target)

    def metric_target(self, data: tuple[Any, Any]) -> Any:
        """The target: a metric gets ``(output, target)``."""
        return data[1]

    def forward_loss(self, inputs: Any, target: Any) -> torch.Tensor:
        """The mean loss of one batch (the module's mode and grad mode are the caller's)."""
        loss, _ = self.forward_loss_and_output(inputs, target)
        return loss

    def forward_loss_and_output(self, inputs: Any, target: Any) -> tuple[torch.Tensor, Any]:
        """The mean loss of one batch and the module's output it came from: one forward for
        the loss and the metrics (the module's mode and grad mode are the caller's)."""
        if isinstance(inputs, torch.Tensor):  # first: a cheap check, the usual case
            output = self.module(inputs)
        elif isinstance(inputs, Mapping):
            output = self.module(**inputs)
        elif isinstance(inputs, tuple | list):
            output = self.module(*inputs)
        else:
            output = self.module(inputs)
        loss = self.loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise BadBatch(
                "loss_fn must return a scalar tensor (the mean loss over the batch), "
                f"got {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            )
        # A scalar already (the usual case) is returned as it is: reshaping is an operator.
        return (loss if loss.dim() == 0 else loss.reshape(())), output


def move_to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (nested tuples, lists and dicts) moved to ``device``.

    Pinned CPU tensors are copied without blocking the host.
    """
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        return value.to(device, non_blocking=value.is_pinned())
    if isinstance(value, Mapping):
        return {key: move_to_device(item, device) for key, item in value.items()}
    if isinstance(value, tuple | list):
        moved = [move_to_device(item, device) for item in value]
        return tuple(moved) if isinstance(value, tuple) else moved
    return value


def check_batch(batch: object) -> tuple[Any, Any]:
    """``batch`` as ``(inputs, target)``; raises :class:`BadBatch` for anything else."""
    if type(batch) is tuple and len(batch) == 2:  # the usual case, without the ABC check
        first, second = batch
        return first, second
    if not isinstance(batch, Sequence) or isinstance(batch, str | bytes) or len(batch) != 2:
        raise BadBatch(
            "a batch must be an (inputs, target) pair, "
            f"got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, Sequence) else "")
        )
    inputs, target = batch
    return inputs, target
