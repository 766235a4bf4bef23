"""What every stepping design is: the base class and what the step kernel hands a step.

A design (see the package docstring for the list and the guide to adding one) is one object
per rank, built once before the rank joins (:meth:`Design.create`: the flat buffer layout and
the optimizer, where this rank steps) and connected to each clique the rank opens
(:meth:`Design.connect`). The step kernel runs the pass loop and the model; everything that
differs between designs happens in the design's methods, on the rank's compute thread.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Protocol, Self

import attrs
import torch

from ..._checkpoint import ShardedState
from ..._effects import OptimizerFactory
from ..._errors import ConfigError
from ..._options import StepOptions
from ..._state import TrainingState
from ...clique import Clique
from .._blame import NonFiniteSteps
from .._clock import NO_CLOCK, StepClock
from .._feed import BatchFeed, LoadedBatch
from .._flat import FlatParameters
from .._shard import check_closure_free
from .._stepper import LossScale, Stepper
from .._tally import Tally

__all__ = ["Backward", "CheckOptimizer", "Design", "StepBatches", "build_optimizer"]


class Backward(Protocol):
    """Runs the model's forward on a batch and the backward of its mean loss times a weight
    (times the fp16 loss scale); returns the mean loss, detached (the kernel's model code).
    ``before_backward`` is called with the mean loss, detached, between the two."""

    def __call__(
        self,
        batch: LoadedBatch,
        weight: float,
        before_backward: Callable[[torch.Tensor], None] | None = None,
        /,
    ) -> torch.Tensor: ...


CheckOptimizer = Callable[[int, torch.optim.Optimizer], None]
"""Raises :class:`ConfigError` for an optimizer the configured design cannot step."""


def build_optimizer(
    rank: int,
    factory: OptimizerFactory,
    parameters: list[torch.nn.Parameter],
    check: CheckOptimizer,
) -> torch.optim.Optimizer:
    """``factory(parameters)``, checked as every design checks it: a
    :class:`torch.optim.Optimizer`, stepping without a closure, and one ``check`` accepts
    (raises :class:`ConfigError` naming ``rank``)."""
    optimizer = factory(parameters)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            "optimizer_factory must return a torch.optim.Optimizer, "
            f"got {type(optimizer).__name__}",
            rank=rank,
            phase="configure",
        )
    check_closure_free(rank, optimizer)
    check(rank, optimizer)
    return optimizer


@attrs.frozen
class StepBatches:
    """What a training step takes its batches from: the pass's feed, the kernel's model code
    (:data:`Backward`), how many batches make a step, and a padding pass (``pad``: a forward
    and backward of weight 0 on the rank's last batch, with no metric; fsdp runs one where a
    rank has no batch, so that its collectives meet the other ranks')."""

    feed: BatchFeed
    backward: Backward
    accumulate: int
    pad: Callable[[], None]
    counts: list[int] | None = None
    """Every rank's batch count of the pass, by rank, when every one is known (a window's:
    ``steps_per_epoch`` times ``accumulate`` each), else ``None``."""


@attrs.define(eq=False)
class Design(abc.ABC):
    """How one rank steps: its flat buffer layout, whether it holds an optimizer, how the
    gradients travel, what follows a step, and what it contributes to checkpoints.

    Subclasses set :attr:`followers_step`, may override :meth:`lay_out` and
    :meth:`check_optimizer` (setup), and implement :meth:`names_every_rank` and
    :meth:`train_step`; the other methods have the defaults of a design whose optimizer
    lives on the root alone.
    """

    rank: int
    nranks: int
    device: torch.device
    flat: FlatParameters
    options: StepOptions
    stepper: Stepper | None
    """This rank's optimizer step, or ``None`` where the rank does not step."""
    loss_scale: LossScale
    """fp16 dynamic loss scaling (the stepper's own where this rank steps)."""
    non_finite: NonFiniteSteps = attrs.field(init=False)
    """What a step whose summed loss is not finite does (set by :meth:`connect`)."""
    _clique: Clique | None = attrs.field(default=None, init=False)
    clock: StepClock = attrs.field(default=NO_CLOCK, init=False)
    """Where the steps' time goes (set by the step kernel for each training pass): a step
    marks the end of each of its parts (see ``_clock``)."""

    followers_step: ClassVar[bool] = False
    """Whether every rank holds an optimizer (the followers need ``optimizer_factory``)."""
    own_process: ClassVar[bool] = False
    """Whether each rank needs a process of its own (torch's default process group: fsdp);
    the in-process loop refuses such a design."""
    lockstep: ClassVar[bool] = False
    """Whether every rank must run as many forward passes as the others (the design's
    collectives run inside forward and backward): a validation pass then agrees before each
    batch whether any rank has one, and a rank without runs a padding forward."""
    loads_checkpoints: ClassVar[bool] = False
    """Whether the design loads the model and optimizer state it resumes from itself, in
    :meth:`prepare`, and has every rank write its own shards of a checkpoint (fsdp), rather
    than the root loading and writing the whole state."""
    recovers: ClassVar[bool] = True
    """Whether a lost rank's state is elsewhere too, so that in-job recovery can replace it
    (fsdp: each rank keeps a replica of its neighbour's shards, see ``_fsdp_replica``)."""
    keeps_best_model: ClassVar[bool] = True
    """Whether the root can keep the best model (it holds the whole model; not fsdp)."""

    # -- setup, before the rank joins -----------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        rank: int,
        nranks: int,
        module: torch.nn.Module,
        device: torch.device,
        options: StepOptions,
        optimizer_factory: OptimizerFactory | None,
        check_optimizer: CheckOptimizer | None = None,
    ) -> Self:
        """Lay ``module`` out on ``device`` (:meth:`lay_out`) and build this rank's optimizer
        over its flat parameters where it steps (the root always; every rank when
        :attr:`followers_step`). ``check_optimizer`` is the configured design's check (a rank
        alone runs another design but refuses what the configured one would). Raises
        :class:`ConfigError` for a factory that returns no optimizer or one the design cannot
        step."""
        flat = cls.lay_out(module, device, nranks, options)
        loss_scale = LossScale(enabled=options.autocast_dtype == torch.float16)
        stepper = None
        if rank == 0 or cls.followers_step:
            if optimizer_factory is None:
                raise ConfigError(
                    "this rank steps and needs an optimizer_factory", rank=rank, phase="configure"
                )
            check = check_optimizer or cls.check_optimizer
            optimizer = build_optimizer(rank, optimizer_factory, flat.parameters, check)
            stepper = cls.create_stepper(rank, optimizer, flat, options, loss_scale)
        return cls(
            rank=rank,
            nranks=nranks,
            device=device,
            flat=flat,
            options=options,
            stepper=stepper,
            loss_scale=loss_scale,
        )

    @classmethod
    def lay_out(
        cls, module: torch.nn.Module, device: torch.device, nranks: int, options: StepOptions
    ) -> FlatParameters:
        """``module``'s flat buffers on ``device``: by default whole buffers, with gradients."""
        return FlatParameters.create(module, device)

    @classmethod
    def check_optimizer(cls, rank: int, optimizer: torch.optim.Optimizer) -> None:
        """Raise :class:`ConfigError` for an optimizer this design cannot step (none here)."""
        return

    @classmethod
    def create_stepper(
        cls,
        rank: int,
        optimizer: torch.optim.Optimizer,
        flat: FlatParameters,
        options: StepOptions,
        loss_scale: LossScale,
    ) -> Stepper:
        """The stepper over ``optimizer`` (whole gradients here)."""
        return Stepper.create(rank, optimizer, flat, options, loss_scale)

    def prepare(self, resume: TrainingState | None) -> None:
        """What the design does once every rank agreed and before the parameters are synced,
        on every rank in step, with the root's checkpoint to resume from (``None`` on the
        followers and for a new run). Nothing by default (the root loaded the checkpoint
        before; fsdp shards the model, builds the optimizer and loads the checkpoint here)."""
        return

    # -- the clique ---------------------------------------------------------------------------

    def connect(self, clique: Clique) -> None:
        """Use ``clique`` for every collective from now on (once per clique the rank opens)."""
        self._clique = clique
        self.loss_scale.nominal = 0  # every rank of a new clique starts from no step
        gather = self.all_gather if self.names_every_rank() else None
        self.non_finite = NonFiniteSteps(
            rank=self.rank,
            nranks=self.nranks,
            policy=self.options.non_finite_loss,
            gather=gather,
        )

    @property
    def clique(self) -> Clique:
        """The clique of :meth:`connect`."""
        if self._clique is None:
            raise AssertionError(f"rank {self.rank}: the design is not connected to a clique")
        return self._clique

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Gather every rank's ``input`` into ``output`` and wait."""
        self.clique.start_all_gather(output, input).wait_blocking(None)

    @abc.abstractmethod
    def names_every_rank(self) -> bool:
        """Whether every rank learns that a step's summed loss was not finite at the same point
        of the same step, so that they can all-gather their own losses there (see
        ``_blame``)."""

    # -- a training pass ------------------------------------------------------------------------

    def attached(self) -> AbstractContextManager[object]:
        """What the design hooks into autograd for one pass (nothing by default)."""
        return nullcontext()

    @abc.abstractmethod
    def train_step(
        self, batches: StepBatches, *, epoch: int, step: int, tally: Tally, planned: int | None
    ) -> bool:
        """One training step: take up to ``batches.accumulate`` batches, forward and backward,
        exchange, step where the optimizer lives, publish; record the step in ``tally`` where
        this rank steps. Returns whether any rank has more batches (only meaningful when
        ``planned``, the pass's step count when every rank knows it, is ``None``)."""

    def settle(self) -> None:
        """Wait for what the last step sent (the end of a pass; nothing by default)."""
        return

    # -- between passes --------------------------------------------------------------------------

    def sync_optimizer_state(self) -> None:
        """Give every stepping rank the optimizer state it starts from (nothing by default:
        the root's optimizer is the only one)."""
        return

    def checkpoint_shards(self, shards: ShardedState | None) -> list[tuple[str, int, list[str]]]:
        """Where the design writes each rank's shards of a checkpoint (fsdp): write this
        rank's into the root's ``shards`` (a collective) and return its files as (name, size,
        block checksums). Nothing by default: the root holds the whole state."""
        return []

    def checkpoint_optimizer_state(self) -> dict[str, Any] | None:
        """The whole optimizer state a checkpoint holds, on the root (``None`` elsewhere).
        Every rank calls it, between passes."""
        if self.rank != 0:
            return None
        assert self.stepper is not None  # the root steps in every design
        return self.stepper.optimizer.state_dict()
