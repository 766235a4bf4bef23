"""Setting a model up for FSDP2: sharding it as the policy says, materializing a meta-device
model shard by shard, and checking the result (see ``_fsdp``, whose :meth:`FsdpSteps.prepare`
calls these on every rank)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from ..._errors import ConfigError, MismatchError, Phase
from ..._fsdp_options import FsdpPolicy
from ..._words import counted

__all__ = [
    "check_default_group",
    "check_sharded",
    "check_units",
    "ignore_root_output_view_warning",
    "local",
    "materialize",
    "reset_after_loss",
    "shard",
    "unit_sizes",
]

_PHASE: Phase = "configure"


def shard(module: torch.nn.Module, policy: FsdpPolicy, mesh: Any, *, rank: int) -> list[Any]:
    """``fully_shard`` ``module`` as ``policy`` says, over ``mesh``; every unit then sums its
    gradients (the stepper divides by the clique's examples). Returns the units, the root
    module last."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if policy.parallelize is not None:
        policy.parallelize(module, mesh)
    else:
        settings: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": policy.precision.to_torch(),
            "reshard_after_forward": policy.reshard_after_forward,
        }
        types = policy.shard_modules
        for child in _inner_first(module) if types else ():
            if isinstance(child, types):
                fully_shard(child, **settings)
        fully_shard(module, **settings)
    if not isinstance(module, FSDPModule):
        raise ConfigError(
            "FsdpPolicy.parallelize must call fully_shard on the root module (last), "
            "with the mesh it is given",
            rank=rank,
            phase=_PHASE,
        )
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # sums, never averages
        unit.set_force_sum_reduction_for_comms(True)
    return units


def _inner_first(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The modules below ``module``, each after the modules below it and siblings in the
    order of ``named_modules``, each once: FSDP2 shards a module's inner units first, so
    that ``shard_modules`` types may nest (a block and the ``Linear`` layers inside it)."""
    seen: set[int] = set()

    def below(parent: torch.nn.Module) -> Iterator[torch.nn.Module]:
        for child in parent.children():
            if id(child) not in seen:
                seen.add(id(child))
                yield from below(child)
                yield child

    yield from below(module)


def reset_after_loss(units: list[Any]) -> None:
    """Drop what a pass cut short by a lost rank left in FSDP2's ``units`` (the root module
    last): the all-gathers and reductions in flight, unsharded parameters and gradients
    accumulated without a reduction (the unsharded parameters' own, too); and point every
    unit at torch's default process group, which the clique's new generation opened (FSDP2
    holds the group it was sharded over)."""
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    for unit in units:
        for param_group in unit._get_fsdp_state()._fsdp_param_groups:
            param_group._all_gather_result = None  # the aborted one's: nothing to wait for
            for info in (param_group.mesh_info, param_group.post_forward_mesh_info):
                if info is not None and hasattr(info, "shard_process_group"):
                    info.shard_process_group = group
            for fsdp_param in param_group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:  # a step's backward without a reduction left it
                    unsharded.grad = None
    units[-1].reset_iter_state()
    units[-1].set_requires_gradient_sync(True)


def ignore_root_output_view_warning(module: torch.nn.Module) -> None:
    """Ignore FSDP2's "returned a view tensor" ``UserWarning`` for the sharded root
    ``module``, and for it alone.

    FSDP2 warns whenever a unit's forward returns a view (a ``Linear`` on a batch of
    sequences does), because an in-place op on that view would drop the unit's pre-backward
    hook. The root's output goes to lampdist, which hands it to the loss and the metrics and
    changes it nowhere, so for the root the warning only repeats on every run. The
    warnings of the inner units stay: their outputs go on into the model's own code.

    A filter of the process, added when the model is sharded and left in place (adding an
    equal filter again replaces it, so runs do not pile them up), rather than
    ``catch_warnings()`` around each forward: entering and leaving that on every batch
    resets Python's record of the warnings already shown, so that every other warning of
    the model would then be shown on every step instead of once, and it swaps the filters
    of the whole process under the event loop's thread.
    """
    name = type(module).__name__  # FSDP2's class of the root: "FSDPGpt" for a Gpt
    warnings.filterwarnings(
        "ignore",
        message=re.escape(f"FSDP2-wrapped module ({name}) returned a view tensor"),
        category=UserWarning,
    )


def materialize(
    module: torch.nn.Module,
    template: torch.nn.Module,
    *,
    seed: int,
    device: torch.device,
    init: Callable[[torch.nn.Module], None] | None,
    rank: int,
    stored: Collection[str] = (),
) -> None:
    """Initialize each module's own parameters and buffers of the meta-device ``template``
    (one module's at a time, each seeded from ``seed`` and its index, so that every rank
    computes the same values) and copy this rank's part into the sharded ``module``, whose
    storage ``to_empty`` allocated. A module whose own tensors are all ``stored`` (state
    names that initial weights will fill) is left as allocated."""
    from torch.distributed.tensor import DTensor

    devices = [device] if device.type == "cuda" else []
    for index, (name, source) in enumerate(template.named_modules()):
        own = [*source.named_parameters(recurse=False), *source.named_buffers(recurse=False)]
        if all((f"{name}.{key}" if name else key) in stored for key, _ in own):
            continue
        if init is None and not callable(getattr(source, "reset_parameters", None)):
            raise ConfigError(
                f"module {name or '(root)'!r} ({type(source).__name__}) was built on the "
                "meta device and has no reset_parameters() to initialize it: pass "
                "FsdpPolicy(init_weights=...) or build the model on a device",
                rank=rank,
                phase=_PHASE,
            )
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + index)
            source.to_empty(device=device, recurse=False)
            with torch.no_grad():
                if init is not None:
                    init(source)
                else:
                    source.reset_parameters()
        target = module.get_submodule(name)
        for key, value in _own_tensors(source):
            slot = _own(target, key)
            with torch.no_grad():
                if isinstance(slot, DTensor):
                    slot.to_local().copy_(_local_part(value, slot))
                else:
                    slot.copy_(value)
        source.to_empty(device="meta", recurse=False)  # free the whole values


def check_sharded(module: torch.nn.Module, nranks: int, *, rank: int) -> None:
    """Raise unless every trainable parameter is sharded over a mesh of all ``nranks``."""
    from torch.distributed.tensor import DTensor

    loose = [
        name
        for name, p in module.named_parameters()
        if p.requires_grad and not isinstance(p, DTensor)
    ]
    if loose:
        raise ConfigError(
            f"parameters {loose[:3]} are not sharded: FsdpPolicy.parallelize must shard "
            "every module with parameters (fully_shard on the root module takes those left)",
            rank=rank,
            phase=_PHASE,
        )
    meshes = {p.device_mesh.size() for p in module.parameters() if isinstance(p, DTensor)}
    if meshes != {nranks}:
        raise MismatchError(
            f"the model is sharded over meshes of sizes {sorted(meshes)}, the clique has "
            f"{counted(nranks, 'rank')}: FsdpPolicy.parallelize must shard over the mesh it "
            "is given",
            rank=rank,
            phase=_PHASE,
        )


def unit_sizes(units: list[Any]) -> list[int]:
    """The elements this rank holds of each unit's own trainable parameters."""
    return [sum(local(p).numel() for p in _managed(unit, units)) for unit in units]


def check_units(
    module: torch.nn.Module, units: list[Any], rows: list[list[int]], *, rank: int
) -> None:
    """Raise naming the ranks and the module when a unit has elements and some rank holds
    none of them (``rows``: every rank's :func:`unit_sizes`, by rank)."""
    names = {id(m): name or "(root)" for name, m in module.named_modules()}
    for index, unit in enumerate(units):
        total = sum(row[index] for row in rows)
        empty = [r for r, row in enumerate(rows) if row[index] == 0]
        if total and empty:
            raise ConfigError(
                f"ranks {empty} hold no element of the parameters of sharded module "
                f"{names[id(unit)]!r} ({counted(total, 'element')} over "
                f"{counted(len(rows), 'rank')}): shard "
                "bigger modules (FsdpPolicy.shard_modules) or use fewer ranks",
                rank=rank,
                phase=_PHASE,
            )


def _own_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _own(module: torch.nn.Module, key: str) -> torch.Tensor:
    """The module's own parameter or buffer ``key``."""
    value: torch.Tensor | None = module._parameters.get(key)
    if value is None:
        value = module._buffers[key]
    assert value is not None
    return value


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (``_local_tensor``: ``to_local()`` goes through autograd, a
    cost per parameter per step)."""
    local: torch.Tensor = getattr(tensor, "_local_tensor")  # noqa: B009  # untyped in torch
    return local


def _local_part(full: torch.Tensor, shard: Any) -> torch.Tensor:
    """The part of ``full`` that the DTensor ``shard`` holds on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        full.shape, shard.device_mesh, shard.placements
    )
    index = tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))
    return full[index]


def _managed(unit: Any, units: list[Any]) -> list[torch.nn.Parameter]:
    """The trainable parameters that ``unit`` itself shards (not those of the units nested in
    it)."""
    nested = [o for o in units if o is not unit and any(o is m for m in unit.modules())]
    inside = {id(p) for o in nested for p in o.parameters()}
    return [p for p in unit.parameters() if id(p) not in inside and p.requires_grad]


def check_default_group(rank: int, nranks: int) -> None:
    """Raise unless torch's default group is the clique's (``rank`` of ``nranks``)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError(
            "step_on='fsdp' needs torch's default process group, which the clique opens "
            "with ProcessGroups(default_group=True) (lampdist.train, the root's driver and "
            "the follower set it when they build the cliques themselves)",
            rank=rank,
            phase=_PHASE,
        )
    if dist.get_world_size() != nranks or dist.get_rank() != rank:
        raise MismatchError(
            f"the default process group has rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, this clique rank {rank} of {nranks}: "
            "open the default group from the clique",
            rank=rank,
            phase=_PHASE,
        )
