"""FSDP2 stepping: the model itself sharded over the ranks with ``fully_shard``.

``step_on="fsdp"``: every rank holds ``1/n`` of each parameter, of its gradient and of the
optimizer state; a sharded module's forward all-gathers its parameters and its backward
reduce-scatters its gradients (FSDP2's own collectives, over torch's default process group,
which the clique opens: see ``lampdist.clique``). The design shards the model once every rank
has agreed (:meth:`FsdpSteps.prepare`), then builds the optimizer over the sharded parameters,
so that no optimizer can be built over the whole ones.

A step is exact as for the other designs: each batch's mean loss is weighted by its examples
before backward, FSDP2 sums the gradients (divide factor 1, sum reductions only), and the
stepper divides by the clique's examples of the step, which one all-reduce of the meta values
gives, and clips by the global norm over every rank's shards.

FSDP2's collectives run inside forward and backward, so every rank must run as many forward
and backward passes in a step: before each of the step's batches the ranks all-reduce whether
each has a batch for it and for the next one. A rank without a batch runs its last batch again
(before its first: its next non-empty one) with weight 0 (a padding pass: no gradient, no
metric, in eval mode), and the gradients are reduced in the step's last backward only
(``set_requires_gradient_sync``).

A model built on the meta device never exists whole: after sharding each rank allocates its
shards (``to_empty``) and initializes them module by module from a meta copy of the module,
one module's parameters at a time, seeded from the root's RNG so that every rank computes the
same values and keeps its shard of them. A model built on a device has the root's values
broadcast before it is sharded. Either way the root's weights win, as in every design.
"""

from __future__ import annotations

import copy
import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Self

import attrs
import torch

from ..._checkpoint import (
    ShardedState,
    by_name,
    load_rank_shards,
    local_shards,
    write_own_shards,
)
from ..._effects import OptimizerFactory
from ..._errors import CheckpointError, ConfigError, Phase
from ..._fsdp_options import FsdpPolicy
from ..._model import original_module
from ..._options import StepOptions
from ..._state import TrainingState
from ..._weights_import import load_stored, plan_load
from ..._words import counted
from .._clock import DATA, EXCHANGE
from .._device import host_to_device
from .._flat import FlatParameters, flat_order
from .._objects import broadcast_object
from .._stepper import Combine, LossScale, Stepper
from .._tally import Tally
from ._base import CheckOptimizer, StepBatches, build_optimizer
from ._every_rank import EveryRankSteps
from ._fsdp_model import (
    check_default_group,
    check_sharded,
    check_units,
    ignore_root_output_view_warning,
    local,
    materialize,
    reset_after_loss,
    shard,
    unit_sizes,
)
from ._fsdp_replica import IN_MEMORY, Snapshots
from ._fsdp_sums import StepSums
from ._solo import step_alone

__all__ = ["FsdpSteps"]

logger = logging.getLogger(__name__)

_PHASE: Phase = "configure"


@attrs.define(eq=False)
class FsdpSteps(EveryRankSteps):
    """``step_on="fsdp"`` (see the module docstring): every rank steps, as under
    ``"every_rank"``, whose all-reduce (here of the step's meta values alone) and publishing
    it keeps; FSDP2 exchanges the gradients itself."""

    module: torch.nn.Module | None = None
    """The user's module (sharded in place by :meth:`prepare`)."""
    optimizer_factory: OptimizerFactory | None = None
    check: CheckOptimizer | None = None
    _units: list[Any] = attrs.field(factory=list, init=False)
    """Every module that ``fully_shard`` made an FSDP unit, the root module last."""
    _gradient_sync: bool = attrs.field(default=True, init=False)
    """Whether the units reduce their gradients in the next backward (FSDP2's default)."""
    snapshots: Snapshots | None = attrs.field(default=None, init=False)
    """This rank's shards and its neighbour's at recovery's snapshots (``_fsdp_replica``)."""

    own_process = True
    lockstep = True
    loads_checkpoints = True
    recovers = True
    keeps_best_model = False

    @property
    def policy(self) -> FsdpPolicy:
        """How the model is sharded."""
        return self.options.fsdp

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
        """Describe ``module`` (which may live on the meta device) and keep it for
        :meth:`prepare`, which shards it and builds the optimizer once the clique is open."""
        if optimizer_factory is None:
            raise ConfigError(
                "step_on='fsdp' steps on every rank and needs an optimizer_factory",
                rank=rank,
                phase=_PHASE,
            )
        return cls(
            rank=rank,
            nranks=nranks,
            device=device,
            flat=FlatParameters.described(module),
            options=options,
            stepper=None,
            loss_scale=LossScale(enabled=options.autocast_dtype == torch.float16),
            module=module,
            optimizer_factory=optimizer_factory,
            check=check_optimizer,
        )

    # -- setup, once every rank agreed ----------------------------------------------------------

    def prepare(self, resume: TrainingState | None) -> None:
        """Shard the model over the default process group's mesh, materialize it when it was
        built on the meta device (the root's weights win), check the sharding, build the
        optimizer over the sharded parameters, and load the root's checkpoint ``resume``
        (each rank its shards). Every rank calls it, in step.

        In a clique's later generation (recovery: the ranks that are not new, the survivors,
        have a model set up already) the survivors drop what the lost pass left in FSDP2
        and put their shards of the last snapshot back, and each new rank shards its model
        and receives its shards from the survivors (see ``_fsdp_replica``)."""
        assert self.module is not None and self.optimizer_factory is not None
        check_default_group(self.rank, self.nranks)
        fresh = self._fresh_ranks()
        if len(fresh) == self.nranks:
            self._set_up(resume)
            return
        module = original_module(self.module)
        if self.stepper is None:  # a lost rank's replacement
            on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
            if not on_meta:
                module.to(self.device)
            self._shard(module, on_meta=on_meta)
            check_sharded(module, self.nranks, rank=self.rank)
            self._build(module)
        else:
            reset_after_loss(self._units)
            self._gradient_sync = True
        self._regroup(resume, fresh)

    def _fresh_ranks(self) -> list[int]:
        """The ranks whose model is not set up yet (every rank in a clique's first
        generation; a lost rank's replacement later), from one all-gather."""
        mine = host_to_device([int(self.stepper is None)], torch.int64, self.device)
        gathered = torch.zeros(self.nranks, dtype=torch.int64, device=self.device)
        self.all_gather(gathered, mine)
        return [rank for rank, new in enumerate(gathered.tolist()) if new]

    def _set_up(self, resume: TrainingState | None) -> None:
        """:meth:`prepare` on every rank at once (the clique's first generation)."""
        assert self.module is not None
        module = original_module(self.module)
        weights = self.policy.initial_weights  # checked before any tensor is allocated
        stored = None if weights is None else plan_load(weights, module, rank=self.rank)
        on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        template = copy.deepcopy(module) if on_meta else None
        if not on_meta:
            module.to(self.device)
            tensors = [t.data for t in [*module.parameters(), *module.buffers()]]
            if tensors:  # the root's values, before each rank keeps its shard of them
                self.clique.start_broadcast(tensors).wait_blocking(None)
        self._shard(module, on_meta=on_meta)
        if template is not None:
            materialize(
                module,
                template,
                seed=self._root_seed(),
                device=self.device,
                init=self.policy.init_weights,
                rank=self.rank,
                stored=frozenset(stored or ()),
            )
        check_sharded(module, self.nranks, rank=self.rank)
        self._check_units(module)
        self._build(module)
        self._resume(module, resume, stored)
        if self.rank == 0:
            logger.info(
                "fsdp over %s: %s, precision %s",
                counted(self.nranks, "rank"),
                counted(len(self._units), "sharded module"),
                self.policy.precision.describe(),
                extra={"rank": 0},
            )

    def _shard(self, module: torch.nn.Module, *, on_meta: bool) -> None:
        """Shard ``module`` over the default group's mesh (its storage allocated where it
        was on the meta device)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.device.type, (self.nranks,))
        self._units = shard(module, self.policy, mesh, rank=self.rank)
        ignore_root_output_view_warning(module)
        if on_meta:
            module.to_empty(device=self.device)

    def _build(self, module: torch.nn.Module) -> None:
        """The flat layout's parameters and buffers, and the optimizer over the shards."""
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.flat.parameters = trainable
        self.flat.module_buffers = list(module.buffers())
        self.stepper = self._build_stepper(trainable)

    def _regroup(self, resume: TrainingState | None, fresh: list[int]) -> None:
        """Every rank's shards back at recovery's last snapshot (the root's ``resume``),
        the new ranks' received from the survivors that hold them; or, without the replica,
        every rank's loaded from the newest checkpoint (``resume``'s shards)."""
        source = None if resume is None or resume.shards is None else str(resume.shards.path)
        source = broadcast_object(self.clique, source, rank=self.rank)
        assert self.module is not None and self.stepper is not None
        snapshots = self._snapshots()
        if source is not None and not source.startswith(IN_MEMORY):  # fsdp_replica=False
            module = original_module(self.module)
            snapshots.forget()
            self._resume(module, resume, None)
            for parameter in module.parameters():
                parameter.grad = None
            return
        if source is None:
            raise CheckpointError(
                f"rank(s) {fresh} rejoined the run, which has no shards of them in memory to "
                "go back to (the root's snapshot is not fsdp's): pass "
                "Recovery(fsdp_replica=True)",
                rank=self.rank,
                phase="recover",
            )
        module, optimizer = original_module(self.module), self.stepper.optimizer
        snapshots.go_back(source, fresh, module, optimizer, self.clique.explain)

    def _snapshots(self) -> Snapshots:
        if self.snapshots is None:
            self.snapshots = Snapshots(self.rank, self.nranks, self.device)
        return self.snapshots

    def attached(self) -> AbstractContextManager[object]:
        """Nothing hooked; a training pass means the root took recovery's newest snapshot,
        so the one kept before it goes."""
        if self.snapshots is not None:
            self.snapshots.taken()
        return nullcontext()

    def _root_seed(self) -> int:
        """A seed drawn from the root's RNG, the same on every rank."""
        drawn = int(torch.randint(0, 2**62, (1,)).item()) if self.rank == 0 else 0
        seed = host_to_device([drawn], torch.int64, self.device)
        self.clique.start_broadcast([seed]).wait_blocking(None)
        return int(seed.item())

    def _check_units(self, module: torch.nn.Module) -> None:
        """Every unit holds some element on every rank (one all-gather of the counts)."""
        sizes = unit_sizes(self._units)
        mine = host_to_device(sizes, torch.int64, self.device)
        gathered = torch.zeros(self.nranks * len(sizes), dtype=torch.int64, device=self.device)
        self.all_gather(gathered, mine)
        rows = gathered.view(self.nranks, len(sizes)).tolist()
        check_units(module, self._units, rows, rank=self.rank)

    def _resume(
        self,
        module: torch.nn.Module,
        resume: TrainingState | None,
        stored: dict[str, str] | None,
    ) -> None:
        """Load the checkpoint the root resumes from: a sharded one, each rank the parts its
        shards cover; one of whole state dicts (another design's), broadcast from the root,
        each rank keeping its shards. Without one, load the policy's initial weights as
        ``stored`` plans (each rank the slices of its shards)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        plan = None
        if resume is not None:
            shards = resume.shards
            plan = (
                {"shards": str(shards.path), "options": shards.options}
                if shards is not None
                else {"whole": True}
            )
        plan = broadcast_object(self.clique, plan, rank=self.rank)
        if plan is None:
            if stored is not None:
                assert self.policy.initial_weights is not None
                load_stored(self.policy.initial_weights, module, stored, rank=self.rank)
            return
        assert self.stepper is not None
        optimizer = self.stepper.optimizer
        if "shards" in plan:  # from an object store, each rank downloads them first
            with local_shards(plan["shards"], plan["options"]) as path:
                load_rank_shards(path, module, optimizer, rank=self.rank)
            return
        model_state: dict[str, Any] = {}
        optimizer_state: dict[str, Any] = {}
        if resume is not None:  # the root (which checked that the state fits the model)
            model_state = dict(resume.model_state)
            optimizer_state = by_name(resume.optimizer_state, flat_order(module))
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        try:
            set_model_state_dict(module, model_state, options=options)
            set_optimizer_state_dict(module, optimizer, optimizer_state, options=options)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"the checkpoint does not load into this run's sharded model and optimizer "
                f"({type(exc).__name__}: {exc})",
                rank=self.rank,
                phase="resume",
            ) from exc

    def _build_stepper(self, trainable: list[torch.nn.Parameter]) -> Stepper:
        """The optimizer over the sharded parameters, checked as every design checks it."""
        assert self.optimizer_factory is not None
        check = self.check or self.check_optimizer
        optimizer = build_optimizer(self.rank, self.optimizer_factory, trainable, check)
        return Stepper.create(
            self.rank,
            optimizer,
            self.flat,
            self.options,
            self.loss_scale,
            local_gradients=self._local_gradients,
        )

    def _local_gradients(self) -> list[torch.Tensor]:
        """This rank's shard of every gradient (FSDP2 leaves sharded gradients)."""
        return [local(p.grad) for p in self.flat.parameters if p.grad is not None]

    # -- the step --------------------------------------------------------------------------------

    @property
    def combine(self) -> Combine:
        return self._sum_over_clique

    def _sum_over_clique(self, tensor: torch.Tensor) -> None:
        """Sum a small tensor over the clique in place, and wait (the step's scalars)."""
        self.clique.start_all_reduce([tensor]).wait_blocking(None)

    def train_step(
        self, batches: StepBatches, *, epoch: int, step: int, tally: Tally, planned: int | None
    ) -> bool:
        """Up to ``accumulate`` forward and backward passes, as many on every rank (padding
        passes where a rank has no batch), the gradients reduced in the last; then the meta
        values' all-reduce and the update. When every rank's batch count is known the
        all-reduce starts before the step's last backward and runs beside it (whether any rank
        has more batches is then known from the counts). A rank alone steps as a plain loop
        does (each loss weighted by its share of the step's examples: no division pass, no
        collective)."""
        if self.nranks == 1:
            return step_alone(self, batches, epoch=epoch, step=step, tally=tally)
        feed, accumulate = batches.feed, batches.accumulate
        sums = StepSums(self)
        early = batches.counts is not None  # the meta values need no flag of more batches
        batch = feed.next()
        for index in range(accumulate):
            anyone_here, anyone_ahead = self._forwards(batches, batch, step, index)
            if not anyone_here:
                break
            self._set_gradient_sync(not anyone_ahead)
            start = early and not anyone_ahead  # the step's last backward
            if batch is None or batch.weight == 0:
                if start:
                    sums.start()
                batches.pad()
            else:
                weight = self.loss_scale.weight(batch.weight)  # fp16: a share of the nominal
                if start:
                    batches.backward(batch, weight, sums.add_and_start(batch.weight))
                else:
                    sums.add(batches.backward(batch, weight), batch.weight)
            if not anyone_ahead:
                break
            batch = feed.next()
        more = feed.has_next()
        self.clock.mark(DATA)
        meta = sums.exchanged(more)
        self.clock.mark(EXCHANGE)
        return self.update(
            meta,
            own_loss=sums.loss(),
            examples=sums.examples,
            learn_more=planned is None and not more,
            epoch=epoch,
            step=step,
            tally=tally,
        )

    def _forwards(
        self, batches: StepBatches, batch: Any, step: int, index: int
    ) -> tuple[bool, bool]:
        """Whether any rank has a batch for the step's forward ``index``, and for the next one:
        from every rank's batch count when they are known (or this rank is alone), else
        agreed (one small all-reduce)."""
        accumulate = batches.accumulate
        last = index == accumulate - 1
        counts = batches.counts
        if counts is not None:
            left = max(counts) - step * accumulate - index  # the longest source's batches left
            return left > 0, not last and left > 1
        if self.nranks == 1:
            return batch is not None, not last and batches.feed.has_next()
        ahead = not last and batches.feed.has_next()
        return self._agree_on_batches(batch is not None, ahead)

    def _agree_on_batches(self, here: bool, ahead: bool) -> tuple[bool, bool]:
        """Whether any rank has a batch for this forward, and for the next one."""
        flags = host_to_device([float(here), float(ahead)], torch.float64, self.device)
        self.clique.start_all_reduce([flags]).wait_blocking(None)
        anyone_here, anyone_ahead = flags.tolist()
        return anyone_here > 0, anyone_ahead > 0

    def _set_gradient_sync(self, sync: bool) -> None:
        """Reduce the gradients in this backward (the step's last) or keep accumulating (set
        on every unit when it changes: the call walks every module)."""
        if sync != self._gradient_sync:
            self._units[-1].set_requires_gradient_sync(sync)
            self._gradient_sync = sync

    # -- between passes --------------------------------------------------------------------------

    def sync_optimizer_state(self) -> None:
        """Nothing to share: each rank's optimizer holds the state of its own shards."""
        return

    def checkpoint_shards(self, shards: ShardedState | None) -> list[tuple[str, int, list[str]]]:
        """Write this rank's shards of the model and optimizer state into the root's
        ``shards`` directory (every rank at once); its files and their checksums. Recovery's
        snapshot (``shards`` at :data:`IN_MEMORY`) keeps them in host memory instead, and a
        replica with the rank before (see ``_fsdp_replica``): no files."""
        assert self.module is not None and self.stepper is not None
        where = broadcast_object(
            self.clique,
            None if shards is None else {"path": str(shards.path), "options": shards.options},
            rank=self.rank,
        )
        if where is None:
            raise AssertionError("the root gave no directory for the shards")
        module, optimizer = original_module(self.module), self.stepper.optimizer
        if where["path"].startswith(IN_MEMORY):  # recovery's snapshot: here and by a neighbour
            self._snapshots().keep(where["path"], module, optimizer, self.clique.explain)
            return []
        target = ShardedState(path=where["path"], nranks=self.nranks, options=where["options"])
        try:  # torch's distributed checkpoint: collectives of the default group inside
            records = write_own_shards(target, module, optimizer, rank=self.rank)
        except Exception as exc:
            failure = self.clique.explain(exc, "checkpoint")
            if failure is not None:
                raise failure from exc
            raise
        return [(r.name, r.size, list(r.digests)) for r in records]

    def checkpoint_optimizer_state(self) -> dict[str, Any] | None:
        """Nothing whole: every rank writes its shards (:meth:`checkpoint_shards`)."""
        return {} if self.rank == 0 else None
