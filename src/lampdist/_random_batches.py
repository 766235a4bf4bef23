"""Batches drawn at random, one generator per rank, that resume where they stopped:
:class:`RandomBatches`.

The per-step random windows of LLM training (a window of a token file at a random offset, each
step) are a function of a generator, not a pass over a dataset: ``sample(generator) -> batch``.
:class:`RandomBatches` is the training source that calls it: lampdist seeds each rank's
generator from ``StepOptions.shuffle_seed`` and the rank (the :class:`~lampdist.PassContext`'s
seed, so no seed lives in user code), and the iterable it returns has a ``state_dict()``, the
generator's state and the batches drawn, which a checkpoint keeps with the rank's place in its
data. A run resumed from that checkpoint, or a rank replaced in the job, loads the state and
draws the next batch at once: the time to the first batch does not grow with the position, and
the batches are the uninterrupted run's, bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from ._errors import ConfigError
from ._source import PassContext

__all__ = ["STATE_KIND", "RandomBatches", "RandomDraws", "check_pass_ends", "is_random_state"]

B = TypeVar("B")

STATE_KIND = "lampdist.RandomBatches"
"""The ``kind`` of a :meth:`RandomDraws.state_dict` (how a checkpoint tells its states)."""


class RandomBatches(Generic[B]):
    """A training source of batches drawn at random: ``sample(generator)`` returns one batch,
    drawing every random number it uses from ``generator`` (a CPU ``torch.Generator``).

    Give it as ``train_batches``. Each rank's pass over its data calls it with the pass's
    :class:`~lampdist.PassContext` and gets a :class:`RandomDraws` over a generator seeded
    with the context's seed: different on every rank, the same in every run with the same
    ``StepOptions.shuffle_seed``. With ``steps_per_epoch`` the stream is endless (``steps``
    ``None``, the default) and resumes from its state; without, give ``steps``, the batches of
    one pass (each pass then draws from its own seed).

    ``sample`` runs on the rank's loading thread: it may read a memory-mapped file, but all of
    its randomness must come from ``generator`` (not ``torch``'s or ``random``'s global
    generators), or the batches do not resume exactly.
    """

    def __init__(self, sample: Callable[[torch.Generator], B], *, steps: int | None = None):
        if not callable(sample):
            raise ConfigError(
                "RandomBatches(sample): sample must be a callable that draws one batch from "
                f"a torch.Generator (e.g. lambda g: windows(g)), got {type(sample).__name__}",
                phase="configure",
            )
        if steps is not None and (type(steps) is not int or steps < 1):
            raise ConfigError(
                f"RandomBatches(steps={steps!r}): steps must be a positive int (the batches "
                "of one pass), or None for an endless stream (with steps_per_epoch)",
                phase="configure",
            )
        self.sample = sample
        self.steps = steps

    def __call__(self, context: PassContext) -> RandomDraws[B]:
        """The batches of one rank's pass: a generator seeded with ``context.seed``."""
        return RandomDraws(self.sample, context.generator(), steps=self.steps)

    def __repr__(self) -> str:
        name = getattr(self.sample, "__qualname__", type(self.sample).__name__)
        return f"RandomBatches({name}, steps={self.steps})"


class RandomDraws(Generic[B]):
    """One rank's batches of a :class:`RandomBatches`: ``sample(generator)`` again and again
    (``steps`` times, or without end). :meth:`state_dict` is where it stands."""

    def __init__(
        self,
        sample: Callable[[torch.Generator], B],
        generator: torch.Generator,
        *,
        steps: int | None,
    ) -> None:
        self.sample, self.generator, self.steps = sample, generator, steps
        self.drawn = 0
        """Batches drawn so far."""

    def __iter__(self) -> Iterator[B]:
        while self.steps is None or self.drawn < self.steps:
            batch = self.sample(self.generator)
            self.drawn += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The generator's state (a uint8 tensor) and the batches drawn, after the last batch
        drawn."""
        return {"kind": STATE_KIND, "generator": self.generator.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from ``state`` (a :meth:`state_dict`): the next batch is the one drawn after
        it."""
        if not is_random_state(state):
            held = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ConfigError(
                f"RandomBatches: the checkpoint's training-source state is not a RandomBatches "
                f"state (it holds {held}): resume with the training source that wrote it",
                phase="resume",
            )
        self.generator.set_state(state["generator"])
        self.drawn = int(state["drawn"])


def is_random_state(state: object) -> bool:
    """Whether ``state`` is a :meth:`RandomDraws.state_dict`."""
    return isinstance(state, Mapping) and state.get("kind") == STATE_KIND


def check_pass_ends(source: object, steps_per_epoch: int | None, *, rank: int) -> None:
    """Raise :class:`ConfigError` for a training ``source`` whose pass would never end: an
    endless :class:`RandomBatches` (no ``steps``) without ``steps_per_epoch``, which alone
    ends an epoch of an endless stream."""
    if isinstance(source, RandomBatches) and source.steps is None and steps_per_epoch is None:
        raise ConfigError(
            "train_batches=RandomBatches(sample) is endless and StepOptions.steps_per_epoch is "
            "None, so its first pass would never end: pass StepOptions(steps_per_epoch=N) (an "
            "epoch of N steps) or RandomBatches(sample, steps=N) (N batches a pass)",
            rank=rank,
            phase="configure",
        )
