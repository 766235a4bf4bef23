"""A tiny language model that computes its own token-mean loss (as a Hugging Face causal LM
does: ``module(**batch).loss``, labels shifted, ``-100`` ignored), dict batches whose token
counts differ, and a plain single-process reference on the concatenated batches."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

import lampdist

VOCAB = 11
LENGTH = 6

Batch = dict[str, torch.Tensor]

# Batch sizes of each rank's training batches (0: an empty batch), by rank count.
TRAIN_SIZES = {
    1: [[3, 5, 2, 4]],
    2: [[3, 5, 2, 4, 1], [2, 0, 4, 3]],
    3: [[3, 5, 2, 4, 1], [2, 0, 4, 3], [5, 1]],
}
VALID_SIZES = {1: [[3, 4]], 2: [[3, 4], [2]], 3: [[3, 4], [2], [1, 5]]}
ACCUMULATE = 3
EPOCHS = 2


@dataclasses.dataclass
class Output:
    """What the module returns, as a transformers model's output (a dataclass) carries its
    loss. FSDP2 finds the tensors of a dataclass output (to unshard the parameters again for
    backward), not those of an attrs class."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyLM(torch.nn.Module):
    """Embedding, tanh layer, head; the loss is cross-entropy over the shifted labels'
    positions that are not ``-100`` (their mean)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, 5)
        self.hidden = torch.nn.Linear(5, 7)
        self.head = torch.nn.Linear(7, VOCAB)
        self.double()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        logits = self.head(torch.tanh(self.hidden(self.embed(input_ids))))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return Output(loss, logits)


def lm_loss(module: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return module(**batch).loss  # type: ignore[no-any-return]


def lm_loss_and_output(module: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
    output = module(**batch)
    return output.loss, output.logits


def count_labels(batch: Batch) -> int:
    """The positions the loss is a mean over: the shifted labels that are not ``-100``."""
    return int((batch["labels"][:, 1:] != -100).sum())


def make_batch(generator: torch.Generator, size: int) -> Batch:
    ids = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)
    labels = ids.clone()
    ignored = torch.rand(size, LENGTH, generator=generator) < 0.4  # uneven token counts
    labels[ignored] = -100
    return {"input_ids": ids, "labels": labels}


def make_shards(sizes: Sequence[Sequence[int]], seed: int) -> list[list[Batch]]:
    generator = torch.Generator().manual_seed(seed)
    return [[make_batch(generator, size) for size in rank] for rank in sizes]


def lm_model(
    module: torch.nn.Module, mean_over: Literal["examples", "tokens"] = "tokens", **kwargs: Any
) -> Any:
    return lampdist.LossModel(module, lm_loss, tokens=count_labels, mean_over=mean_over, **kwargs)


def sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _cat(batches: list[Batch]) -> Batch:
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}


def reference_training(
    module: torch.nn.Module,
    optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    train: Sequence[Sequence[Batch]],
    valid: Sequence[Sequence[Batch]],
    *,
    epochs: int = EPOCHS,
    accumulate: int = ACCUMULATE,
) -> tuple[torch.nn.Module, list[float], list[float]]:
    """One process, each step one forward on the concatenation of every rank's batches of
    the step: the module's own token-mean loss. Returns the trained module and the per-epoch
    token-weighted training and validation losses."""
    module = copy.deepcopy(module)
    optimizer = optimizer_factory(list(module.parameters()))
    steps = max((len(shard) + accumulate - 1) // accumulate for shard in train)
    train_losses, valid_losses = [], []
    for _ in range(epochs):
        module.train()
        loss_sum, tokens = 0.0, 0
        for step in range(steps):
            window = [
                batch
                for shard in train
                for batch in shard[step * accumulate : (step + 1) * accumulate]
                if len(batch["input_ids"]) > 0
            ]
            if not window:
                continue
            joined = _cat(window)
            optimizer.zero_grad()
            loss = module(**joined).loss
            loss.backward()
            optimizer.step()
            loss_sum += float(loss.detach()) * count_labels(joined)
            tokens += count_labels(joined)
        train_losses.append(loss_sum / tokens)
        module.eval()
        with torch.no_grad():
            joined = _cat([b for shard in valid for b in shard if len(b["input_ids"]) > 0])
            valid_losses.append(float(module(**joined).loss))
    return module, train_losses, valid_losses
