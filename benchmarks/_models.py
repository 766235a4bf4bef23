"""The benchmark's models and their random data: ``gpt``, ``mlp`` and ``small``.

Every configuration of a run builds its model with the same seed and draws its batches on the
device from a generator seeded by the rank, so each configuration sees the same weights and,
step for step, the same data; ranks see different data.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MODELS",
    "Batch",
    "ModelSpec",
    "Workload",
    "build_workload",
    "count_parameters",
    "original_module",
]

Batch = tuple[torch.Tensor, torch.Tensor]

# Distinct batches generated per rank and cycled through: the same step sees the same batch in
# every configuration, and the pool stays small on the device whatever --steps is.
POOL_SIZE = 8
MODEL_SEED = 0
DATA_SEED = 1000


class Block(nn.Module):
    """A pre-LayerNorm decoder block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.ln1(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        mixed: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return mixed


class Gpt(nn.Module):
    """A GPT-style decoder: learned positions, pre-LayerNorm blocks, an untied output layer."""

    def __init__(self, *, vocabulary: int, length: int, width: int, layers: int, heads: int):
        super().__init__()
        self.tokens = nn.Embedding(vocabulary, width)
        self.positions = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def mlp(*, width: int, depth: int) -> nn.Module:
    """``depth`` square linear layers of ``width`` with ReLU between them."""
    layers: list[nn.Module] = []
    for index in range(depth):
        if index > 0:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def class_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the batch, the output read as class scores."""
    return F.cross_entropy(output, target)


@attrs.frozen(kw_only=True)
class ModelSpec:
    """How to build one of the benchmark's models and draw a batch for it."""

    name: str
    batch_size: int
    autocast_dtype: torch.dtype | None
    build: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator, torch.device], Batch]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    describe: str
    blocks: tuple[type[nn.Module], ...] = ()
    """The model's repeated unit (a transformer's blocks, an MLP's linear layers): the FSDP2
    configurations (``fsdp`` and ``lampdist-fsdp``) ``fully_shard`` each child module of one
    of these types, then the root module; with none, the root module alone."""


GPT_VOCABULARY, GPT_LENGTH, GPT_WIDTH, GPT_LAYERS, GPT_HEADS = 32000, 512, 768, 12, 12
MLP_WIDTH, MLP_DEPTH = 4096, 8
SMALL_WIDTH, SMALL_DEPTH = 256, 4


def _gpt_batch(size: int, generator: torch.Generator, device: torch.device) -> Batch:
    tokens = torch.randint(
        0, GPT_VOCABULARY, (size, GPT_LENGTH + 1), generator=generator, device=device
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _mlp_batch(width: int) -> Callable[[int, torch.Generator, torch.device], Batch]:
    def make(size: int, generator: torch.Generator, device: torch.device) -> Batch:
        inputs = torch.randn(size, width, generator=generator, device=device)
        target = torch.randint(0, width, (size,), generator=generator, device=device)
        return inputs, target

    return make


MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec(
        name="gpt",
        batch_size=16,
        autocast_dtype=torch.bfloat16,
        build=lambda: Gpt(
            vocabulary=GPT_VOCABULARY,
            length=GPT_LENGTH,
            width=GPT_WIDTH,
            layers=GPT_LAYERS,
            heads=GPT_HEADS,
        ),
        make_batch=_gpt_batch,
        loss_fn=token_loss,
        describe=(
            f"GPT decoder d={GPT_WIDTH}, {GPT_LAYERS} layers, {GPT_HEADS} heads, "
            f"sequence {GPT_LENGTH}, vocabulary {GPT_VOCABULARY}, untied, bf16 autocast"
        ),
        blocks=(Block,),
    ),
    "mlp": ModelSpec(
        name="mlp",
        batch_size=256,
        autocast_dtype=torch.bfloat16,
        build=lambda: mlp(width=MLP_WIDTH, depth=MLP_DEPTH),
        make_batch=_mlp_batch(MLP_WIDTH),
        loss_fn=class_loss,
        describe=f"MLP {MLP_DEPTH} x {MLP_WIDTH}, ReLU, cross-entropy, bf16 autocast",
        blocks=(nn.Linear,),
    ),
    "small": ModelSpec(
        name="small",
        batch_size=64,
        autocast_dtype=None,
        build=lambda: mlp(width=SMALL_WIDTH, depth=SMALL_DEPTH),
        make_batch=_mlp_batch(SMALL_WIDTH),
        loss_fn=class_loss,
        describe=f"MLP {SMALL_DEPTH} x {SMALL_WIDTH}, ReLU, cross-entropy, fp32",
        blocks=(nn.Linear,),
    ),
}


def count_parameters(name: str) -> int:
    """The parameter count of model ``name``, built on the meta device (no memory)."""
    with torch.device("meta"):
        module = MODELS[name].build()
    return sum(parameter.numel() for parameter in module.parameters())


def original_module(module: nn.Module) -> nn.Module:
    """The module itself under a ``torch.compile`` wrapper (``LAMPDIST_BENCH_COMPILE=1``)."""
    inner = getattr(module, "_orig_mod", module)
    return inner if isinstance(inner, nn.Module) else module


@attrs.define(eq=False)
class Workload:
    """A model on its device and the rank's pool of batches."""

    spec: ModelSpec
    module: nn.Module
    pool: list[Batch]

    def batch(self, step: int) -> Batch:
        """The batch of step ``step`` (0-based, warm-up steps included)."""
        return self.pool[step % len(self.pool)]


def build_workload(name: str, device: torch.device, *, rank: int) -> Workload:
    """Model ``name`` on ``device`` with the run's common weights, and rank ``rank``'s batches."""
    spec = MODELS[name]
    torch.manual_seed(MODEL_SEED)
    module = spec.build().to(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(DATA_SEED + rank)
    pool = [spec.make_batch(spec.batch_size, generator, device) for _ in range(POOL_SIZE)]
    return Workload(spec=spec, module=module, pool=pool)
