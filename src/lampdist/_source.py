"""What a batch source is told about the pass it feeds: :class:`PassContext`.

A batch source is called once per pass. One that takes an argument gets the pass's context:
the epoch, the kind of pass, the rank and a seed of its own, derived from
``StepOptions.shuffle_seed``, the rank, the epoch and the kind. A loader that shuffles with
``generator=context.generator()`` draws the same order in every run with that seed, whatever
the order in which the ranks' threads run, and a run resumed at epoch ``e`` draws what an
uninterrupted one drew there: the seed is a function of the pass, so there is no generator
state to save. An endless training stream (``steps_per_epoch``) sees one pass for the whole
run, so a sampler that draws at random each step keeps its generator's place as a state:
:class:`~lampdist.RandomBatches` does, from the context's seed.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any, Literal

import attrs
import torch

from ._errors import ConfigError

__all__ = ["PassContext", "call_source", "check_source", "pass_seed"]

PassKind = Literal["train", "valid"]


def pass_seed(shuffle_seed: int, rank: int, epoch: int, kind: PassKind) -> int:
    """The seed of one rank's pass: 63 bits of SHA-256 over its coordinates (stable across
    versions, platforms and processes)."""
    digest = hashlib.sha256(f"lampdist/{shuffle_seed}/{rank}/{epoch}/{kind}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


@attrs.frozen(kw_only=True)
class PassContext:
    """The pass a batch source is called for (a source that takes one argument gets it).

    ``seed`` is this rank's seed for this pass: equal in every run with the same
    ``StepOptions.shuffle_seed``, different between ranks, epochs and kinds of pass. Shuffle
    with :meth:`generator` (``DataLoader(..., shuffle=True, generator=context.generator())``)
    and the order is exact run after run, in one process or several, interrupted and resumed
    or not. ``epoch`` also fits ``DistributedSampler.set_epoch``.
    """

    epoch: int
    """The epoch, counted from 0 (as in :class:`~lampdist.PassEvent`)."""
    kind: PassKind
    """``"train"`` or ``"valid"``."""
    rank: int
    nranks: int
    seed: int

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        """A new ``torch.Generator`` on ``device`` seeded with :attr:`seed`."""
        return torch.Generator(device=device).manual_seed(self.seed)


def check_source(source: Callable[..., Any], name: str) -> bool:
    """Whether ``source`` takes the pass's :class:`PassContext` (one required positional
    parameter) rather than no argument. Raises :class:`~lampdist.ConfigError` for a source
    that is not callable or needs more than one argument."""
    if not callable(source):
        raise ConfigError(
            f"{name} must be a callable that returns the batches of a pass (e.g. "
            f"lambda: loader), got {type(source).__name__}",
            phase="configure",
        )
    try:
        signature = inspect.signature(source)
    except (TypeError, ValueError):  # a builtin without a signature: call it bare
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and (p.kind in positional or p.kind is inspect.Parameter.KEYWORD_ONLY)
    ]
    if len(required) > 1 or any(
        signature.parameters[p].kind is inspect.Parameter.KEYWORD_ONLY for p in required
    ):
        raise ConfigError(
            f"{name} takes no argument or one positional argument (the pass's "
            f"lampdist.PassContext), but it requires {required}",
            phase="configure",
        )
    return len(required) == 1


def call_source(
    source: Callable[..., Any], context: PassContext
) -> Iterable[Any] | AsyncIterable[Any]:
    """``source(context)`` or ``source()``, as :func:`check_source` says."""
    if check_source(source, "a batch source"):
        return source(context)  # type: ignore[no-any-return]
    return source()  # type: ignore[no-any-return]
