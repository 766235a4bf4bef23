"""fsdp's shards kept in host memory for in-job recovery (see :class:`lampdist.Recovery`).

Recovery keeps a snapshot after every pass: the root holds every rank's place in its data
and RNG states, but under fsdp no rank holds another's shards. So at each snapshot every
rank copies its own shards of the model and of the optimizer state into host memory
(:func:`keep`) and sends the copy to the rank before it over torch's default process group,
so that rank ``r`` also holds rank ``(r + 1) % n``'s (:class:`Kept`, the in-memory replica
of Gemini, SOSP'23). When a lost rank's replacement joins, every survivor puts its own
copy back (:func:`restore`), and the replacement receives its own shards from the rank
that holds their replica and its neighbour's replica from that neighbour
(:func:`hand_over`). Losing two neighbouring ranks at once loses a shard
(``_roles._fsdp_recovery`` names them).

A kept shard is plain: the model's state dict (each parameter's local part) and the
optimizer's state dict, every tensor a CPU copy, the optimizer's DTensors noted and rebuilt
on the parameters of the rank that restores them.

Cost: two shards of host memory per rank (its own copy and its neighbour's), the second
the replica's; while they travel, one more serialized shard each way.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ..._errors import CheckpointError, CliqueError, LampdistError, Phase

__all__ = [
    "IN_MEMORY",
    "Kept",
    "Snapshots",
    "hand_over",
    "keep",
    "replica_holder",
    "restore",
    "ring",
]

IN_MEMORY = "in-memory:"
"""The start of the path of the :class:`~lampdist._checkpoint.ShardedState` of recovery's
snapshot under fsdp, the snapshot's number after it: every rank keeps its shards in memory
(:func:`keep`) rather than writing them, under that name, beside the last snapshot's until
the root has taken the new one."""

Plain = dict[str, Any]
"""A kept shard (see the module docstring)."""

Explain = Callable[[BaseException, Phase], LampdistError | None]
"""The clique's account of a failure in torch's default group (:meth:`Clique.explain`)."""


@attrs.define(eq=False)
class Snapshots:
    """A rank's shards and its neighbour's at recovery's snapshots, by the root's name for
    each: the one the root took last, and a newer one until a pass shows the root took it
    (a rank lost during a snapshot leaves the others with one the root never took, and a
    recovery must go back to the root's)."""

    rank: int
    nranks: int
    device: torch.device
    kept: dict[str, Kept] = attrs.field(factory=dict)

    def keep(self, name: str, module: torch.nn.Module, optimizer: Any, explain: Explain) -> None:
        """Keep this rank's shards as snapshot ``name`` and swap replicas with the
        neighbours (every rank at once)."""
        own = keep(module, optimizer)
        neighbour = ring(
            own, rank=self.rank, nranks=self.nranks, device=self.device, explain=explain
        )
        self.taken()  # at most two: the root's, and this one until a pass shows it took it
        self.kept[name] = Kept(own, neighbour)

    def taken(self) -> None:
        """A pass is under way, so the root took the newest snapshot: drop the one before
        (one extra shard of host memory per rank again)."""
        self.kept = dict(list(self.kept.items())[-1:])

    def forget(self) -> None:
        self.kept = {}

    def go_back(
        self,
        name: str,
        fresh: list[int],
        module: torch.nn.Module,
        optimizer: Any,
        explain: Explain,
    ) -> None:
        """Every rank back at snapshot ``name`` (the root's): the ranks in ``fresh``
        receive theirs from the survivors (:func:`hand_over`); every rank restores it."""
        kept = self.kept.get(name)
        if kept is None and self.rank not in fresh:
            raise CheckpointError(
                f"this rank holds no shards of recovery's snapshot {name!r} (it holds "
                f"{sorted(self.kept)}): the ranks' snapshots disagree",
                rank=self.rank,
                phase="recover",
            )
        kept = hand_over(
            kept, fresh, rank=self.rank, nranks=self.nranks, device=self.device, explain=explain
        )
        self.kept = {name: kept}
        restore(module, optimizer, kept.own)


def replica_holder(rank: int, nranks: int) -> int:
    """The rank that holds the replica of ``rank``'s shards."""
    return (rank - 1) % nranks


@attrs.define(eq=False)
class Kept:
    """A rank's shards at the last snapshot, and the replica of its neighbour's."""

    own: Plain
    neighbour: Plain | None
    """Rank ``(r + 1) % n``'s (``None`` for a rank alone)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def keep(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Plain:
    """A copy in host memory of this rank's shards of ``module`` and ``optimizer``."""
    from torch.distributed.tensor import DTensor

    model = {name: _on_host(value) for name, value in module.state_dict().items()}
    whole = optimizer.state_dict()
    state = {
        index: {key: _on_host(value) for key, value in values.items()}
        for index, values in whole["state"].items()
    }
    dtensors = [
        [index, key]
        for index, values in whole["state"].items()
        for key, value in values.items()
        if isinstance(value, DTensor)
    ]
    groups = copy.deepcopy(whole["param_groups"])
    return {"model": model, "state": state, "param_groups": groups, "dtensors": dtensors}


def _on_host(value: Any) -> Any:
    """A tensor's local part copied to host memory; anything else deep-copied."""
    if isinstance(value, torch.Tensor):
        return _local(value).detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def restore(module: torch.nn.Module, optimizer: torch.optim.Optimizer, kept: Plain) -> None:
    """Put ``kept`` (this rank's shards, see :func:`keep`) into ``module`` and ``optimizer``,
    copied (``kept`` stays as it is), and drop every gradient."""
    with torch.no_grad():
        for name, value in module.state_dict().items():
            _local(value).copy_(kept["model"][name])
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    marked = {(index, key) for index, key in kept["dtensors"]}
    state = {
        index: {
            key: _back(value, parameters[index], sharded=(index, key) in marked)
            for key, value in values.items()
        }
        for index, values in kept["state"].items()
    }
    groups = copy.deepcopy(kept["param_groups"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    for parameter in module.parameters():
        parameter.grad = None


def _back(value: Any, parameter: Any, *, sharded: bool) -> Any:
    """A kept optimizer state value copied back: with ``sharded``, as a DTensor sharded as
    ``parameter`` is (the value its local part)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if not sharded:
        return value.clone()
    return DTensor.from_local(
        value.to(_local(parameter).device, copy=True),
        parameter.device_mesh,
        parameter.placements,
        run_check=False,
        shape=parameter.size(),
        stride=parameter.stride(),
    )


def ring(
    kept: Plain, *, rank: int, nranks: int, device: torch.device, explain: Explain
) -> Plain | None:
    """Send ``kept`` to the rank before this one and receive the next rank's (its replica);
    ``None`` for a rank alone. Every rank calls it."""
    if nranks == 1:
        return None
    before, after = replica_holder(rank, nranks), (rank + 1) % nranks
    received = _exchange(
        [(before, 0, kept)], [(after, 0)], device=device, phase="checkpoint", explain=explain
    )
    return received[(after, 0)]


def hand_over(
    kept: Kept | None,
    fresh: list[int],
    *,
    rank: int,
    nranks: int,
    device: torch.device,
    explain: Explain,
) -> Kept:
    """After a loss: each replacement in ``fresh`` receives its own shards from the rank that
    holds their replica and its neighbour's replica from that neighbour; this rank's
    :class:`Kept` (a survivor's ``kept``, a replacement's received). Every rank calls it;
    every rank's replica holder and neighbour must have survived (see
    ``_roles._fsdp_recovery.check_shards_kept``)."""
    sends: list[tuple[int, int, Plain]] = []
    receives: list[tuple[int, int]] = []
    for new in fresh:
        holder, neighbour = replica_holder(new, nranks), (new + 1) % nranks
        if rank == holder:
            assert kept is not None and kept.neighbour is not None  # a survivor's
            sends.append((new, 0, kept.neighbour))
        if rank == neighbour:
            assert kept is not None
            sends.append((new, 1, kept.own))
        if rank == new:
            receives += [(holder, 0), (neighbour, 1)]
    received = _exchange(sends, receives, device=device, phase="recover", explain=explain)
    if rank in fresh:
        holder, neighbour = replica_holder(rank, nranks), (rank + 1) % nranks
        return Kept(own=received[(holder, 0)], neighbour=received[(neighbour, 1)])
    assert kept is not None  # a survivor kept its shards at the snapshot
    return kept


def _exchange(
    sends: list[tuple[int, int, Plain]],
    receives: list[tuple[int, int]],
    *,
    device: torch.device,
    phase: Phase,
    explain: Explain,
) -> dict[tuple[int, int], Plain]:
    """Send each ``(rank, tag, value)`` and receive each ``(rank, tag)``'s value, point to
    point over torch's default group (whose timeout is the clique's), through ``device``
    (NCCL sends device memory); the values received, by ``(rank, tag)``. A failure is
    raised as the clique accounts for it."""
    import torch.distributed as dist

    try:
        payloads = [(to, tag, _encode(value).to(device)) for to, tag, value in sends]
        sizes = [torch.tensor([p.numel()], device=device) for _, _, p in payloads]
        lengths = {key: torch.zeros(1, dtype=torch.int64, device=device) for key in receives}
        works = [
            dist.isend(size, to, tag=2 * tag)
            for size, (to, tag, _) in zip(sizes, payloads, strict=True)
        ]
        works += [dist.irecv(lengths[(src, tag)], src, tag=2 * tag) for src, tag in receives]
        _wait(works)
        buffers = {
            key: torch.empty(int(n.item()), dtype=torch.uint8, device=device)
            for key, n in lengths.items()
        }
        works = [dist.isend(p, to, tag=2 * tag + 1) for to, tag, p in payloads]
        works += [dist.irecv(buffers[(src, tag)], src, tag=2 * tag + 1) for src, tag in receives]
        _wait(works)
    except Exception as exc:
        failure = explain(exc, phase)
        if failure is not None:
            raise failure from exc
        raise CliqueError(
            f"the fsdp shards kept for recovery did not travel ({type(exc).__name__}: {exc})",
            phase=phase,
        ) from exc
    return {key: _decode(buffer) for key, buffer in buffers.items()}


def _wait(works: list[Any]) -> None:
    """Wait for each point-to-point operation (``None``: one that needed no wait)."""
    for work in works:
        if work is not None:
            work.wait()


def _encode(value: Plain) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> Plain:
    loaded: Plain = torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=True)
    return loaded
