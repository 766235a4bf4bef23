"""Stepping designs: one object per rank that owns everything that differs between the ways
of stepping.

``StepOptions.step_on`` names a design; :func:`create_design` turns it, once per rank, into
the design object that the step kernel calls:

- :class:`Solo`: a rank alone (any ``step_on``): a plain loop's step, nothing exchanged;
- :class:`RootSteps` (``"root"``, lamp's design): gradients reduced to the root, which steps
  and broadcasts the parameters;
- :class:`EveryRankSteps` (``"every_rank"``): gradients all-reduced, every rank steps;
- :class:`ShardedSteps` (``"sharded"``): gradients reduce-scattered, each rank steps its slice
  and the parameters are all-gathered;
- :class:`FsdpSteps` (``"fsdp"``): the model itself sharded with FSDP2, on any number of
  ranks (one a process).

A design owns the flat buffer layout (:meth:`Design.lay_out`), whether the rank steps and
which optimizers it accepts (:attr:`Design.followers_step`, :meth:`Design.check_optimizer`,
:meth:`Design.create_stepper`), the training step from the kernel's batches to the update and
what is sent after it (:meth:`Design.train_step`; the exchanging designs share theirs in
:class:`ExchangingDesign`, and differ in :meth:`~ExchangingDesign.start_exchange`,
:meth:`~ExchangingDesign.start_step_exchanges` and :meth:`~ExchangingDesign.publish`), the
loss-scaling and clipping agreement over slices (:attr:`ExchangingDesign.combine`), which runs
name every rank of a non-finite loss (:meth:`Design.names_every_rank`), the optimizer-state
sync before the first pass (:meth:`Design.sync_optimizer_state`) and the optimizer state a
checkpoint holds (:meth:`Design.checkpoint_optimizer_state`). A design that shards the model
itself (fsdp) also sets it up once every rank has agreed (:meth:`Design.prepare`, which loads
the checkpoint too: :attr:`Design.loads_checkpoints`), runs every forward in step with the
other ranks (:attr:`Design.lockstep`: padding passes where a rank has no batch), needs a
process per rank (:attr:`Design.own_process`) and has each rank write its own part of a
checkpoint (:meth:`Design.checkpoint_shards`); its model setup is in ``_fsdp_model``.

Adding a design:

1. Write one module here with a subclass of :class:`ExchangingDesign` (or of :class:`Design`
   for a step that shares nothing with theirs); override what differs, nothing else.
2. Add its ``step_on`` value to :data:`lampdist.StepOn` and to ``StepOptions.step_on``'s
   validator, and one line to :data:`DESIGNS`.
3. Run ``tests/roles/test_local_exactness.py``: its design tests run every entry of
   :data:`DESIGNS` that the in-process loop can run
   (``test_every_design_matches_the_single_process_reference``, clipping) and require the
   update to equal one process stepping on the concatenation of every rank's batches; add
   the new value to the cases of its other tests that concern it. A design whose ranks need
   processes of their own (:attr:`Design.own_process`, fsdp) is tested the same way in
   processes (``tests/roles/test_fsdp.py``).
"""

from __future__ import annotations

import torch

from ..._effects import OptimizerFactory
from ..._options import StepOn, StepOptions
from ._base import Backward as Backward
from ._base import Design as Design
from ._base import StepBatches as StepBatches
from ._every_rank import EveryRankSteps as EveryRankSteps
from ._exchanging import ExchangingDesign as ExchangingDesign
from ._fsdp import FsdpSteps as FsdpSteps
from ._fsdp_replica import IN_MEMORY as IN_MEMORY
from ._fsdp_replica import replica_holder as replica_holder
from ._root import RootSteps as RootSteps
from ._sharded import ShardedSteps as ShardedSteps
from ._solo import Solo as Solo

__all__ = [
    "DESIGNS",
    "IN_MEMORY",
    "Backward",
    "Design",
    "EveryRankSteps",
    "ExchangingDesign",
    "FsdpSteps",
    "RootSteps",
    "ShardedSteps",
    "Solo",
    "StepBatches",
    "create_design",
    "replica_holder",
]

DESIGNS: dict[StepOn, type[Design]] = {
    "root": RootSteps,
    "every_rank": EveryRankSteps,
    "sharded": ShardedSteps,
    "fsdp": FsdpSteps,
}
"""The design of each ``step_on`` for two or more ranks (a rank alone runs :class:`Solo`,
except under fsdp, which shards over any number of ranks)."""


def create_design(
    *,
    rank: int,
    nranks: int,
    module: torch.nn.Module,
    device: torch.device,
    options: StepOptions,
    optimizer_factory: OptimizerFactory | None,
) -> Design:
    """Rank ``rank``'s design for ``options.step_on`` in a clique of ``nranks``, with
    ``module`` laid out on ``device`` and the rank's optimizer built (see
    :meth:`Design.create`). A rank alone runs :class:`Solo`, refusing the optimizers that the
    configured design refuses, so that a configuration fails the same way on any number of
    ranks; fsdp runs :class:`FsdpSteps` on one rank too (a model built on the meta device
    needs it). Runs on the rank's compute thread: moving the model and building the optimizer can
    take seconds."""
    configured = DESIGNS[options.step_on]
    design = Solo if nranks == 1 and configured is not FsdpSteps else configured
    return design.create(
        rank=rank,
        nranks=nranks,
        module=module,
        device=device,
        options=options,
        optimizer_factory=optimizer_factory,
        check_optimizer=configured.check_optimizer,
    )
