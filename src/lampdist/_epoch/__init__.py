"""One pass on the clique: batches, flat parameter buffers, training steps and validation.

The pass runner (:class:`PassRunner`, on the event loop) starts each pass on the rank's
compute thread (:class:`ComputeThread`), where the step kernel (:class:`StepKernel`) runs it
as a plain loop over the batches that the loading thread puts into a :class:`BatchFeed`, each
training step by the rank's stepping design (:class:`Design`, see ``_designs``).
"""

from ._compute import ComputeThread as ComputeThread
from ._compute import open_compute_thread as open_compute_thread
from ._designs import DESIGNS as DESIGNS
from ._designs import IN_MEMORY as IN_MEMORY
from ._designs import Design as Design
from ._designs import create_design as create_design
from ._designs import replica_holder as replica_holder
from ._device import host_to_device as host_to_device
from ._feed import BatchFeed as BatchFeed
from ._feed import LoadedBatch as LoadedBatch
from ._feed import PassStopped as PassStopped
from ._feed import open_feed as open_feed
from ._flat import FlatParameters as FlatParameters
from ._flat import flat_order as flat_order
from ._kernel import StepKernel as StepKernel
from ._pass import PassRunner as PassRunner
from ._progress import Progress as Progress
from ._rank_state import RankState as RankState
from ._result import CheckpointParts as CheckpointParts
from ._result import PassResult as PassResult
from ._segments import segments as segments
from ._stepper import Stepper as Stepper

__all__ = [
    "DESIGNS",
    "IN_MEMORY",
    "BatchFeed",
    "CheckpointParts",
    "ComputeThread",
    "Design",
    "FlatParameters",
    "LoadedBatch",
    "PassResult",
    "PassRunner",
    "PassStopped",
    "Progress",
    "RankState",
    "StepKernel",
    "Stepper",
    "create_design",
    "flat_order",
    "host_to_device",
    "open_compute_thread",
    "open_feed",
    "replica_holder",
    "segments",
]
