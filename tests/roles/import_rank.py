"""One rank of an fsdp run over TCP that may start from stored weights, for the tests.

    python -m tests.roles.import_rank --rank 0 --nranks 2 --out DIR [--port 0]
        [--model mlp|gpt2] [--seed N] [--meta] [--weights PATH] [--count-reads]

The root prints ``PORT <n>`` once it listens; followers take ``--port``. The root builds its
model from ``--seed``, a follower from another seed (the root's weights must win); with
``--meta`` every rank builds it on the meta device; with ``--weights`` the run starts from
``lampdist.from_safetensors(PATH)``. Each rank writes its shards' local parts to
``DIR/rank<r>.pt`` (see :func:`.tcp_rank.local_parts`), the root its learning curve to
``DIR/curve.json``; with ``--count-reads`` each rank writes ``DIR/read<r>.json``: the bytes it
got from safetensors for each stored tensor (``safe_open`` wrapped: every ``get_tensor`` and
every ``get_slice(...)[...]`` counted). The secret comes from ``LAMPDIST_SECRET``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import torch

import lampdist
from lampdist import control

from .reference import make_model, make_shards, mse
from .tcp_rank import SIZES, VALID_SIZES, local_parts, sgd

GPT2: dict[str, Any] = {
    "vocab_size": 64,
    "n_positions": 16,
    "n_embd": 16,
    "n_layer": 2,
    "n_head": 2,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
"""A tiny GPT2, without dropout (the runs compared must draw nothing)."""


def gpt2(seed: int) -> Any:
    """A tiny float64 ``GPT2LMHeadModel`` initialized from ``seed`` (its head tied to its
    token embedding)."""
    import transformers

    hf: Any = transformers  # untyped
    torch.manual_seed(seed)
    return hf.GPT2LMHeadModel(hf.GPT2Config(**GPT2)).double()


def gpt2_buffers(module: Any) -> None:
    """An ``init_weights`` for a meta-device GPT2 whose stored weights fill every parameter:
    the attention's causal mask, a buffer that is not stored (``persistent=False``)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    if not isinstance(module, GPT2Attention):  # the others are stored whole
        raise TypeError(f"{type(module).__name__} has stored weights: nothing to initialize")
    attention: Any = module  # transformers' modules are untyped
    size = attention.bias.shape[-1]
    mask = torch.tril(torch.ones(size, size, dtype=torch.bool))
    attention.bias.copy_(mask.view_as(attention.bias))
    attention.masked_bias.fill_(-1e4)


def gpt2_blocks() -> tuple[type[torch.nn.Module], ...]:
    """GPT2's blocks, each an fsdp unit (the embeddings and the tied head in the root's)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return (GPT2Block,)


def lm_batches(rank: int, sizes: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    return [
        {"input_ids": ids, "labels": ids}
        for size in sizes
        for ids in [torch.randint(0, GPT2["vocab_size"], (size, 8), generator=generator)]
    ]


def lm_loss(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss: torch.Tensor = module(**batch).loss
    return loss


def count_reads() -> Counter[str]:
    """Wrap ``safetensors.safe_open`` in this process so that every tensor it returns is
    counted (bytes, by stored name) into the counter returned."""
    import safetensors

    real = safetensors.safe_open
    counted: Counter[str] = Counter()

    class Slice:
        def __init__(self, inner: Any, name: str) -> None:
            self.inner, self.name = inner, name

        def get_shape(self) -> Any:
            return self.inner.get_shape()

        def __getitem__(self, index: Any) -> torch.Tensor:
            part: torch.Tensor = self.inner[index]
            counted[self.name] += part.nbytes
            return part

    class Counting:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner: Any = real(*args, **kwargs)

        def __enter__(self) -> Counting:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.inner.__exit__(*exc)

        def keys(self) -> Any:
            return self.inner.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            tensor: torch.Tensor = self.inner.get_tensor(name)
            counted[name] += tensor.nbytes
            return tensor

        def get_slice(self, name: str) -> Slice:
            return Slice(self.inner.get_slice(name), name)

    setattr(safetensors, "safe_open", Counting)  # noqa: B010  # a class for a class
    return counted


def model_and_data(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, Any, Any]:
    """The rank's module, its lampdist model, and its training and validation batches."""
    seed = args.seed if args.rank == 0 else 10 + args.rank
    if args.model == "gpt2":
        with torch.device("meta" if args.meta else "cpu"):
            module = gpt2(seed)
        train = lm_batches(args.rank, SIZES[args.rank], seed=1)
        valid = lm_batches(args.rank, VALID_SIZES[args.rank], seed=2)
        return module, lampdist.LossModel(module, lm_loss), train, valid
    with torch.device("meta" if args.meta else "cpu"):
        module = make_model(seed=seed, width=args.width)
    train = make_shards(SIZES, seed=1)[args.rank]
    valid = make_shards(VALID_SIZES, seed=2)[args.rank]
    return module, lampdist.SupervisedModel(module, mse), train, valid


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nranks", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt2"])
    parser.add_argument("--seed", type=int, default=0, help="the root's model seed")
    parser.add_argument("--width", type=int, default=6)
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--weights", default=None, help="from_safetensors(PATH)")
    parser.add_argument("--count-reads", action="store_true")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    reads = count_reads() if args.count_reads else None
    module, model, train, valid = model_and_data(args)
    weights = None if args.weights is None else lampdist.from_safetensors(args.weights)
    step = lampdist.StepOptions(
        accumulate_gradient_over_n_batches=3,
        step_on="fsdp",
        fsdp=lampdist.FsdpPolicy(
            shard_modules=gpt2_blocks() if args.model == "gpt2" else (),
            initial_weights=weights,
            init_weights=gpt2_buffers if args.model == "gpt2" else None,
        ),
    )
    data = lampdist.ModelWithData(
        model=model, train_batches=lambda: list(train), validation_batches=lambda: list(valid)
    )
    secret = os.environ["LAMPDIST_SECRET"]
    common: dict[str, Any] = {
        "data": data,
        "nranks": args.nranks,
        "device": "cpu",
        "optimizer_factory": sgd,
        "step": step,
        "timeouts": lampdist.Timeouts(join=30),
    }
    if args.rank == 0:
        async with control.tcp_root(
            "127.0.0.1", args.port, nranks=args.nranks, secret=secret
        ) as root:
            print(f"PORT {root.address[1]}", flush=True)
            state = await lampdist.drive_distributed_training(
                control=root, loop=lampdist.LoopOptions(max_epochs=args.epochs), **common
            )
        curve = [[p.training_loss, p.validation_loss] for p in state.learning_curve]
        (args.out / "curve.json").write_text(json.dumps(curve))
    else:
        async with control.tcp_follower(
            "127.0.0.1", args.port, rank=args.rank, secret=secret
        ) as follower:
            await lampdist.follow_distributed_training(control=follower, rank=args.rank, **common)
    torch.save(local_parts(module), args.out / f"rank{args.rank}.pt")
    if reads is not None:
        (args.out / f"read{args.rank}.json").write_text(json.dumps(dict(reads)))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
