"""How ``step_on="fsdp"`` shards a model and in which dtypes it computes: :class:`FsdpPolicy`
and :class:`Precision`, part of :class:`~lampdist.StepOptions` (so every rank must pass equal
ones: the agreement check compares their descriptions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from ._errors import ConfigError
from ._weights_import import StoredWeights

__all__ = ["FsdpPolicy", "Parallelize", "Precision", "describe_callable"]

Parallelize = Callable[[torch.nn.Module, Any], None]
"""Shards a module in place given a ``torch.distributed.DeviceMesh`` of every rank (the
torchtitan pattern: call ``fully_shard`` on the blocks, then on the root module)."""

_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype(value: object) -> bool:
    return value in _DTYPES


def _check_dtype(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not _dtype(value):
        raise ConfigError(
            f"Precision.{attribute.name} must be a floating torch.dtype or None, got {value!r}",
            phase="configure",
        )


def describe_callable(function: object) -> str:
    """A callable's qualified name (the same in every process, unlike its ``repr``)."""
    module = getattr(function, "__module__", None) or "?"
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{module}.{name}"


@attrs.frozen(kw_only=True)
class Precision:
    """The dtypes of a sharded model's computation (FSDP2's ``MixedPrecisionPolicy``), as one
    visible object: printed when the run starts, compared between ranks when they join and
    stored with each checkpoint.

    ``param_dtype``: the dtype the parameters are gathered in for forward and backward;
    ``reduce_dtype``: the dtype the gradients are summed in over the ranks; ``output_dtype``:
    the dtype of the root module's floating outputs. ``None`` keeps the parameters' own dtype
    (no cast). The optimizer always steps the parameters in their own dtype."""

    param_dtype: torch.dtype | None = attrs.field(default=None, validator=_check_dtype)
    reduce_dtype: torch.dtype | None = attrs.field(default=None, validator=_check_dtype)
    output_dtype: torch.dtype | None = attrs.field(default=None, validator=_check_dtype)

    def to_torch(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` with these dtypes."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            output_dtype=self.output_dtype,
            cast_forward_inputs=self.param_dtype is not None,
        )

    def describe(self) -> str:
        """``param bfloat16, reduce float32, output as computed``: for logs and errors."""

        def name(dtype: torch.dtype | None, none: str) -> str:
            return none if dtype is None else str(dtype).removeprefix("torch.")

        return (
            f"param {name(self.param_dtype, 'as stored')}, "
            f"reduce {name(self.reduce_dtype, 'as gathered')}, "
            f"output {name(self.output_dtype, 'as computed')}"
        )

    def to_plain(self) -> dict[str, str | None]:
        """The dtypes by field name, as strings (what a checkpoint stores)."""
        return {
            field.name: None if value is None else str(value).removeprefix("torch.")
            for field in attrs.fields(Precision)
            for value in [getattr(self, field.name)]
        }


def _check_types(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(t, type) for t in value):
        raise ConfigError(
            f"FsdpPolicy.shard_modules must be module classes, got {value!r}; "
            "pass e.g. shard_modules=(MyBlock,)",
            phase="configure",
        )


def _types(value: object) -> object:
    if isinstance(value, type):
        return (value,)
    if isinstance(value, list | set | frozenset):
        return tuple(value)
    return value


def _check_callable(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise ConfigError(
            f"FsdpPolicy.{attribute.name} must be callable or None, got {value!r}",
            phase="configure",
        )


@attrs.frozen(kw_only=True, repr=False)
class FsdpPolicy:
    """How ``step_on="fsdp"`` shards the model over the ranks, before ``optimizer_factory``
    is called (so that the optimizer is built over the sharded parameters).

    By default each child module whose type is one of ``shard_modules`` (a transformer's
    blocks) gets its own ``fully_shard``, inner ones first (the types may nest), then the
    root module (which takes the parameters left); with no ``shard_modules`` the root
    module alone is sharded (one unit: the whole model is gathered for each forward).
    ``parallelize(module, mesh)`` replaces that default for anything else: it must call
    ``fully_shard`` itself, the root module last, with the ``mesh`` it is given and the
    :meth:`Precision.to_torch` policy it wants.

    ``init_weights(module)`` initializes one module's own parameters and buffers when the
    model was built on the meta device (default: the module's ``reset_parameters()``); see
    docs/howto-big-models.md. ``reshard_after_forward`` frees each unit's gathered
    parameters after its forward (less memory, one more all-gather in backward).

    ``initial_weights`` (:func:`~lampdist.from_safetensors`) starts the run from stored
    weights: after sharding each rank reads the slices of its own shards from the files, so
    no rank reads or holds the whole model (a model built on the meta device then needs no
    initialization for the modules whose tensors are all stored). Every rank must reach the
    files at the same path. A run that resumes from a checkpoint loads the checkpoint
    instead. Only ``step_on="fsdp"`` reads it; under another design the root loads the
    weights itself (:meth:`~lampdist.StoredWeights.load_into`) before the run."""

    shard_modules: tuple[type[torch.nn.Module], ...] = attrs.field(
        default=(), converter=_types, validator=_check_types
    )
    precision: Precision = attrs.field(factory=Precision)
    parallelize: Parallelize | None = attrs.field(default=None, validator=_check_callable)
    init_weights: Callable[[torch.nn.Module], None] | None = attrs.field(
        default=None, validator=_check_callable
    )
    reshard_after_forward: bool = True
    initial_weights: StoredWeights | None = None

    def __attrs_post_init__(self) -> None:
        if self.initial_weights is not None and not isinstance(self.initial_weights, StoredWeights):
            raise ConfigError(
                f"FsdpPolicy.initial_weights must be lampdist.from_safetensors(path) or None, "
                f"got {self.initial_weights!r}",
                phase="configure",
            )
        if not isinstance(self.precision, Precision):
            raise ConfigError(
                f"FsdpPolicy.precision must be a lampdist.Precision, got {self.precision!r}",
                phase="configure",
            )

    def __repr__(self) -> str:
        # The same text in every process (the agreement check compares it): callables by
        # their qualified names, classes by module and name.
        types = ", ".join(describe_callable(t) for t in self.shard_modules)
        parts = [
            f"shard_modules=({types})",
            f"precision=({self.precision.describe()})",
            f"parallelize={describe_callable(self.parallelize) if self.parallelize else None}",
            f"init_weights={describe_callable(self.init_weights) if self.init_weights else None}",
            f"reshard_after_forward={self.reshard_after_forward}",
            f"initial_weights={self.initial_weights!r}",
        ]
        return f"FsdpPolicy({', '.join(parts)})"
