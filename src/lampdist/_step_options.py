"""How every rank steps: :class:`StepOptions`, which all ranks must agree on (checked when
they join), and ``StepOn``, the designs it chooses between."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from typing import Literal

import attrs
import torch

from ._errors import ConfigError
from ._fsdp_options import FsdpPolicy
from ._option_checks import is_int, optional, positive, validator
from ._step_schedules import agreed_values, as_step_schedule, is_step_schedule
from .schedules import RateSchedule, StepSchedule

__all__ = ["StepOn", "StepOptions"]

StepOn = Literal["root", "every_rank", "sharded", "fsdp"]

SHARDS_THE_MODEL: Mapping[StepOn, bool] = {
    "root": False,
    "every_rank": False,
    "sharded": False,
    "fsdp": True,
}
"""Whether the design of each ``step_on`` shards the model itself (fsdp): it then exchanges the
gradients in buckets of its own (each sharded module's), so that ``bucket_cap_mb`` does not
apply, and it alone can read initial weights shard by shard. The one design fact the options
need before any design exists."""

_DEPRECATED = "deprecated"
"""The metadata key of a field kept only for an old name: not agreed, not shown."""


@attrs.frozen(kw_only=True)
class StepOptions:
    """How every rank steps; all ranks must pass equal ones (checked when they join).

    ``step_on`` chooses the design: where the optimizer steps and how the gradients travel.
    Under every design lampdist runs the forward and backward passes and calls ``step()``
    itself, so an optimizer whose ``step`` needs a closure (``LBFGS``) raises
    :class:`~lampdist.ConfigError` when it is built.

    ``steps_per_epoch`` makes each epoch a window of that many optimizer steps over the
    training data instead of one pass over it: every rank reads its training source as one
    stream across epochs, calling it again for its next pass over the data when it runs out
    (the source's :class:`~lampdist.PassContext` then counts those passes in ``epoch``), so
    validation, checkpoints, the schedule and the best model come every N steps under lamp's
    rules. Checkpoints then hold each rank's place in its data (the source's
    ``state_dict()`` when it has one, as torchdata's ``StatefulDataLoader`` does, else the
    batches to skip), and a resumed run goes on with the next batch.

    Raises :class:`~lampdist.ConfigError` (phase ``'configure'``, naming the field) for a
    value out of range, and for ``learning_rate_per_step`` without ``steps_per_epoch``.
    """

    accumulate_gradient_over_n_batches: int = attrs.field(
        default=1,
        validator=validator(
            lambda value: is_int(value) and value >= 1,
            "an int >= 1",
            "pass 1 to step after every batch",
        ),
    )
    """How many batches make one step (an int >= 1): their gradients add up before it."""
    global_accumulation: int | None = attrs.field(
        default=None,
        validator=validator(
            optional(lambda value: is_int(value) and value >= 1),
            "an int >= 1 or None",
            "pass None to give the accumulation per rank",
        ),
    )
    """How many batches make one step over every rank together (an int >= 1), as a DDP
    script's ``gradient_accumulation_steps`` before it divides by the world size, or
    torchtitan's global batch over the local one: each of ``n`` ranks accumulates
    ``global_accumulation / n`` batches (it must divide; set
    ``accumulate_gradient_over_n_batches`` or this, not both). ``None``: the accumulation is
    ``accumulate_gradient_over_n_batches``, per rank. Resolved into the per-rank count once
    the rank count is known (:meth:`per_rank`)."""
    autocast_dtype: torch.dtype | None = attrs.field(
        default=None,
        validator=validator(
            lambda value: value in (None, torch.bfloat16, torch.float16),
            "torch.bfloat16, torch.float16 or None",
            "pass None to run the forward passes in the parameters' dtype",
        ),
    )
    """Run forward passes under ``torch.autocast`` in this dtype: ``torch.bfloat16``, or
    ``torch.float16`` with dynamic loss scaling (``None``: no autocast)."""
    step_on: StepOn = attrs.field(
        default="root",
        validator=validator(
            lambda value: value in ("root", "every_rank", "sharded", "fsdp"),
            "'root', 'every_rank', 'sharded' or 'fsdp'",
            "pass 'root' to step on the root alone (lamp's design)",
        ),
    )
    """Where the optimizer steps. ``"root"`` (lamp's design) keeps the optimizer on the root:
    gradients are reduced to it and the parameters broadcast back. ``"every_rank"``
    all-reduces the gradients and every rank steps its own optimizer (followers need
    ``optimizer_factory`` too): one collective a step instead of two, the same updates.
    ``"sharded"`` reduce-scatters the gradients, so that each rank steps only the slice of the
    parameters it owns with ``1/n`` of the optimizer state, and all-gathers the parameters
    (followers need ``optimizer_factory`` too, and the optimizer must treat each element on
    its own: SGD, Adam, AdamW, Adagrad, RMSprop and the like; others raise
    :class:`~lampdist.ConfigError`); checkpoints still hold the whole optimizer state.
    ``"fsdp"`` shards the model itself with FSDP2 (``fully_shard``, as ``fsdp`` says), so that
    parameters, gradients and optimizer state are each ``1/n`` per rank and a model bigger
    than one device trains (one rank per process; see docs/howto-big-models.md)."""
    bucket_cap_mb: float | None = attrs.field(
        default=None,
        validator=validator(
            optional(positive),
            "> 0 megabytes or None",
            "pass None to exchange the gradients after backward",
        ),
    )
    """Cut the gradients into buckets of about this many megabytes whose exchange starts while
    backward still runs (``None``: one exchange per flat buffer after backward)."""
    max_grad_norm: float | None = attrs.field(
        default=None,
        validator=validator(
            optional(lambda value: isinstance(value, numbers.Real) and float(value) > 0),
            "a number > 0 or None",
            "pass None not to clip",
        ),
    )
    """Clip the averaged gradients by their global norm to at most this (``None``: no
    clipping)."""
    measure_grad_norm: bool = attrs.field(
        default=False,
        validator=validator(lambda value: isinstance(value, bool), "a bool", "pass True or False"),
    )
    """Report the global norm of the averaged gradients before clipping, per training pass
    (:attr:`~lampdist.PassEvent.grad_norm`). Always on with ``max_grad_norm``, which computes
    it anyway; otherwise it costs one norm a step, and under ``"sharded"`` and ``"fsdp"`` one
    all-reduce of a scalar a step. (Its old name, ``grad_norm``, still works, warned.)"""
    grad_norm_every: int = attrs.field(
        default=1,
        validator=validator(
            lambda value: is_int(value) and value >= 1,
            "an int >= 1",
            "pass 1 to measure every step",
        ),
    )
    """With ``measure_grad_norm`` (and no ``max_grad_norm``, which measures every step): measure the
    norm on the first step of each pass and every this many steps after it, and report the
    mean and the largest of those (the norm reads every gradient once: on a model whose step
    is mostly the optimizer's memory traffic, such as the benchmark's ``mlp``, about 10% of a
    step; every 10 steps, 1%)."""
    measure_step_split: bool = attrs.field(
        default=True,
        validator=validator(lambda value: isinstance(value, bool), "a bool", "pass True or False"),
    )
    """Measure where each rank's steps spend their time (:attr:`~lampdist.PassEvent.step_split`):
    clocks on the CPU, CUDA timing events on a GPU (no host synchronization); ``False``
    measures nothing. (Its old name, ``step_split``, still works, warned.)"""
    non_finite_loss: Literal["raise", "skip"] = attrs.field(
        default="raise",
        validator=validator(
            lambda value: value in ("raise", "skip"),
            "'raise' or 'skip'",
            "pass 'skip' to skip such steps with a warning",
        ),
    )
    """What a step whose summed loss is not finite does: ``"raise"``
    :class:`~lampdist.NonFiniteLoss`, or ``"skip"`` the step with a warning; either names the
    ranks whose own loss was not finite, on CUDA only where every rank reads the step's loss
    at once (see docs/reliability.md)."""
    shuffle_seed: int = attrs.field(
        default=0, validator=validator(is_int, "an int", "pass e.g. shuffle_seed=0")
    )
    """Seeds the :class:`~lampdist.PassContext` of every pass, which a batch source that
    shuffles draws its order from (each rank, epoch and kind of pass gets its own seed)."""
    steps_per_epoch: int | None = attrs.field(
        default=None,
        validator=validator(
            optional(lambda value: is_int(value) and value >= 1),
            "an int >= 1 or None",
            "pass None for epochs of one pass over the data",
        ),
    )
    """Make each epoch a window of this many optimizer steps over the training data (see
    above); ``None``: an epoch is one pass over it."""
    learning_rate_per_step: StepSchedule | RateSchedule | None = attrs.field(
        default=None,
        converter=as_step_schedule,
        validator=validator(
            optional(is_step_schedule),
            "a function step -> factor, a schedules.StepSchedule, schedules.rate(...) or None",
            "pass e.g. lambda step: min(1.0, (step + 1) / 100) or "
            "schedules.transformers_cosine_with_warmup(...)",
        ),
    )
    """Multiply the learning rate of each step by a factor of the global step (needs
    ``steps_per_epoch``): any function ``step -> factor`` (a lambda too, kept wrapped), a
    :class:`~lampdist.schedules.StepSchedule`, or :func:`~lampdist.schedules.rate` for one
    that gives the learning rate itself. The ranks agree on it by the values it gives."""

    fsdp: FsdpPolicy = attrs.field(
        factory=FsdpPolicy,
        validator=validator(
            lambda value: isinstance(value, FsdpPolicy),
            "a lampdist.FsdpPolicy",
            "pass e.g. FsdpPolicy(shard_modules=(MyBlock,))",
        ),
    )
    """How ``step_on="fsdp"`` shards the model and its precision (ignored by the other
    designs)."""
    _grad_norm: bool | None = attrs.field(
        default=None, alias="grad_norm", repr=False, eq=False, metadata={_DEPRECATED: True}
    )
    """``grad_norm=``, the deprecated name of ``measure_grad_norm`` (read as ``None`` once
    built)."""
    _step_split: bool | None = attrs.field(
        default=None, alias="step_split", repr=False, eq=False, metadata={_DEPRECATED: True}
    )
    """``step_split=``, the deprecated name of ``measure_step_split``."""

    def __attrs_post_init__(self) -> None:
        for old, new in _RENAMED:
            _take_old_name(self, old, new)
        if SHARDS_THE_MODEL[self.step_on] and self.bucket_cap_mb is not None:
            raise ConfigError(
                "StepOptions.bucket_cap_mb does not apply to step_on='fsdp', which exchanges "
                "the gradients of each sharded module as its backward ends (choose the "
                "modules with FsdpPolicy.shard_modules); pass bucket_cap_mb=None",
                phase="configure",
            )
        if self.fsdp.initial_weights is not None and not SHARDS_THE_MODEL[self.step_on]:
            raise ConfigError(
                f"FsdpPolicy.initial_weights applies to step_on='fsdp', not {self.step_on!r}: "
                "under another design load them on the root before the run "
                "(weights.load_into(module); the root's weights reach every rank)",
                phase="configure",
            )
        if self.global_accumulation is not None and self.accumulate_gradient_over_n_batches != 1:
            raise ConfigError(
                f"StepOptions got global_accumulation={self.global_accumulation} and "
                f"accumulate_gradient_over_n_batches={self.accumulate_gradient_over_n_batches}: "
                "pass one of them (the global count is the per-rank count times the ranks)",
                phase="configure",
            )
        if self.learning_rate_per_step is not None and self.steps_per_epoch is None:
            raise ConfigError(
                "StepOptions.learning_rate_per_step needs steps_per_epoch: the global step of "
                "a step is epoch * steps_per_epoch + the step in the epoch; pass both",
                phase="configure",
            )

    def per_rank(self, nranks: int, *, rank: int | None = None) -> StepOptions:
        """These options for a run of ``nranks`` ranks: ``global_accumulation`` resolved into
        ``accumulate_gradient_over_n_batches`` (itself when there is none). Raises
        :class:`~lampdist.ConfigError` naming both numbers when ``nranks`` does not divide
        it."""
        total = self.global_accumulation
        if total is None:
            return self
        if total % nranks:
            below, above = total // nranks * nranks, -(-total // nranks) * nranks
            instead = " or ".join(str(n) for n in dict.fromkeys((below, above)) if n > 0)
            raise ConfigError(
                f"StepOptions.global_accumulation={total} does not divide by the {nranks} "
                f"ranks: each rank accumulates global_accumulation / {nranks} batches; pass a "
                f"multiple of {nranks} (e.g. {instead})",
                rank=rank,
                phase="configure",
            )
        return attrs.evolve(
            self, accumulate_gradient_over_n_batches=total // nranks, global_accumulation=None
        )

    @property
    def bucket_cap_bytes(self) -> int | None:
        """``bucket_cap_mb`` in bytes (at least 1), or ``None``: the one reading of it."""
        if self.bucket_cap_mb is None:
            return None
        return max(1, int(self.bucket_cap_mb * 2**20))

    def agreed_fields(self) -> list[tuple[str, str]]:
        """Every field as (name, repr of its value): what ranks compare when they join. A
        step schedule is described by the values it gives (a lambda's repr is its address)."""
        return [
            (f.name, self._agreed(f.name))
            for f in attrs.fields(StepOptions)
            if not f.metadata.get(_DEPRECATED)
        ]

    def _agreed(self, name: str) -> str:
        value = getattr(self, name)
        if name == "learning_rate_per_step" and value is not None:
            assert self.steps_per_epoch is not None  # checked when built
            return agreed_values(value, self.steps_per_epoch)
        return repr(value)

    @property
    def grad_norm(self) -> bool:
        """Deprecated: :attr:`measure_grad_norm`."""
        _warn_renamed("grad_norm", "measure_grad_norm", stacklevel=3)
        return self.measure_grad_norm

    @property
    def step_split(self) -> bool:
        """Deprecated: :attr:`measure_step_split`."""
        _warn_renamed("step_split", "measure_step_split", stacklevel=3)
        return self.measure_step_split


_RENAMED = (("_grad_norm", "measure_grad_norm"), ("_step_split", "measure_step_split"))
"""The switches that took the names of the measurements they turn on: the old field (its
init name without the underscore), the new one."""


def _warn_renamed(old: str, new: str, *, stacklevel: int) -> None:
    warnings.warn(
        f"StepOptions.{old} is now StepOptions.{new} (PassEvent.{old} is the measurement)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _take_old_name(options: StepOptions, old: str, new: str) -> None:
    """Move a value given by its deprecated name ``old`` to field ``new``, warned."""
    value = getattr(options, old)
    if value is None:
        return
    _warn_renamed(old.lstrip("_"), new, stacklevel=5)
    if not isinstance(value, bool):
        raise ConfigError(
            f"StepOptions.{new} must be a bool, not {value!r}; pass True or False",
            phase="configure",
        )
    object.__setattr__(options, new, value)  # frozen: the one write, while it is built
    object.__setattr__(options, old, None)
