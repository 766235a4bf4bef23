"""Training sources that resume from their own state, for the tests of resume and recovery:
lampdist's :class:`~lampdist.RandomBatches`, a Hugging Face ``datasets.IterableDataset`` and a
torchdata ``StatefulDataLoader`` over a ``datasets.Dataset`` built in memory. Every source
yields dict batches ``{"x": ..., "y": ...}`` of one rank's rows (:func:`loss_model` trains on
them); :class:`Dying` wraps one to end its process at a given batch (in-job recovery)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import lampdist

from .reference import mse

KINDS = ("random", "hf-iterable", "hf-loader")
BATCH = 3


def rows(shard: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's batches as one table of inputs and one of targets."""
    return torch.cat([x for x, _ in shard]), torch.cat([y for _, y in shard])


def loss_model(module: torch.nn.Module) -> lampdist.LossModel:
    """The mean squared error of ``module`` on a dict batch (``datasets`` gives float32)."""

    def loss(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return mse(m(batch["x"].double()), batch["y"].double())

    return lampdist.LossModel(module, loss)


def random_source(x: torch.Tensor, y: torch.Tensor) -> lampdist.RandomBatches[Any]:
    """Each batch ``BATCH`` rows drawn at random (no seed: lampdist seeds each rank)."""

    def sample(generator: torch.Generator) -> dict[str, torch.Tensor]:
        index = torch.randint(0, len(x), (BATCH,), generator=generator)
        return {"x": x[index], "y": y[index]}

    return lampdist.RandomBatches(sample)


def _table(x: torch.Tensor, y: torch.Tensor) -> Any:
    import datasets  # type: ignore[import-untyped]

    return datasets.Dataset.from_dict({"x": x.tolist(), "y": y.tolist()}).with_format("torch")


def hf_iterable_source(x: torch.Tensor, y: torch.Tensor) -> Callable[[Any], Any]:
    """A ``datasets.IterableDataset`` of the rows in batches of ``BATCH``, its own
    ``state_dict()`` its place (each pass a new one, told its epoch)."""
    table = _table(x, y)

    def source(context: lampdist.PassContext) -> Any:
        iterable = table.to_iterable_dataset(num_shards=1).batch(BATCH)
        iterable.set_epoch(context.epoch)
        return iterable

    return source


def hf_loader_source(x: torch.Tensor, y: torch.Tensor) -> Callable[[Any], Any]:
    """A torchdata ``StatefulDataLoader`` over a map-style ``datasets.Dataset``, shuffled
    with the pass's generator."""
    from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]

    table = _table(x, y)

    def source(context: lampdist.PassContext) -> Any:
        return StatefulDataLoader(
            table, batch_size=BATCH, shuffle=True, generator=context.generator()
        )

    return source


def make_source(kind: str, x: torch.Tensor, y: torch.Tensor) -> Any:
    """The training source of ``kind`` (one of :data:`KINDS`) over one rank's rows."""
    builders = {"random": random_source, "hf-iterable": hf_iterable_source}
    return builders.get(kind, hf_loader_source)(x, y)


class Dying:
    """A source whose iterables end the process (``signum``) as it takes its ``after``-th
    batch over the whole run, unless ``marker`` exists (written first: the replacement
    process lives on); their state is the wrapped iterable's."""

    def __init__(self, source: Any, after: int, marker: Path, signum: int) -> None:
        self.source, self.after, self.marker, self.signum = source, after, marker, signum
        self.taken = 0

    def __call__(self, context: lampdist.PassContext) -> Any:
        return _DyingIterable(self, self.source(context))


class _DyingIterable:
    def __init__(self, owner: Dying, iterable: Any) -> None:
        self.owner, self.iterable = owner, iterable

    def state_dict(self) -> Any:
        return self.iterable.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.iterable.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        owner = self.owner
        for batch in self.iterable:
            owner.taken += 1
            if owner.taken == owner.after and not owner.marker.exists():
                owner.marker.write_text("killed\n")
                os.kill(os.getpid(), owner.signum)
            yield batch
