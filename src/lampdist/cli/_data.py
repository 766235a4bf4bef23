"""The demo's data and model: scikit-learn's digits, split and sharded by rank, and an MLP."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import attrs
import torch

from .._effects import Batch, PassAwareBatchSource
from .._errors import ConfigError
from .._metric import Metric
from .._source import PassContext

__all__ = ["ACCURACY", "Digits", "batch_source", "create_model", "cross_entropy", "load_digits"]

logger = logging.getLogger(__name__)

VALIDATION_FRACTION = 0.2


@attrs.frozen(kw_only=True)
class Digits:
    """The 8x8 digit images (as 64 features in [0, 1]) and labels, split once by a seed."""

    train_inputs: torch.Tensor
    train_labels: torch.Tensor
    valid_inputs: torch.Tensor
    valid_labels: torch.Tensor

    def shard(self, rank: int, nranks: int) -> Digits:
        """Rank ``rank``'s share: every ``nranks``-th example from ``rank`` on."""
        return Digits(
            train_inputs=self.train_inputs[rank::nranks],
            train_labels=self.train_labels[rank::nranks],
            valid_inputs=self.valid_inputs[rank::nranks],
            valid_labels=self.valid_labels[rank::nranks],
        )


def load_digits(seed: int) -> Digits:
    """scikit-learn's digits (1797 images; shipped with the package, no download), shuffled
    with ``seed`` and split 80/20 into training and validation examples."""
    try:
        from sklearn import datasets
    except ImportError as exc:
        raise ConfigError(
            'the demo needs scikit-learn: pip install "lampdist[demo]"', phase="demo"
        ) from exc
    data = datasets.load_digits()
    inputs = torch.tensor(data.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    inputs, labels = inputs[order], labels[order]
    n_valid = int(len(labels) * VALIDATION_FRACTION)
    return Digits(
        train_inputs=inputs[n_valid:],
        train_labels=labels[n_valid:],
        valid_inputs=inputs[:n_valid],
        valid_labels=labels[:n_valid],
    )


def create_model(seed: int) -> torch.nn.Module:
    """A small classifier: 64 pixels, a hidden layer of 128 and 10 classes."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of a batch (what lampdist's ``loss_fn`` must return)."""
    return torch.nn.functional.cross_entropy(output, target)


def batch_source(
    inputs: torch.Tensor, labels: torch.Tensor, batch_size: int, *, shuffle: bool
) -> PassAwareBatchSource:
    """A batch source over ``(inputs, labels)``: a list of batches per pass, shuffled with the
    pass's generator when ``shuffle`` (the same order in every run with the same
    ``StepOptions.shuffle_seed``, resumed or not)."""

    def batches(context: PassContext) -> list[Batch]:
        order = (
            torch.randperm(len(labels), generator=context.generator())
            if shuffle
            else torch.arange(len(labels))
        )
        return list(_chunks(inputs[order], labels[order], batch_size))

    return batches


def _chunks(inputs: torch.Tensor, labels: torch.Tensor, size: int) -> Iterator[Batch]:
    for start in range(0, len(labels), size):
        yield inputs[start : start + size], labels[start : start + size]


def _correct(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    return (output.argmax(dim=1) == target).sum(), target.numel()


ACCURACY = Metric(_correct)
"""The fraction of examples classified right: correct answers over examples, summed over
every batch of every rank by lampdist."""
