"""One pass on the clique: batches, flat parameter buffers, training steps and validation."""

from ._batches import BatchReader as BatchReader
from ._batches import LoadedBatch as LoadedBatch
from ._batches import open_batches as open_batches
from ._device import host_to_device as host_to_device
from ._flat import FlatModel as FlatModel
from ._model import SupervisedModel as SupervisedModel
from ._model import count_examples as count_examples
from ._options import OnPassEvent as OnPassEvent
from ._options import PassEvent as PassEvent
from ._options import PassResult as PassResult
from ._options import StepOn as StepOn
from ._options import TrainingOptions as TrainingOptions
from ._pass import RankRunner as RankRunner
from ._stepper import LossScale as LossScale
from ._stepper import Stepper as Stepper

__all__ = [
    "BatchReader",
    "FlatModel",
    "LoadedBatch",
    "LossScale",
    "OnPassEvent",
    "PassEvent",
    "PassResult",
    "RankRunner",
    "StepOn",
    "Stepper",
    "SupervisedModel",
    "TrainingOptions",
    "count_examples",
    "host_to_device",
    "open_batches",
]
