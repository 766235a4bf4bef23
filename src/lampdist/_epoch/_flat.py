"""Parameters and gradients laid out in flat buffers, so a step moves a few tensors, not many.

Every trainable parameter becomes a view into one flat buffer per dtype, and so does its
gradient: the optimizer updates the flat buffer in place, and the collectives send it as it
is, with no packing copy. Gradients stay allocated (zeroed, never set to ``None``) so that
autograd accumulates into the views.

Two small tails ride behind the buffers so that a step sends no extra collective for them:
the first float32 or float64 gradient buffer carries the step's meta values (examples, loss
sum, whether the rank has more batches: summed with the gradients), and the first parameter
buffer carries the root values' 32 bytes (copied with the parameters). A model without such
a buffer sends those values on their own.

Sharded (``step_on="sharded"``), each rank owns a contiguous ``1/n`` of every flat buffer
(:meth:`FlatParameters.shard`): the buffers are padded with zeros to a multiple of ``n``
elements (:attr:`FlatParameters.padded_gradients`), there are no root values, and with
``bucket_cap_mb`` each dtype's parameters are cut into buffers of about that size, from the
last parameter backwards, so that a gradient bucket is a whole buffer and its reduce-scatter
leaves each rank the slice it owns. The meta tail sits behind the padding, for an exchange
that all-reduces the whole buffer (Gloo, where a reduce-scatter costs an all-reduce).

A rank alone in its clique exchanges nothing: it gets no gradient buffers (``gradients=False``)
and autograd keeps the gradients as a plain loop's, set to ``None`` after each step, which saves
a fill and a read of every gradient a step (see ``_designs``: ``Solo``).
"""

from __future__ import annotations

import hashlib

import attrs
import torch

from .._model import original_module

__all__ = ["META_SLOTS", "ROOT_VALUES_BYTES", "FlatParameters", "flat_order"]

META_SLOTS = 4
"""Elements of the gradient tail: examples (high and low parts), loss sum, more batches."""
ROOT_VALUES_BYTES = 32
"""Bytes of the parameter tail: the four float64 root values (more batches, loss scale, the
root's ask for every rank's own loss, the fp16 nominal step)."""
_META_DTYPES = (torch.float32, torch.float64)


@attrs.define(eq=False)
class FlatParameters:
    """One module's trainable parameters and their gradients as views into flat buffers on
    one device, with the module's other buffers and the two tails (see the module docstring).
    """

    parameters: list[torch.nn.Parameter]
    parameter_buffers: list[torch.Tensor]
    gradient_buffers: list[torch.Tensor]
    gradient_views: list[torch.Tensor]
    module_buffers: list[torch.Tensor]
    layout: tuple[tuple[str, str], ...]
    """Every parameter and buffer with its shape and dtype, in order (see :meth:`fingerprint`)."""
    slots: list[tuple[int, int, int]] = attrs.field(factory=list)
    """Per parameter: (index of its flat buffer, offset, element count)."""
    gradient_storage: list[torch.Tensor] = attrs.field(factory=list)
    """What a gradient exchange sends: the gradient buffers, one of them with the meta tail."""
    meta_tail: torch.Tensor | None = None
    """The ``META_SLOTS`` meta elements behind a float32 or float64 gradient buffer."""
    parameter_storage: list[torch.Tensor] = attrs.field(factory=list)
    """What a parameter broadcast sends: the parameter buffers, the first with the root
    values' tail."""
    root_values_tail: torch.Tensor | None = None
    """The ``ROOT_VALUES_BYTES`` bytes behind the first parameter buffer, as uint8."""
    root_values: torch.Tensor | None = None
    """The same bytes as float64 (a view made once: a follower may read them every step)."""
    flat_gradients: bool = True
    """Whether the gradients live in ``gradient_buffers`` (else autograd owns them)."""
    shards: int = 1
    """How many ranks share each buffer (``step_on="sharded"``); 1 otherwise."""
    padded_gradients: list[torch.Tensor] = attrs.field(factory=list)
    """Each gradient buffer with its padding (sharded), without the meta tail: what a
    reduce-scatter sends."""

    @classmethod
    def create(
        cls,
        module: torch.nn.Module,
        device: torch.device,
        *,
        gradients: bool = True,
        shards: int = 1,
        bucket_cap_bytes: int | None = None,
    ) -> FlatParameters:
        """Move ``module`` to ``device`` and lay its trainable parameters out flat, and their
        gradients too unless ``gradients`` is False (a rank alone exchanges none).

        With ``shards`` > 1 the buffers are laid out for that many ranks to own a slice each
        (see the module docstring), one buffer per bucket of about ``bucket_cap_bytes``."""
        module.to(device)
        sharded = shards > 1
        groups = _groups(module, bucket_cap_bytes if sharded else None)
        parameters: list[torch.nn.Parameter] = []
        parameter_buffers: list[torch.Tensor] = []
        gradient_buffers: list[torch.Tensor] = []
        gradient_views: list[torch.Tensor] = []
        slots: list[tuple[int, int, int]] = []
        gradient_storage: list[torch.Tensor] = []
        padded_gradients: list[torch.Tensor] = []
        parameter_storage: list[torch.Tensor] = []
        meta_tail: torch.Tensor | None = None
        root_values_tail: torch.Tensor | None = None
        for buffer_index, (dtype, group) in enumerate(groups):
            total = sum(p.numel() for p in group)
            size = torch.empty(0, dtype=dtype).element_size()
            tail, start = _tail(total, size, shards=shards, first=buffer_index == 0)
            storage = torch.zeros(total + tail, dtype=dtype, device=device)
            flat = storage[:total]
            if tail and not sharded:
                at = start * size
                root_values_tail = storage.view(torch.uint8)[at : at + ROOT_VALUES_BYTES]
            carries_meta = gradients and meta_tail is None and dtype in _META_DTYPES
            padded = total + tail if sharded else total
            grad_storage = torch.zeros(
                (padded + (META_SLOTS if carries_meta else 0)) if gradients else 0,
                dtype=dtype,
                device=device,
            )
            grads = grad_storage[:total]
            if carries_meta:
                meta_tail = grad_storage[padded:]
            offset = 0
            for parameter in group:
                n = parameter.numel()
                flat[offset : offset + n].copy_(parameter.detach().reshape(-1))
                parameter.data = flat[offset : offset + n].view_as(parameter)
                if gradients:
                    parameter.grad = grads[offset : offset + n].view_as(parameter)
                    gradient_views.append(parameter.grad)
                else:
                    parameter.grad = None
                slots.append((buffer_index, offset, n))
                offset += n
                parameters.append(parameter)
            parameter_buffers.append(flat)
            parameter_storage.append(storage)
            if gradients:
                gradient_buffers.append(grads)
                gradient_storage.append(grad_storage)
                padded_gradients.append(grad_storage[:padded])
        frozen = [p for p in module.parameters() if not p.requires_grad]
        return cls(
            parameters=parameters,
            parameter_buffers=parameter_buffers,
            gradient_buffers=gradient_buffers,
            gradient_views=gradient_views,
            module_buffers=[*module.buffers(), *frozen],
            layout=_layout(module),
            slots=slots,
            gradient_storage=gradient_storage,
            meta_tail=meta_tail,
            parameter_storage=parameter_storage,
            root_values_tail=root_values_tail,
            root_values=None if root_values_tail is None else root_values_tail.view(torch.float64),
            flat_gradients=gradients,
            shards=shards,
            padded_gradients=padded_gradients,
        )

    @classmethod
    def described(cls, module: torch.nn.Module) -> FlatParameters:
        """``module``'s layout without flat buffers: for a design that leaves the parameters
        where they are (fsdp, whose parameters FSDP2 shards); ``module`` may live on the meta
        device. The design fills :attr:`parameters` and :attr:`module_buffers` later."""
        return cls(
            parameters=[],
            parameter_buffers=[],
            gradient_buffers=[],
            gradient_views=[],
            module_buffers=[],
            layout=_layout(module),
            flat_gradients=False,
        )

    def shard(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s contiguous slice of ``tensor``, a padded parameter or gradient
        storage of a sharded layout."""
        return tensor.view(self.shards, -1)[rank]

    def fingerprint(self) -> bytes:
        """A digest of :attr:`layout`: equal on ranks whose models have the same layout."""
        return hashlib.sha256(repr(self.layout).encode()).digest()

    def gradients(self) -> list[torch.Tensor]:
        """The gradients an optimizer step reads: the flat buffers, or autograd's tensors."""
        if self.flat_gradients:
            return self.gradient_buffers
        return [p.grad for p in self.parameters if p.grad is not None]

    def zero_gradients(self) -> None:
        """Zero every gradient and the meta tail in place (the views stay valid); without
        flat gradients, set them to ``None`` as ``zero_grad(set_to_none=True)`` does."""
        if not self.flat_gradients:
            for parameter in self.parameters:
                parameter.grad = None
        for grads in self.gradient_storage:
            grads.zero_()

    def ensure_gradient_views(self) -> None:
        """Re-attach any gradient that autograd or user code replaced, keeping its values."""
        for index in range(len(self.parameters)):
            self.ensure_gradient_view(index)

    def ensure_gradient_view(self, index: int) -> None:
        """Re-attach parameter ``index``'s gradient if it was replaced, keeping its values."""
        parameter, view = self.parameters[index], self.gradient_views[index]
        grad = parameter.grad
        if grad is not view:
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            parameter.grad = view


def flat_order(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s trainable parameters in the order of a flat layout's
    :attr:`FlatParameters.parameters` (by dtype, the dtypes in the order they first appear):
    the order of a whole optimizer state's keys in a checkpoint."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, parameter in module.named_parameters():
        if parameter.requires_grad:
            by_dtype.setdefault(parameter.dtype, []).append(name)
    return [name for names in by_dtype.values() for name in names]


def _groups(
    module: torch.nn.Module, cap_bytes: int | None
) -> list[tuple[torch.dtype, list[torch.nn.Parameter]]]:
    """``module``'s trainable parameters by dtype, the dtypes in the order they first appear;
    with ``cap_bytes``, each dtype's cut into buffers of about that size (:func:`_cut`)."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for _, parameter in module.named_parameters():
        if parameter.requires_grad:
            by_dtype.setdefault(parameter.dtype, []).append(parameter)
    groups: list[tuple[torch.dtype, list[torch.nn.Parameter]]] = []
    for dtype, members in by_dtype.items():
        if cap_bytes is not None:
            groups += [(dtype, bucket) for bucket in _cut(members, cap_bytes)]
        else:
            groups.append((dtype, members))
    return groups


def _tail(total: int, size: int, *, shards: int, first: bool) -> tuple[int, int]:
    """The elements behind a flat buffer of ``total`` elements of ``size`` bytes, and where
    the root values' tail starts (in elements; it is behind the ``first`` buffer of a layout
    that is not sharded, on an 8-byte boundary, so that it can be read as float64). Sharded,
    the tail is zeros, so that every rank owns as many elements."""
    if shards > 1:
        return -total % shards, 0
    start = -(-total * size // 8) * 8 // size
    return (start - total + -(-ROOT_VALUES_BYTES // size) if first else 0), start


def _cut(parameters: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    """``parameters`` cut into runs of at most ``cap_bytes`` (or one parameter, when larger),
    filled from the last parameter backwards, in parameter order."""
    runs: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    current_bytes = 0
    for parameter in reversed(parameters):
        size = parameter.numel() * parameter.element_size()
        if current and current_bytes + size > cap_bytes:
            runs.append(current[::-1])
            current, current_bytes = [], 0
        current.append(parameter)
        current_bytes += size
    if current:
        runs.append(current[::-1])
    return runs[::-1]


def _layout(module: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    """Every parameter and buffer as (``"parameter NAME"``, ``"shape (..), dtype, ..."``):
    what ranks must share (not the values), named as in the original module of a compiled
    one, so that compiled and eager ranks agree."""
    module = original_module(module)
    entries = [
        (
            f"parameter {name!r}",
            f"shape {tuple(t.shape)}, {t.dtype}, requires_grad={t.requires_grad}",
        )
        for name, t in module.named_parameters()
    ]
    entries += [
        (f"buffer {name!r}", f"shape {tuple(t.shape)}, {t.dtype}")
        for name, t in module.named_buffers()
    ]
    return tuple(entries)
