"""The entry points: the root's driver, the follower, and the single-process loop."""

from ._common import OptimizerFactory as OptimizerFactory
from ._follower import follow_distributed_training as follow_distributed_training
from ._local import local_data_parallel_training_loop as local_data_parallel_training_loop
from ._root import drive_distributed_training as drive_distributed_training

__all__ = [
    "OptimizerFactory",
    "drive_distributed_training",
    "follow_distributed_training",
    "local_data_parallel_training_loop",
]
