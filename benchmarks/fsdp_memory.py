"""Memory of ``step_on="fsdp"`` on CPU processes: what each rank holds, and its peak RSS.

    python benchmarks/fsdp_memory.py --nranks 4 --width 4096 --blocks 16 --json out.json
    python benchmarks/fsdp_memory.py --nranks 2 --width 1024 --blocks 8 --checkpoint

Starts ``--nranks`` processes (one rank each, Gloo over 127.0.0.1, the control channel over
TCP), each building the model on the meta device: ``--blocks`` blocks of a ``width x width``
linear layer and a tanh, each block a sharded unit, then the root module. Every rank trains
``--steps`` AdamW steps of ``--batch`` examples, and with ``--checkpoint`` writes one sharded
checkpoint into a temporary directory. Each rank reports the bytes of its parameters,
gradients (the size of its parameter shards: they are freed after each step) and optimizer
state (its shards' local tensors), its peak RSS before the checkpoint
and at the end (``resource.getrusage``'s high-water mark), and the table compares them with the
whole model's training state (parameters, gradients and AdamW's two moments: 16 bytes a
float32 parameter).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import anyio
import torch

import lampdist
from lampdist import checkpoint, control

SECRET = "fsdp-memory-benchmark"


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def build(width: int, blocks: int) -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(*(Block(width) for _ in range(blocks)))


def rss_peak() -> int:
    """This process's peak resident set size in bytes (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


async def rank_main(args: argparse.Namespace) -> None:
    module = build(args.width, args.blocks)
    generator = torch.Generator().manual_seed(args.rank)
    batches = [
        (torch.randn(args.batch, args.width, generator=generator), torch.zeros(args.batch, 1))
        for _ in range(args.steps)
    ]
    built: list[torch.optim.Optimizer] = []

    def adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        built.append(torch.optim.AdamW(params, lr=1e-4))
        return built[-1]

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output.mean(dim=1, keepdim=True).sub(target).square().mean()

    model = lampdist.SupervisedModel(module, loss)
    data = lampdist.ModelWithData(model=model, train_batches=lambda: batches)
    step = lampdist.StepOptions(step_on="fsdp", fsdp=lampdist.FsdpPolicy(shard_modules=(Block,)))
    measured: dict[str, Any] = {}

    def held(_: Any = None) -> None:
        if "parameters" in measured or not built:
            return
        optimizer = built[0]
        measured["parameters"] = local_bytes(module.parameters())
        # The sharded gradients are the size of the parameter shards; lampdist frees them after
        # each step (set to None), so they are counted, not read.
        measured["gradients"] = measured["parameters"]
        measured["optimizer"] = local_bytes(
            value
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        )
        measured["rss_before_checkpoint"] = rss_peak()

    timeouts = lampdist.Timeouts(join=120, setup=300, collective=600)
    if args.rank == 0:
        effect = checkpoint.to_directory(args.checkpoint_dir) if args.checkpoint_dir else None

        async def on_event(event: lampdist.PassEvent) -> None:
            if event.done:
                held()

        async with control.tcp_root("127.0.0.1", 0, nranks=args.nranks, secret=SECRET) as root:
            print(f"PORT {root.address[1]}", flush=True)
            await lampdist.drive_distributed_training(
                data=data,
                nranks=args.nranks,
                device="cpu",
                control=root,
                optimizer_factory=adamw,
                loop=lampdist.LoopOptions(max_epochs=1, checkpoint_state=effect, on_event=on_event),
                step=step,
                timeouts=timeouts,
            )
    else:
        async with control.tcp_follower(
            "127.0.0.1", args.port, rank=args.rank, secret=SECRET
        ) as follower:
            await lampdist.follow_distributed_training(
                data=data,
                rank=args.rank,
                nranks=args.nranks,
                device="cpu",
                control=follower,
                optimizer_factory=adamw,
                step=step,
                timeouts=timeouts,
            )
    held()  # a follower: after the run
    measured["rss_peak"] = rss_peak()
    await anyio.Path(args.result).write_text(json.dumps(measured))


def spawn(args: argparse.Namespace, rank: int, port: int, result: Path) -> subprocess.Popen[str]:
    command = [sys.executable, __file__, "--rank", str(rank), "--port", str(port)]
    command += ["--nranks", str(args.nranks), "--width", str(args.width)]
    command += ["--blocks", str(args.blocks), "--steps", str(args.steps)]
    command += ["--batch", str(args.batch), "--result", str(result)]
    if args.checkpoint_dir:
        command += ["--checkpoint-dir", str(args.checkpoint_dir)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def drive(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch)
        if args.checkpoint:
            args.checkpoint_dir = str(base / "checkpoints")
        results = [base / f"rank{rank}.json" for rank in range(args.nranks)]
        root = spawn(args, 0, 0, results[0])
        assert root.stdout is not None
        port = int(root.stdout.readline().split()[1])
        processes = [root] + [
            spawn(args, rank, port, results[rank]) for rank in range(1, args.nranks)
        ]
        codes = [process.wait() for process in processes]
        if any(codes):
            raise SystemExit(f"ranks exited with {codes}")
        ranks = [json.loads(path.read_text()) for path in results]
        checkpoint_bytes = 0
        if args.checkpoint:
            checkpoint_bytes = sum(
                f.stat().st_size for f in Path(args.checkpoint_dir).rglob("*") if f.is_file()
            )
    parameters = args.blocks * (args.width * args.width + args.width)
    whole = 16 * parameters  # float32 parameters, gradients and AdamW's two moments
    for rank in ranks:
        rank["state"] = rank["parameters"] + rank["gradients"] + rank["optimizer"]
        rank["state_share"] = rank["state"] / whole
    return {
        "nranks": args.nranks,
        "width": args.width,
        "blocks": args.blocks,
        "parameters": parameters,
        "whole_training_state_bytes": whole,
        "checkpoint_bytes": checkpoint_bytes,
        "ranks": ranks,
        "torch": torch.__version__,
    }


def table(result: dict[str, Any]) -> Iterator[str]:
    whole = result["whole_training_state_bytes"]
    n = result["nranks"]
    yield (
        f"{result['parameters'] / 1e6:.0f}M parameters; whole AdamW training state "
        f"{whole / 2**30:.2f} GiB; {n} ranks; 1/n = {1 / n:.3f}"
    )
    yield "rank  state GiB  share  (1/n+10%)  peak RSS before ckpt GiB  peak RSS GiB  /whole"
    for index, rank in enumerate(result["ranks"]):
        yield (
            f"{index:>4}  {rank['state'] / 2**30:9.3f}  {rank['state_share']:.3f}  "
            f"{1.1 / n:9.3f}  {rank['rss_before_checkpoint'] / 2**30:24.3f}  "
            f"{rank['rss_peak'] / 2**30:12.3f}  {rank['rss_peak'] / whole:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--checkpoint", action="store_true", help="write one checkpoint")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        os.environ.setdefault("LAMPDIST_SECRET", SECRET)
        anyio.run(rank_main, args)
        return
    result = drive(args)
    for line in table(result):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
