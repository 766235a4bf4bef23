"""The entry points: the root's driver, the follower, the single-process loop, and
:func:`train`, which runs the right one for this process's rank."""

from .._effects import OptimizerFactory as OptimizerFactory
from .._errors import Interrupted as Interrupted
from ._evaluate import Evaluation as Evaluation
from ._evaluate import evaluate as evaluate
from ._evaluate import evaluate_locally as evaluate_locally
from ._follower import follow_distributed_training as follow_distributed_training
from ._local import local_data_parallel_training_loop as local_data_parallel_training_loop
from ._root import drive_distributed_training as drive_distributed_training
from ._train import handling_signals as handling_signals
from ._train import run_until_signal as run_until_signal
from ._train import train as train

__all__ = [
    "Evaluation",
    "Interrupted",
    "OptimizerFactory",
    "drive_distributed_training",
    "evaluate",
    "evaluate_locally",
    "follow_distributed_training",
    "handling_signals",
    "local_data_parallel_training_loop",
    "run_until_signal",
    "train",
]
