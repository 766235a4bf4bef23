"""The sharded optimizer: each rank steps its own slice of the flat buffers.

With ``step_on="sharded"`` rank ``r`` owns slice ``r`` of every flat buffer (see
:meth:`FlatParameters.shard`). :class:`ShardedOptimizer` builds, from the optimizer the user's
factory returned over the whole parameters (the *template*, which never steps and holds no
state), an optimizer of the same class over the pieces of the rank's slice: one tensor per
parameter group and run of adjacent parameters, a view into the flat parameter buffer whose
gradient is the matching view into the flat gradient buffer. Each group keeps its
hyperparameters, so the slice optimizer holds ``1/n`` of the state and does ``1/n`` of the
work, with the updates of the whole optimizer, as long as the optimizer treats each element
on its own (:data:`ELEMENTWISE`; anything else is refused with a :class:`ConfigError`).

The optimizer state that checkpoints hold is the template's own ``state_dict()`` format, over
the whole parameters: :meth:`ShardedOptimizer.full_state_dict` gathers it from every rank (a
collective), :meth:`ShardedOptimizer.load_full_state_dict` takes each rank's slice of it. A
checkpoint is therefore the same whatever the design and the number of ranks that wrote it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs
import torch

from .._errors import CheckpointError, ConfigError
from ._flat import FlatParameters

__all__ = [
    "ELEMENTWISE",
    "SCALAR_STATE",
    "AllGather",
    "ShardedOptimizer",
    "check_closure_free",
    "check_elementwise",
]

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)
"""The optimizers that update each element from that element's gradient and state alone (in
all their forms: foreach, fused, with any hyperparameters), so that a slice steps like the
whole. Subclasses are not trusted: they may override ``step``."""

SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product"})
"""The state entries of :data:`ELEMENTWISE` optimizers that are one value per parameter (a
step count and what is derived from it), equal on every slice; the others are per element."""

AllGather = Callable[[torch.Tensor, torch.Tensor], None]
"""``all_gather(output, input)``: every rank's ``input`` into ``output``, waited for."""


@attrs.define(eq=False)
class _Piece:
    parameter: int
    """Index into the template's parameters (group by group, in group order)."""
    start: int
    """First element of the parameter (flattened) in the piece."""
    length: int


@attrs.define(eq=False)
class _Segment:
    """One tensor of the slice optimizer: a run of the rank's slice within one buffer."""

    tensor: torch.Tensor
    buffer: int
    offset: int
    """Where the run starts in its padded flat buffer."""
    pieces: list[_Piece]


@attrs.define(eq=False)
class ShardedOptimizer:
    """Rank ``rank``'s slice optimizer, with what it takes to read and write the whole
    optimizer's state (see the module docstring)."""

    rank: int
    flat: FlatParameters
    template: torch.optim.Optimizer
    optimizer: torch.optim.Optimizer
    segments: list[list[_Segment]]
    """Per parameter group, the group's segments on this rank (at least one: an empty run
    when the rank owns none of the group, so that every group steps and keeps its state)."""
    template_parameters: list[torch.Tensor]
    """The template's parameters, group by group, in group order."""
    buffer_of: list[tuple[int, int, int]]
    """Per template parameter: its buffer, offset and element count."""
    _gradients: list[torch.Tensor] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._gradients = [
            self.flat.shard(padded, self.rank) for padded in self.flat.padded_gradients
        ]

    @classmethod
    def create(
        cls, rank: int, template: torch.optim.Optimizer, flat: FlatParameters
    ) -> ShardedOptimizer:
        """The slice optimizer of ``template`` for ``rank``. Raises :class:`ConfigError` for an
        optimizer that does not treat each element on its own, or over tensors that are not
        the model's trainable parameters."""
        check_elementwise(rank, template)
        index_of = {id(parameter): index for index, parameter in enumerate(flat.parameters)}
        template_parameters: list[torch.Tensor] = []
        buffer_of: list[tuple[int, int, int]] = []
        segments: list[list[_Segment]] = []
        for group in template.param_groups:
            runs: list[_Segment] = []
            for parameter in group["params"]:
                index = index_of.get(id(parameter))
                if index is None:
                    raise ConfigError(
                        f"{type(template).__name__} optimizes a tensor that is not one of the "
                        "model's trainable parameters; step_on='sharded' steps slices of "
                        "those only: build the optimizer over the parameters "
                        "optimizer_factory receives",
                        rank=rank,
                        phase="configure",
                    )
                buffer, offset, numel = flat.slots[index]
                position = len(template_parameters)
                template_parameters.append(parameter)
                buffer_of.append((buffer, offset, numel))
                _add_piece(runs, flat, rank, position, buffer, offset, numel)
            if not runs:
                runs.append(_Segment(flat.parameter_storage[0][:0], 0, 0, []))
            segments.append(runs)
        for runs in segments:
            for segment in runs:
                storage = flat.gradient_storage[segment.buffer]
                end = segment.offset + segment.tensor.numel()
                segment.tensor.grad = storage[segment.offset : end]
        groups = [
            {
                **_hyperparameters(group),
                "params": [segment.tensor for segment in runs],
            }
            for group, runs in zip(template.param_groups, segments, strict=True)
        ]
        accepted = inspect.signature(type(template).__init__).parameters
        defaults = {k: v for k, v in template.defaults.items() if k in accepted}
        optimizer = type(template)(groups, **defaults)
        return cls(
            rank=rank,
            flat=flat,
            template=template,
            optimizer=optimizer,
            segments=segments,
            template_parameters=template_parameters,
            buffer_of=buffer_of,
        )

    def gradients(self) -> list[torch.Tensor]:
        """The rank's slice of every flat gradient buffer (the reduced sums, after the
        exchange)."""
        return self._gradients

    # -- the whole optimizer's state ----------------------------------------------------------

    def full_state_dict(self, all_gather: AllGather) -> dict[str, Any]:
        """The whole optimizer's ``state_dict()``, in the template's format, on every rank's
        CPU memory (a collective: every rank calls it, in the same order). Each per-element
        state is gathered one buffer at a time, so a rank holds at most one full buffer of it
        on its device at once."""
        self._hyperparameters_to_template()
        states: dict[int, dict[str, Any]] = {}
        for group_index, runs in enumerate(self.segments):
            own = self.optimizer.state.get(runs[0].tensor, {})
            members = self._group_members(group_index)
            if not own:
                continue  # not stepped yet (on every rank alike)
            for key in sorted(own):
                value = own[key]
                if not _per_element(key, value):
                    for position in members:
                        states.setdefault(position, {})[key] = _clone_cpu(value)
                    continue
                by_buffer: dict[int, list[int]] = {}
                for position in members:
                    by_buffer.setdefault(self.buffer_of[position][0], []).append(position)
                for buffer, positions in by_buffer.items():
                    gathered = self._gather(all_gather, group_index, key, buffer)
                    for position in positions:
                        _, offset, numel = self.buffer_of[position]
                        piece = gathered[offset : offset + numel]
                        shape = self.template_parameters[position].shape
                        states.setdefault(position, {})[key] = piece.view(shape).cpu()
        template = self.template
        try:
            for position, state in states.items():
                template.state[self.template_parameters[position]] = state
            return template.state_dict()
        finally:
            template.state.clear()

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's slice of a whole optimizer's ``state_dict()`` (any design's, any
        number of ranks'). Raises :class:`CheckpointError` when it does not fit."""
        saved_groups = state_dict.get("param_groups")
        groups = self.template.param_groups
        if not isinstance(saved_groups, list) or [len(g["params"]) for g in saved_groups] != [
            len(g["params"]) for g in groups
        ]:
            raise CheckpointError(
                "the optimizer state has other parameter groups than this run's optimizer "
                f"({type(self.template).__name__} with groups of "
                f"{[len(g['params']) for g in groups]} parameters)",
                rank=self.rank,
                phase="resume",
            )
        saved_state = state_dict.get("state", {})
        ids = [key for group in saved_groups for key in group["params"]]
        slice_state: dict[int, dict[str, Any]] = {}
        slice_groups = []
        next_id = 0
        for group_index, (saved, runs) in enumerate(zip(saved_groups, self.segments, strict=True)):
            members = self._group_members(group_index)
            group_ids = []
            for segment in runs:
                state = self._segment_state(segment, members, saved_state, ids)
                if state:
                    slice_state[next_id] = state
                group_ids.append(next_id)
                next_id += 1
            slice_groups.append({**saved, "params": group_ids})
        self.optimizer.load_state_dict({"state": slice_state, "param_groups": slice_groups})

    # -- helpers -----------------------------------------------------------------------------

    def _group_members(self, group_index: int) -> range:
        start = sum(len(g["params"]) for g in self.template.param_groups[:group_index])
        return range(start, start + len(self.template.param_groups[group_index]["params"]))

    def _hyperparameters_to_template(self) -> None:
        groups = zip(self.optimizer.param_groups, self.template.param_groups, strict=True)
        for mine, theirs in groups:
            theirs.update(_hyperparameters(mine))

    def _gather(
        self, all_gather: AllGather, group_index: int, key: str, buffer: int
    ) -> torch.Tensor:
        """The full buffer ``buffer`` of state ``key`` of group ``group_index`` (zeros outside
        the group's parameters), gathered from every rank's slice."""
        storage = self.flat.parameter_storage[buffer]
        whole = torch.zeros_like(storage)
        for segment in self.segments[group_index]:
            if segment.buffer == buffer and segment.pieces:
                value = self.optimizer.state[segment.tensor][key]
                end = segment.offset + segment.tensor.numel()
                whole[segment.offset : end].copy_(value)
        all_gather(whole, self.flat.shard(whole, self.rank))
        return whole

    def _segment_state(
        self,
        segment: _Segment,
        members: range,
        saved_state: dict[Any, dict[str, Any]],
        ids: list[Any],
    ) -> dict[str, Any]:
        """The saved state of ``segment``'s elements: per-element values cut and joined,
        the others (a step count) taken from the first parameter of its group that has them."""
        sources = [saved_state.get(ids[position]) for position in members]
        example = next((s for s in sources if s), None)
        if example is None:
            return {}
        state: dict[str, Any] = {}
        for key, value in example.items():
            if not _per_element(key, value):
                state[key] = value
                continue
            parts = []
            for piece in segment.pieces:
                source = saved_state.get(ids[piece.parameter]) or {}
                full = source.get(key)
                if full is None:
                    parts.append(torch.zeros(piece.length, dtype=value.dtype))
                else:
                    flat = full.detach().reshape(-1)
                    parts.append(flat[piece.start : piece.start + piece.length].cpu())
            state[key] = torch.cat(parts) if parts else value.new_zeros(0).cpu()
        return state


def check_elementwise(rank: int, optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`ConfigError` unless ``optimizer`` is one of :data:`ELEMENTWISE`."""
    if type(optimizer) in ELEMENTWISE:
        return
    name = type(optimizer).__name__
    known = ", ".join(cls.__name__ for cls in ELEMENTWISE)
    raise ConfigError(
        f"step_on='sharded' steps each rank's slice of the parameters on its own, which only "
        f"an optimizer that treats each element on its own can do; {name} is not one of "
        f"those ({known}; LAMB's per-tensor trust ratio or factored second moments need "
        "whole tensors): use step_on='every_rank' or 'root' for it",
        rank=rank,
        phase="configure",
    )


def check_closure_free(rank: int, optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`ConfigError` when ``optimizer``'s class steps only with a closure (its
    ``step`` has a ``closure`` parameter without a default, as ``LBFGS``'s has), whatever the
    design: lampdist runs the forward and backward passes itself and calls ``step()`` once per
    step, with nothing to re-evaluate the loss."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: let it step
        return
    if closure is None or closure.default is not inspect.Parameter.empty:
        return
    name = type(optimizer).__name__
    raise ConfigError(
        f"{name}.step() needs a closure that re-evaluates the loss, which lampdist cannot "
        "give it: lampdist runs the forward and backward passes itself, sums the gradients "
        "over the ranks and calls step() once for each step's "
        "accumulate_gradient_over_n_batches batches; use an optimizer that steps without a "
        "closure (SGD, Adam, AdamW, Adagrad, RMSprop, ...)",
        rank=rank,
        phase="configure",
    )


def _add_piece(
    runs: list[_Segment],
    flat: FlatParameters,
    rank: int,
    position: int,
    buffer: int,
    offset: int,
    numel: int,
) -> None:
    """Add the part of a parameter that lies in ``rank``'s slice to ``runs``, joining it to
    the last run when they are adjacent in the same buffer."""
    storage = flat.parameter_storage[buffer]
    size = storage.numel() // flat.shards
    low, high = max(offset, rank * size), min(offset + numel, (rank + 1) * size)
    if low >= high:
        return
    piece = _Piece(position, low - offset, high - low)
    last = runs[-1] if runs else None
    if last is not None and last.buffer == buffer and last.offset + last.tensor.numel() == low:
        last.tensor = storage[last.offset : high]
        last.pieces.append(piece)
        return
    runs.append(_Segment(storage[low:high], buffer, low, [piece]))


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _per_element(key: str, value: Any) -> bool:
    return torch.is_tensor(value) and key not in SCALAR_STATE


def _clone_cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if torch.is_tensor(value) else value
