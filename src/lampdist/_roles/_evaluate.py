"""The evaluation-only run: every validation set once, on every rank, from a checkpoint."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .._effects import OnPassEvent, OptimizerFactory
from .._epoch import PassResult
from .._errors import ConfigError
from .._options import LoopOptions, ModelWithData, StepOptions, Timeouts
from ..checkpoint import Resumed
from ..launch import LaunchEnv
from ._commands import EVALUATED
from ._local import run_locally
from ._train import resumed, run_this_rank, train_rank

__all__ = ["Evaluation", "evaluate", "evaluate_locally"]

ONE_SOURCE = "validation"
"""The name an :class:`Evaluation` gives the one source of ``validation_batches``."""


@attrs.frozen(kw_only=True)
class Evaluation:
    """What :func:`lampdist.evaluate` measured, the same on every rank: per validation set
    (by its name in ``validation_batches``, ``"validation"`` for one source, in order) the
    mean loss over every rank's examples, the examples counted and the metrics (keyed by the
    names of the model's metrics)."""

    losses: Mapping[str, float]
    examples: Mapping[str, int]
    metrics: Mapping[str, Mapping[str, float | tuple[float, ...]]]

    @classmethod
    def from_results(cls, results: Mapping[str | None, PassResult]) -> Evaluation:
        """The evaluation of each set's shared pass result (``None``: the one source)."""
        named = {ONE_SOURCE if name is None else name: r for name, r in results.items()}
        return cls(
            losses={name: r.loss for name, r in named.items()},
            examples={name: r.examples for name, r in named.items()},
            metrics={name: dict(r.metrics) for name, r in named.items()},
        )


def _check_validates(data: ModelWithData) -> None:
    if data.validation_batches is None:
        raise ConfigError(
            "evaluate needs validation_batches: give ModelWithData(validation_batches=source) "
            'or validation_batches={"name": source, ...}',
            phase="configure",
        )


async def evaluate(
    *,
    data: ModelWithData,
    optimizer_factory: OptimizerFactory,
    step: StepOptions = StepOptions(),
    timeouts: Timeouts = Timeouts(),
    resume: Resumed | str | os.PathLike[str] | None = None,
    on_event: OnPassEvent | None = None,
    launch: LaunchEnv | None = None,
    ssl_context: ssl.SSLContext | None = None,
    stop_on_signals: bool = True,
) -> Evaluation:
    """Evaluate as this process's rank: every validation set of ``data`` once, on every
    rank, and return the losses and metrics, the same on every rank.

    The launch and data arguments are :func:`lampdist.train`'s, and one script serves every
    rank alike. ``resume`` is the checkpoint whose model is evaluated: a
    :class:`~lampdist.checkpoint.Resumed` (:func:`lampdist.checkpoint.load_latest`'s or
    :func:`lampdist.checkpoint.load`'s), or the path or URL of one checkpoint, as
    :func:`lampdist.train` takes it, which the root loads (its model and optimizer state,
    hence ``optimizer_factory``: the training run's; the followers ignore ``resume``);
    ``None`` evaluates the model as given. The ranks join, agree and take the
    root's model as for training; then each set runs one validation pass in order (each
    rank over its own shard of it, the loss exact over every rank's examples), the root
    sends every rank its result, and the run stops.
    Nothing is trained and no checkpoint is written; every rank ends holding the evaluated
    model. ``on_event`` (the root's) receives each set's :class:`~lampdist.PassEvent`.

    Raises :class:`~lampdist.ConfigError` without ``validation_batches`` or for a directory
    without a checkpoint, and every error of :func:`lampdist.train`.
    """
    _check_validates(data)
    loop = LoopOptions(max_epochs=0, on_event=on_event)
    collected: dict[str | None, PassResult] = {}

    async def work(env: LaunchEnv, signals: Any) -> None:
        loaded = await resumed(resume) if env.is_root else None  # the root's to load
        args = (data, optimizer_factory, loop, step, timeouts, loaded, ssl_context)
        await train_rank(env, *args, signals, evaluating=True)

    token = EVALUATED.set(collected)
    try:
        await run_this_rank(launch, stop_on_signals, work)
    finally:
        EVALUATED.reset(token)
    return Evaluation.from_results(collected)


async def evaluate_locally(
    *,
    models_with_data_streams: Sequence[ModelWithData],
    optimizer_factory: OptimizerFactory,
    step: StepOptions = StepOptions(),
    timeouts: Timeouts = Timeouts(),
    resume: Resumed | str | os.PathLike[str] | None = None,
    on_event: OnPassEvent | None = None,
) -> Evaluation:
    """:func:`evaluate` over several devices of this process, one rank per entry, as
    :func:`lampdist.local_data_parallel_training_loop` trains; every rank's results are the
    same, and this is them."""
    for data in models_with_data_streams:
        _check_validates(data)
    loop = LoopOptions(max_epochs=0, on_event=on_event)
    collected: dict[str | None, PassResult] = {}
    token = EVALUATED.set(collected)
    try:
        await run_locally(
            models_with_data_streams,
            optimizer_factory,
            loop,
            step,
            timeouts,
            await resumed(resume),
            None,
            evaluating=True,
        )
    finally:
        EVALUATED.reset(token)
    return Evaluation.from_results(collected)
