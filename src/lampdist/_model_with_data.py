"""One rank's model and its batch sources: :class:`ModelWithData`."""

from __future__ import annotations

import attrs

from ._effects import BatchSource, PassAwareBatchSource
from ._loss_model import LossModel
from ._model import SupervisedModel
from ._source import check_source

__all__ = ["ModelWithData"]


@attrs.frozen(kw_only=True)
class ModelWithData:
    """One rank's model and its batch sources (an entry of lamp's
    ``models_with_data_streams``): the training batches, and the validation batches when the
    run validates (every rank, or none). A source takes no argument, or one: the pass's
    :class:`~lampdist.PassContext` (see :class:`~lampdist.PassAwareBatchSource`).

    Raises :class:`~lampdist.ConfigError` for a source that is not callable or needs more
    than one argument.
    """

    model: SupervisedModel | LossModel
    train_batches: BatchSource | PassAwareBatchSource
    validation_batches: BatchSource | PassAwareBatchSource | None = None

    def __attrs_post_init__(self) -> None:
        check_source(self.train_batches, "train_batches")
        if self.validation_batches is not None:
            check_source(self.validation_batches, "validation_batches")
