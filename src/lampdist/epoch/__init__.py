"""One pass on the clique: batches, flat parameter buffers, training steps and validation."""

from ._batches import BatchReader as BatchReader
from ._batches import LoadedBatch as LoadedBatch
from ._batches import open_batches as open_batches
from ._flat import FlatModel as FlatModel
from ._model import SupervisedModel as SupervisedModel
from ._model import count_examples as count_examples
from ._pass import OnPassEvent as OnPassEvent
from ._pass import PassEvent as PassEvent
from ._pass import PassResult as PassResult
from ._pass import RankRunner as RankRunner
from ._pass import TrainingOptions as TrainingOptions

__all__ = [
    "BatchReader",
    "FlatModel",
    "LoadedBatch",
    "OnPassEvent",
    "PassEvent",
    "PassResult",
    "RankRunner",
    "SupervisedModel",
    "TrainingOptions",
    "count_examples",
    "open_batches",
]
