"""One rank's model and its batch sources: :class:`ModelWithData`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import attrs

from ._effects import BatchSource, PassAwareBatchSource
from ._errors import ConfigError
from ._loss_model import LossModel
from ._model import SupervisedModel
from ._source import check_source

__all__ = ["ModelWithData", "Source", "validation_set_names"]

Source: TypeAlias = BatchSource | PassAwareBatchSource


def _sets(value: Any) -> Any:
    """Several validation sets as a plain dict in the given order (a source, ``None`` and
    what is not a mapping are left for the checks)."""
    return dict(value) if isinstance(value, Mapping) else value


def validation_set_names(sets: Mapping[str, Source], metrics: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of ``sets``, checked: each a non-empty identifier, and no value reported
    under a set's name (``<set>_loss``, ``<set>_<metric>``) the same as another's or as a
    metric's name. Raises :class:`ConfigError` otherwise."""
    names = tuple(sets)
    if not names:
        raise ConfigError(
            "validation_batches is an empty mapping: give at least one set "
            '(validation_batches={"val": source}) or None not to validate',
            phase="configure",
        )
    reported: dict[str, str] = {name: f"the metric {name!r}" for name in metrics}
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(
                f"validation_batches names a set {name!r}: a set's name must be a non-empty "
                'identifier (e.g. "val" or "train_eval")',
                phase="configure",
            )
        for value in ("loss", *metrics):
            key = f"{name}_{value}"
            if key in reported:
                raise ConfigError(
                    f"validation_batches set {name!r} reports its {value} as "
                    f"'validation_{key}', which is also {reported[key]}: rename the set",
                    phase="configure",
                )
            reported[key] = f"set {name!r}'s {value}"
    return names


@attrs.frozen(kw_only=True)
class ModelWithData:
    """One rank's model and its batch sources (an entry of lamp's
    ``models_with_data_streams``): the training batches, and the validation batches when the
    run validates (every rank, or none). A source takes no argument, or one: the pass's
    :class:`~lampdist.PassContext` (see :class:`~lampdist.PassAwareBatchSource`).

    ``validation_batches`` is one source, or several validation sets as a mapping of names
    to sources (``{"val": val_source, "train": train_eval_source}``): every rank validates
    every set each validation epoch, in the mapping's order, and each set's loss and metrics
    are reported under its name (``validation_<set>_loss``, ``validation_<set>_<metric>``;
    see :class:`~lampdist.LoopOptions`'s ``validation_set`` for the set that drives the
    loop's rules). Every rank must name the same sets in the same order.

    Raises :class:`~lampdist.ConfigError` for a source that is not callable or needs more
    than one argument, and for a set's name that is not an identifier or whose reported
    names clash with another set's or a metric's.
    """

    model: SupervisedModel | LossModel
    train_batches: BatchSource | PassAwareBatchSource
    validation_batches: Source | Mapping[str, Source] | None = attrs.field(
        default=None, converter=_sets
    )

    def __attrs_post_init__(self) -> None:
        check_source(self.train_batches, "train_batches")
        sets = self.validation_batches
        if isinstance(sets, Mapping):
            validation_set_names(sets, getattr(self.model, "metrics", {}))
            for name, source in sets.items():
                check_source(source, f"validation_batches[{name!r}]")
        elif sets is not None:
            check_source(sets, "validation_batches")

    @property
    def validation_sets(self) -> tuple[str, ...]:
        """The names of the validation sets, in order (empty for one source or none)."""
        sets = self.validation_batches
        return tuple(sets) if isinstance(sets, Mapping) else ()

    def validation_source(self, name: str | None) -> Source:
        """The validation set ``name``'s source (``None``: the one source). Raises
        :class:`ConfigError` for a name this rank does not have."""
        sets = self.validation_batches
        if isinstance(sets, Mapping) and name is not None and name in sets:
            return sets[name]
        if name is None and sets is not None and not isinstance(sets, Mapping):
            return sets
        raise ConfigError(
            f"no validation set {name!r} here (this rank's: "
            f"{list(self.validation_sets) or 'one unnamed source' if sets else 'none'}); "
            "give every rank the same validation_batches",
            phase="valid",
        )
