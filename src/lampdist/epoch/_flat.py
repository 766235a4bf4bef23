"""Parameters and gradients laid out in flat buffers, so a step moves a few tensors, not many.

Every trainable parameter becomes a view into one flat buffer per dtype, and so does its
gradient: the optimizer updates the flat buffer in place, and the collectives send it as it
is, with no packing copy. Gradients stay allocated (zeroed, never set to ``None``) so that
autograd accumulates into the views.
"""

from __future__ import annotations

import hashlib

import attrs
import torch

__all__ = ["FlatModel"]


@attrs.define(eq=False)
class FlatModel:
    """The flat parameter, gradient and buffer storage of one module on one device."""

    parameters: list[torch.nn.Parameter]
    parameter_buffers: list[torch.Tensor]
    gradient_buffers: list[torch.Tensor]
    gradient_views: list[torch.Tensor]
    module_buffers: list[torch.Tensor]
    fingerprint: bytes
    slots: list[tuple[int, int, int]] = attrs.field(factory=list)
    """Per parameter: (index of its flat buffer, offset, element count)."""

    @classmethod
    def create(cls, module: torch.nn.Module, device: torch.device) -> FlatModel:
        """Move ``module`` to ``device`` and lay its trainable parameters out flat."""
        module.to(device)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for _, parameter in named:
            by_dtype.setdefault(parameter.dtype, []).append(parameter)
        parameters: list[torch.nn.Parameter] = []
        parameter_buffers: list[torch.Tensor] = []
        gradient_buffers: list[torch.Tensor] = []
        gradient_views: list[torch.Tensor] = []
        slots: list[tuple[int, int, int]] = []
        for buffer_index, (dtype, group) in enumerate(by_dtype.items()):
            total = sum(p.numel() for p in group)
            flat = torch.empty(total, dtype=dtype, device=device)
            grads = torch.zeros(total, dtype=dtype, device=device)
            offset = 0
            for parameter in group:
                n = parameter.numel()
                flat[offset : offset + n].copy_(parameter.detach().reshape(-1))
                parameter.data = flat[offset : offset + n].view_as(parameter)
                parameter.grad = grads[offset : offset + n].view_as(parameter)
                gradient_views.append(parameter.grad)
                slots.append((buffer_index, offset, n))
                offset += n
                parameters.append(parameter)
            parameter_buffers.append(flat)
            gradient_buffers.append(grads)
        frozen = [p for p in module.parameters() if not p.requires_grad]
        module_buffers = [b for b in module.buffers()] + frozen
        return cls(
            parameters=parameters,
            parameter_buffers=parameter_buffers,
            gradient_buffers=gradient_buffers,
            gradient_views=gradient_views,
            module_buffers=module_buffers,
            fingerprint=_fingerprint(module),
            slots=slots,
        )

    def zero_gradients(self) -> None:
        """Zero every gradient in place (the views stay valid)."""
        for grads in self.gradient_buffers:
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


def _fingerprint(module: torch.nn.Module) -> bytes:
    """A digest of the parameter and buffer names, shapes and dtypes (not their values)."""
    digest = hashlib.sha256()
    for kind, items in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for name, tensor in items:
            digest.update(f"{kind}:{name}:{tuple(tensor.shape)}:{tensor.dtype}:".encode())
            if kind == "p":
                digest.update(b"T" if tensor.requires_grad else b"F")
    return digest.digest()
