"""Model FLOPs, a device's peak FLOP/s and their ratio, the model FLOPs utilization (MFU).

MFU is the share of a device's peak that a training run's model arithmetic uses::

    flops = count_flops(lambda: loss_fn(model(inputs), target).backward())
    examples_per_second = len(inputs) * steps / seconds
    utilization = mfu(flops / len(inputs), examples_per_second, peak_flops(device, dtype), nranks)

The model FLOPs are counted by torch's :class:`~torch.utils.flop_counter.FlopCounterMode`; the
peaks are the vendors' published dense numbers, in :data:`PEAK_FLOPS`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch.utils.flop_counter import FlopCounterMode

from ._errors import ConfigError

__all__ = [
    "PEAK_FLOPS",
    "PEAK_FLOPS_ENV",
    "Peak",
    "count_flops",
    "match_gpu",
    "mfu",
    "peak_flops",
]

PEAK_FLOPS_ENV = "LAMPDIST_PEAK_FLOPS"
"""An environment variable: a device's peak FLOP/s (``989.4e12``) that :func:`peak_flops`
returns for every device and dtype, in place of the table's."""


# ####################################################################################
# Model FLOPs
# ####################################################################################


def _attention_flops(query: torch.Size, key: torch.Size, value: torch.Size) -> int:
    """The two matmuls of attention (scores ``q @ k^T``, then ``scores @ v``), each query head
    over every key: a causal mask halves the work done, not the model FLOPs counted."""
    batch, heads, queries, head_width = query
    keys, value_width = key[2], value[3]
    return 2 * batch * heads * queries * keys * (head_width + value_width)


def _sdpa_forward(query: torch.Size, key: torch.Size, value: torch.Size, *_: Any, **__: Any) -> int:
    return _attention_flops(query, key, value)


def _sdpa_backward(
    grad_out: torch.Size, query: torch.Size, key: torch.Size, value: torch.Size, *_: Any, **__: Any
) -> int:
    # The gradients of the two matmuls: four matmuls of the forward's size each, without the
    # scores a fused kernel computes again (that is hardware work, not the model's).
    return 2 * _attention_flops(query, key, value)


_aten = torch.ops.aten

_ATTENTION_FLOPS: dict[Any, Callable[..., int]] = {
    # The CPU's fused kernel, which torch's table leaves out.
    _aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
    # The CUDA kernels' backward, counted as on the CPU and as the unfused (math) path counts it.
    _aten._scaled_dot_product_flash_attention_backward: _sdpa_backward,
    _aten._scaled_dot_product_efficient_attention_backward: _sdpa_backward,
    _aten._scaled_dot_product_cudnn_attention_backward: _sdpa_backward,
}


def count_flops(run: Callable[[], object]) -> int:
    """Run ``run()`` (one batch's forward and backward, typically) and return the floating-point
    operations of its matrix products.

    Counted, forward and backward, are the ops a model's arithmetic lives in: ``mm``, ``addmm``,
    ``bmm``, ``baddbmm``, convolutions and scaled-dot-product attention, 2 FLOPs per
    multiply-add. Elementwise ops (activations, normalizations, the loss, an optimizer step) are
    not, as the usual MFU convention has it. Attention counts every query against every key,
    causal or not, and its backward as the four matmuls of its gradients on every device, so a
    count is the model's FLOPs, whatever kernel ran. Nothing is printed.

    Call it once, on a batch of the training's shape, and divide by the batch's examples for
    the ``flops_per_example`` of :func:`mfu`. Whatever ``run`` raises propagates.
    """
    counter = FlopCounterMode(display=False, custom_mapping=_ATTENTION_FLOPS)
    with counter:
        run()
    return counter.get_total_flops()


# ####################################################################################
# Peak FLOP/s
# ####################################################################################


@attrs.frozen(kw_only=True)
class Peak:
    """One GPU model's dense (no structured sparsity) peak FLOP/s per number format.

    ``fp32`` is plain FP32 on the CUDA cores; ``tf32`` the tensor cores' TF32, which float32
    matmuls use when torch allows it; ``bf16`` and ``fp16`` the tensor cores' with FP32
    accumulation. ``None`` where the GPU has no such tensor-core format.
    """

    fp32: float
    tf32: float | None
    bf16: float | None
    fp16: float


_H100_SXM = Peak(fp32=66.9e12, tf32=494.7e12, bf16=989.4e12, fp16=989.4e12)
_H100_NVL = Peak(fp32=60e12, tf32=417.5e12, bf16=835.5e12, fp16=835.5e12)

PEAK_FLOPS: Mapping[str, Peak] = {
    "H200 NVL": _H100_NVL,
    "H200 SXM": _H100_SXM,
    "H100 NVL": _H100_NVL,
    "H100 PCIe": Peak(fp32=51.2e12, tf32=378e12, bf16=756e12, fp16=756e12),
    "H100 SXM": _H100_SXM,
    "A100": Peak(fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12),
    "A40": Peak(fp32=37.4e12, tf32=74.8e12, bf16=149.7e12, fp16=149.7e12),
    "A30": Peak(fp32=10.3e12, tf32=82e12, bf16=165e12, fp16=165e12),
    "A10": Peak(fp32=31.2e12, tf32=62.5e12, bf16=125e12, fp16=125e12),
    "L40S": Peak(fp32=91.6e12, tf32=183e12, bf16=362.05e12, fp16=362.05e12),
    "L4": Peak(fp32=30.3e12, tf32=60e12, bf16=121e12, fp16=121e12),
    "V100S PCIe": Peak(fp32=16.4e12, tf32=None, bf16=None, fp16=130e12),
    "V100 PCIe": Peak(fp32=14e12, tf32=None, bf16=None, fp16=112e12),
    "V100 SXM2": Peak(fp32=15.7e12, tf32=None, bf16=None, fp16=125e12),
}
"""Dense peak FLOP/s per GPU model, from the vendor's data sheets: one GPU, boost clock, no
structured sparsity. The A100's numbers hold for its SXM and PCIe, 40 and 80 GB models alike."""


def _name(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


_MATCH_ORDER: tuple[tuple[re.Pattern[str], str], ...] = (
    (_name(r"\bH200\b.*\bNVL\b"), "H200 NVL"),
    (_name(r"\bH200\b"), "H200 SXM"),
    (_name(r"\bH100\b.*\bNVL\b"), "H100 NVL"),
    (_name(r"\bH100\b.*\bPCIe\b"), "H100 PCIe"),
    (_name(r"\bH100\b"), "H100 SXM"),
    (_name(r"\bA100\b"), "A100"),
    (_name(r"\bA40\b"), "A40"),
    (_name(r"\bA30\b"), "A30"),
    (_name(r"\bA10\b"), "A10"),
    (_name(r"\bL40S\b"), "L40S"),
    (_name(r"\bL4\b"), "L4"),
    (_name(r"\bV100S\b"), "V100S PCIe"),
    (_name(r"\bV100\b.*\bPCIe\b"), "V100 PCIe"),
    (_name(r"\bV100\b"), "V100 SXM2"),
)


def match_gpu(name: str) -> str | None:
    """The key of :data:`PEAK_FLOPS` for a CUDA device name (``torch.cuda.get_device_name``),
    or ``None`` for a GPU the table does not hold.

    The model is read as a whole word, case aside (``"A10"`` is not ``"A100"`` nor ``"A10G"``,
    ``"L4"`` not ``"L40S"``), and the first of these matches wins: H200 NVL, H200 (SXM),
    H100 NVL, H100 PCIe, H100 (SXM: any other H100), A100, A40, A30, A10, L40S, L4, V100S,
    V100 PCIe, V100 (SXM2: any other V100).
    """
    for pattern, key in _MATCH_ORDER:
        if pattern.search(name):
            return key
    return None


def _tf32_allowed() -> bool:
    if torch.backends.cuda.matmul.allow_tf32:
        return True
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:  # set through both of torch's precision APIs: CUDA follows allow_tf32
        return False


def _peak_from_env() -> float | None:
    value = os.environ.get(PEAK_FLOPS_ENV)
    if value is None:
        return None
    try:
        peak = float(value)
    except ValueError:
        peak = math.nan
    if not (math.isfinite(peak) and peak > 0):
        raise ConfigError(
            f"{PEAK_FLOPS_ENV}={value!r} is no peak: set it to a device's FLOP/s, "
            "a positive number such as 989.4e12, or unset it"
        )
    return peak


def peak_flops(device: torch.device, dtype: torch.dtype | None) -> float | None:
    """The dense peak FLOP/s of one ``device`` for a training that computes in ``dtype``: the
    autocast dtype, or ``None`` (or ``torch.float32``) for float32 training.

    Float32 training gets the TF32 peak where the GPU has one and torch lets float32 matmuls
    use it (``torch.backends.cuda.matmul.allow_tf32``, or a float32 matmul precision other than
    ``"highest"``), else the plain FP32 peak. ``None`` for a device that is no CUDA GPU, a GPU
    that :func:`match_gpu` does not know, or a dtype that GPU has no peak for.

    The environment variable :data:`PEAK_FLOPS_ENV`, when set, wins over all of that: its
    number is returned for every device and dtype (``LoopOptions.peak_flops``, when given,
    wins over the variable: the root's telemetry takes it instead of this). Raises
    :class:`~lampdist.ConfigError` naming the variable when it holds no positive number.
    """
    override = _peak_from_env()
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    key = match_gpu(torch.cuda.get_device_name(device))
    if key is None:
        return None
    return _select_peak(PEAK_FLOPS[key], dtype)


def _select_peak(peak: Peak, dtype: torch.dtype | None) -> float | None:
    if dtype is None or dtype == torch.float32:
        if peak.tf32 is not None and _tf32_allowed():
            return peak.tf32
        return peak.fp32
    if dtype == torch.bfloat16:
        return peak.bf16
    if dtype == torch.float16:
        return peak.fp16
    return None


# ####################################################################################
# Utilization
# ####################################################################################


def mfu(
    flops_per_example: float, examples_per_second: float, peak: float | None, devices: int
) -> float | None:
    """The model FLOPs utilization of a run: ``flops_per_example * examples_per_second /
    (peak * devices)``, a fraction of 1; ``None`` when ``peak`` is (no peak known).

    ``examples_per_second`` is the whole run's, over its ``devices`` devices, each of peak
    ``peak`` (from :func:`peak_flops`). Raises :class:`~lampdist.ConfigError` for fewer than one
    device or a peak that is not positive.
    """
    if peak is None:
        return None
    if devices < 1:
        raise ConfigError(f"devices must be 1 or more, got {devices}")
    if not peak > 0:
        raise ConfigError(f"peak must be a positive FLOP/s, got {peak}")
    return flops_per_example * examples_per_second / (peak * devices)
