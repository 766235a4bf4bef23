"""A small transformers GPT-2 trained with lampdist, one script on every rank:

    export LAMPDIST_SECRET=$(openssl rand -hex 16)
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py [--epochs 4] [--out DIR]

The model is built from a config (nothing is downloaded) and computes its own loss:
``model(**batch).loss``, the mean over the batch's tokens whose label is not -100. That is a
:class:`lampdist.LossModel` with ``mean_over="tokens"``: lampdist weights every batch by
those tokens, over the accumulation window and every rank, so the ranks train exactly as one
process on all their batches would, however many tokens each batch holds. The text is
lampdist's own documentation, a byte a token (a vocabulary of 256: no tokenizer to train or
download), cut into windows of random lengths padded with -100 labels, held in a Hugging
Face ``datasets.Dataset`` built in memory. Each rank reads its shard of the training windows
through torchdata's ``StatefulDataLoader``, whose place the checkpoints keep: a resumed run
goes on from the next batch, without drawing the earlier ones again.

What a nanoGPT-style script's ``estimate_loss`` reports, the loss on held-out text and on
training text, are two validation sets (``"val"`` drives the best model), evaluated once
before training too; transformers' cosine schedule with warm-up sets each step's learning
rate; the accumulation is global (4 batches a step over all ranks, as a DDP script's
``gradient_accumulation_steps``); an event every 5 steps logs the mean loss of those steps.
Every rank prints one JSON line: its rank, a checksum of its final weights and the last
validation losses of both sets (the same on every rank). The checkpoints go to ``DIR/checkpoints``,
and the root ends by exporting the best model as a Hugging Face directory, ``DIR/hf``, which
``transformers.AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import datasets
import torch
import transformers
from torchdata.stateful_dataloader import StatefulDataLoader

import lampdist
from lampdist import checkpoint, schedules

BLOCK = 64  # tokens a window
BATCH = 8  # windows a batch, on each rank
WINDOW = 10  # optimizer steps an epoch
GLOBAL_ACCUMULATION = 4  # batches a step over all ranks
DOCS = Path(__file__).resolve().parents[1] / "docs"


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """lampdist's docs as bytes: the first 90% to train on, the rest held out."""
    text = b"\n".join(path.read_bytes() for path in sorted(DOCS.glob("*.md")))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(len(data) * 0.9)
    return data[:split], data[split:]


def batch_of(
    data: torch.Tensor, generator: torch.Generator, size: int = BATCH
) -> dict[str, torch.Tensor]:
    """``size`` windows at random places, of random lengths: labels past a window's end are
    -100 (no loss there), so the batches hold different numbers of tokens."""
    starts = torch.randint(len(data) - BLOCK, (size,), generator=generator)
    lengths = torch.randint(BLOCK // 2, BLOCK + 1, (size,), generator=generator)
    input_ids = torch.stack([data[s : s + BLOCK] for s in starts.tolist()])
    attention_mask = torch.arange(BLOCK)[None, :] < lengths[:, None]
    labels = input_ids.masked_fill(~attention_mask, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask.long(), "labels": labels}


def loss(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss: the mean over the tokens it predicts (labels shifted by one)."""
    return module(**batch).loss


def tokens(batch: dict[str, torch.Tensor]) -> int:
    """The tokens that loss averages over: the labels after the first that are not -100."""
    return int((batch["labels"][:, 1:] != -100).sum())


def config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=256, n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM",
    )  # fmt: skip


def build(rank: int, nranks: int) -> lampdist.ModelWithData:
    train, held_out = corpus()
    torch.manual_seed(0)  # any start: the root's weights reach every rank first
    module = transformers.GPT2LMHeadModel(config())
    # 4,096 training windows as a datasets table, the same on every rank; each rank its shard
    windows = batch_of(train, torch.Generator().manual_seed(3), size=4096)
    table = datasets.Dataset.from_dict({k: v.tolist() for k, v in windows.items()})
    shard = table.shard(num_shards=nranks, index=rank).with_format("torch")

    def train_batches(context: lampdist.PassContext) -> Any:
        # The rank's shard in an order drawn by the pass's seed (the same again when the pass
        # is run again); its place is the loader's state, kept by the checkpoints.
        return StatefulDataLoader(
            shard, batch_size=BATCH, shuffle=True, generator=context.generator()
        )

    def evaluation(data: torch.Tensor, seed: int) -> Any:
        generator = torch.Generator().manual_seed(seed)
        batches = [batch_of(data, generator) for _ in range(4)]
        return lambda: batches[rank::nranks]  # this rank's share of the same 4 batches

    return lampdist.ModelWithData(
        model=lampdist.LossModel(module, loss, tokens=tokens, mean_over="tokens"),
        train_batches=train_batches,
        validation_batches={"val": evaluation(held_out, 1), "train": evaluation(train, 2)},
    )


async def report(event: lampdist.PassEvent) -> None:
    """The root's progress: each window's mean loss, and each validation set's."""
    if event.window_steps:
        what = f"training, the mean of steps {event.step - event.window_steps + 1}-{event.step}"
    elif event.kind == "valid" and event.done:
        what = f"validation set {event.validation_set!r}"
    else:
        return
    print(f"epoch {event.epoch}, {what}: loss {event.loss:.4f}", file=sys.stderr)


async def main(epochs: int, out: Path) -> None:
    env = lampdist.launch.from_env()
    data = build(env.rank, env.nranks)
    state = await lampdist.train(
        launch=env,
        data=data,
        optimizer_factory=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1),
        loop=lampdist.LoopOptions(
            max_epochs=epochs,
            validate_before_training=True,
            log_every_n_steps=5,
            on_event=report,
            checkpoint_state=checkpoint.to_directory(out / "checkpoints"),
            return_min_validation_loss_model=range(epochs),  # keep the best model
        ),
        step=lampdist.StepOptions(
            steps_per_epoch=WINDOW,
            global_accumulation=GLOBAL_ACCUMULATION,
            max_grad_norm=1.0,
            learning_rate_per_step=schedules.transformers_cosine_with_warmup(
                num_warmup_steps=5, num_training_steps=epochs * WINDOW
            ),
        ),
    )
    weights = data.model.module.state_dict().values()
    last = state.learning_curve[-1].metrics
    result = {
        "rank": env.rank,
        "checksum": float(sum(t.double().sum() for t in weights)),
        "val_loss": last["validation_val_loss"],
        "train_loss": last["validation_train_loss"],
        "first_val_loss": state.learning_curve[0].metrics["validation_val_loss"],
    }
    # The ranks share torchrun's stdout: the line and its newline go in one write (print
    # writes them apart when the output is unbuffered, and two ranks' lines then interleave).
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    if env.is_root:  # one file tree for the run: the best model, as transformers saves it
        await anyio.to_thread.run_sync(
            lambda: checkpoint.export_hf(out / "checkpoints", config(), out / "hf", best=True)
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("hf-causal-lm"))
    args = parser.parse_args()
    try:
        anyio.run(main, args.epochs, args.out)
    except lampdist.Interrupted as stopped:  # Ctrl-C or SIGTERM: stopped in order
        raise SystemExit(128 + stopped.signum) from None
    except lampdist.ConfigError as error:  # bad settings, or ranks that disagree
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
