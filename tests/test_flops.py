"""Model FLOPs against a hand count of the benchmark's models, the peak table, and MFU."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import lampdist
from lampdist._flops import (
    PEAK_FLOPS,
    PEAK_FLOPS_ENV,
    _select_peak,
    count_flops,
    match_gpu,
    mfu,
    peak_flops,
)

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def models(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("_models")


# Hand counts, from benchmarks/_models.py: 2 FLOPs per multiply-add of a matrix product.


def mlp_flops(*, width: int, depth: int) -> int:
    """One example's forward and backward through ``depth`` Linear(width, width) layers."""
    layer = 2 * width * width
    forward = depth * layer
    weight_gradients = depth * layer
    # The first layer's input is the data, which needs no gradient: autograd skips that matmul.
    input_gradients = (depth - 1) * layer
    return forward + weight_gradients + input_gradients


def gpt_flops(*, vocabulary: int, length: int, width: int, layers: int) -> int:
    """One sequence's forward and backward through the decoder (the embeddings are lookups)."""
    # qkv (d -> 3d), proj (d -> d), fc (d -> 4d), out (4d -> d): 12 d^2 weights in matmuls.
    block_weights = 3 * width * width + width * width + 4 * width * width + 4 * width * width
    head_weights = width * vocabulary
    linear_forward = 2 * (layers * block_weights + head_weights)
    # Scores q k^T and their product with v: each query against every key, all heads together.
    attention_forward = layers * 2 * (2 * length * width)
    per_token_forward = linear_forward + attention_forward
    # Every matmul's input needs a gradient (the embeddings are parameters): backward = 2 forward.
    return 3 * length * per_token_forward


def forward_backward(
    module: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    target: torch.Tensor,
) -> Callable[[], object]:
    def run() -> None:
        loss_fn(module(inputs), target).backward()  # type: ignore[no-untyped-call]  # torch: unannotated

    return run


def test_mlp_count_matches_the_hand_count(models: ModuleType) -> None:
    width, depth, batch = 48, 3, 5
    torch.manual_seed(0)
    module = models.mlp(width=width, depth=depth)
    inputs = torch.randn(batch, width)
    target = torch.randint(0, width, (batch,))
    counted = count_flops(forward_backward(module, models.class_loss, inputs, target))
    expected = batch * mlp_flops(width=width, depth=depth)
    assert counted == pytest.approx(expected, rel=0.02)


def test_gpt_count_matches_the_hand_count(models: ModuleType) -> None:
    vocabulary, length, width, layers, heads, batch = 96, 64, 32, 2, 4, 3
    torch.manual_seed(0)
    module = models.Gpt(
        vocabulary=vocabulary, length=length, width=width, layers=layers, heads=heads
    )
    tokens = torch.randint(0, vocabulary, (batch, length + 1))
    inputs, target = tokens[:, :-1], tokens[:, 1:]
    counted = count_flops(forward_backward(module, models.token_loss, inputs, target))
    expected = batch * gpt_flops(vocabulary=vocabulary, length=length, width=width, layers=layers)
    assert counted == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_the_benchmarks_full_size_models_match_the_hand_count(
    models: ModuleType, name: str
) -> None:
    # On the meta device: shapes only, no memory and no arithmetic.
    spec = models.MODELS[name]
    with torch.device("meta"):
        module = spec.build()
        if name == "gpt":
            inputs = target = torch.zeros(1, models.GPT_LENGTH, dtype=torch.long)
        else:
            inputs, target = torch.zeros(1, models.MLP_WIDTH), torch.zeros(1, dtype=torch.long)
    counted = count_flops(forward_backward(module, spec.loss_fn, inputs, target))
    if name == "gpt":
        expected = gpt_flops(
            vocabulary=models.GPT_VOCABULARY,
            length=models.GPT_LENGTH,
            width=models.GPT_WIDTH,
            layers=models.GPT_LAYERS,
        )
    else:
        expected = mlp_flops(width=models.MLP_WIDTH, depth=models.MLP_DEPTH)
    assert counted == pytest.approx(expected, rel=0.02)


def test_count_flops_prints_nothing_and_counts_the_same_twice(
    models: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    module = models.mlp(width=16, depth=2)
    run = forward_backward(
        module, models.class_loss, torch.randn(4, 16), torch.randint(0, 16, (4,))
    )
    first, second = count_flops(run), count_flops(run)
    assert first == second > 0
    assert capsys.readouterr() == ("", "")


# The peak table.


@pytest.fixture
def no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)


@pytest.mark.usefixtures("no_override")
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_a_cpu_has_no_peak(dtype: torch.dtype | None) -> None:
    assert peak_flops(torch.device("cpu"), dtype) is None


def test_the_environment_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEAK_FLOPS_ENV, "123.5e12")
    assert peak_flops(torch.device("cpu"), torch.bfloat16) == 123.5e12
    assert peak_flops(torch.device("cuda", 0), None) == 123.5e12


@pytest.mark.parametrize("value", ["fast", "", "0", "-1e12", "nan", "inf"])
def test_a_bad_environment_variable_is_a_config_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(PEAK_FLOPS_ENV, value)
    with pytest.raises(lampdist.ConfigError, match=PEAK_FLOPS_ENV):
        peak_flops(torch.device("cpu"), None)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
        ("NVIDIA A10G", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_device_names_pick_their_entry(name: str, key: str | None) -> None:
    assert match_gpu(name) == key
    if key is not None:
        assert key in PEAK_FLOPS


def test_the_table_holds_the_published_dense_numbers() -> None:
    assert PEAK_FLOPS["H200 SXM"].bf16 == PEAK_FLOPS["H100 SXM"].bf16 == 989.4e12
    assert (PEAK_FLOPS["A100"].bf16, PEAK_FLOPS["A100"].tf32) == (312e12, 156e12)


@pytest.mark.parametrize("key", sorted(PEAK_FLOPS))
def test_every_entry_is_dense(key: str) -> None:
    # Dense tensor-core peaks double from TF32 to 16 bits; a sparse number (twice the dense one)
    # in one column breaks the ratio.
    peak = PEAK_FLOPS[key]
    if peak.tf32 is not None:
        assert peak.fp16 / peak.tf32 == pytest.approx(2, rel=0.02)
        assert peak.tf32 > peak.fp32
    assert peak.bf16 is None or peak.bf16 == peak.fp16


@pytest.fixture
def float32_matmul() -> Iterator[None]:
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    precision = torch.get_float32_matmul_precision()
    yield
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.set_float32_matmul_precision(precision)


@pytest.mark.usefixtures("float32_matmul")
@pytest.mark.parametrize(
    ("setting", "uses_tf32"),
    [
        ("precision highest", False),
        ("precision high", True),
        ("precision medium", True),
        ("allow_tf32 False", False),
        ("allow_tf32 True", True),
        ("precision high; allow_tf32 False", False),
    ],
)
def test_float32_training_gets_tf32_only_where_torch_allows_it(
    setting: str, uses_tf32: bool
) -> None:
    torch.set_float32_matmul_precision("highest")
    for step in setting.split("; "):
        which, value = step.split()
        if which == "precision":
            torch.set_float32_matmul_precision(value)
        else:
            torch.backends.cuda.matmul.allow_tf32 = value == "True"
    a100, v100 = PEAK_FLOPS["A100"], PEAK_FLOPS["V100 SXM2"]
    assert _select_peak(a100, None) == _select_peak(a100, torch.float32)
    assert _select_peak(a100, None) == (a100.tf32 if uses_tf32 else a100.fp32)
    assert _select_peak(v100, None) == v100.fp32  # no TF32 on a V100
    assert _select_peak(a100, torch.bfloat16) == a100.bf16
    assert _select_peak(v100, torch.bfloat16) is None
    assert _select_peak(a100, torch.float64) is None


# MFU.


def test_mfu_is_model_flops_over_the_devices_peak() -> None:
    assert mfu(6e9, 100.0, 1e12, 2) == pytest.approx(0.3)
    assert mfu(6e9, 100.0, None, 2) is None


@pytest.mark.parametrize(("peak", "devices"), [(1e12, 0), (0.0, 1), (-1e12, 1)])
def test_mfu_refuses_no_devices_and_no_peak(peak: float, devices: int) -> None:
    with pytest.raises(lampdist.ConfigError):
        mfu(6e9, 100.0, peak, devices)


# On a GPU: the fused attention kernels count as the CPU's does, and the GPU has its peak.


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.usefixtures("no_override")
def test_a_gpu_counts_as_the_cpu_and_has_its_peak(models: ModuleType) -> None:
    def count(device: torch.device) -> int:
        torch.manual_seed(0)
        module = models.Gpt(vocabulary=96, length=64, width=64, layers=2, heads=4).to(device)
        tokens = torch.randint(0, 96, (2, 65), device=device)
        inputs, target = tokens[:, :-1], tokens[:, 1:]

        def run() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = models.token_loss(module(inputs), target)
            loss.backward()

        return count_flops(run)

    gpu = torch.device("cuda", 0)
    assert count(gpu) == count(torch.device("cpu"))
    key = match_gpu(torch.cuda.get_device_name(gpu))
    assert key is not None, torch.cuda.get_device_name(gpu)
    assert peak_flops(gpu, torch.bfloat16) == PEAK_FLOPS[key].bf16
