"""lampdist: data-parallel PyTorch training driven from async Python.

A root rank drives the epochs and steps the optimizer; follower ranks follow commands from a
control channel; tensors move through a collective-communication clique.
"""

# Every public name is imported on its first use (PEP 562's module __getattr__), so that
# ``import lampdist`` imports a name's module only when the name is used, and ``lampdist
# --help`` imports no torch. Type checkers and IDEs read the imports under TYPE_CHECKING;
# tests/test_package_root.py keeps them, _FROM and __all__ to the same names.

import importlib
from typing import TYPE_CHECKING

from ._version import __version__ as __version__

if TYPE_CHECKING:
    from . import checkpoint as checkpoint
    from . import control as control
    from . import launch as launch
    from . import schedules as schedules
    from . import trackers as trackers
    from ._effects import BatchSource as BatchSource
    from ._effects import CheckpointLoopState as CheckpointLoopState
    from ._effects import CheckpointState as CheckpointState
    from ._effects import OnPassEvent as OnPassEvent
    from ._effects import OptimizerFactory as OptimizerFactory
    from ._effects import PassAwareBatchSource as PassAwareBatchSource
    from ._effects import SaveBestModel as SaveBestModel
    from ._effects import TrainEpoch as TrainEpoch
    from ._effects import ValidationEpoch as ValidationEpoch
    from ._errors import AuthenticationError as AuthenticationError
    from ._errors import BadBatch as BadBatch
    from ._errors import CheckpointError as CheckpointError
    from ._errors import CheckpointVersionError as CheckpointVersionError
    from ._errors import CliqueError as CliqueError
    from ._errors import CliqueTimeout as CliqueTimeout
    from ._errors import CollectiveFailed as CollectiveFailed
    from ._errors import ConfigError as ConfigError
    from ._errors import ControlError as ControlError
    from ._errors import Interrupted as Interrupted
    from ._errors import JoinRejected as JoinRejected
    from ._errors import JoinTimeout as JoinTimeout
    from ._errors import LampdistError as LampdistError
    from ._errors import LampdistTimeout as LampdistTimeout
    from ._errors import MismatchError as MismatchError
    from ._errors import NonFiniteLoss as NonFiniteLoss
    from ._errors import PeerDisconnected as PeerDisconnected
    from ._errors import PeerUnresponsive as PeerUnresponsive
    from ._errors import ProtocolError as ProtocolError
    from ._errors import RankFailed as RankFailed
    from ._errors import TrainingError as TrainingError
    from ._fsdp_options import FsdpPolicy as FsdpPolicy
    from ._fsdp_options import Precision as Precision
    from ._loop import epochs as epochs
    from ._loss_model import LossModel as LossModel
    from ._metric import Metric as Metric
    from ._model import SupervisedModel as SupervisedModel
    from ._monitor import EarlyStopping as EarlyStopping
    from ._monitor import Monitor as Monitor
    from ._options import LoopOptions as LoopOptions
    from ._options import ModelWithData as ModelWithData
    from ._options import Recovery as Recovery
    from ._options import StepOptions as StepOptions
    from ._options import Timeouts as Timeouts
    from ._random_batches import RandomBatches as RandomBatches
    from ._roles import Evaluation as Evaluation
    from ._roles import drive_distributed_training as drive_distributed_training
    from ._roles import evaluate as evaluate
    from ._roles import evaluate_locally as evaluate_locally
    from ._roles import follow_distributed_training as follow_distributed_training
    from ._roles import local_data_parallel_training_loop as local_data_parallel_training_loop
    from ._roles import run_until_signal as run_until_signal
    from ._roles import train as train
    from ._source import PassContext as PassContext
    from ._state import CurvePoint as CurvePoint
    from ._state import EarlyStoppingState as EarlyStoppingState
    from ._state import LoopState as LoopState
    from ._state import PassEvent as PassEvent
    from ._state import Recovered as Recovered
    from ._state import StepSplit as StepSplit
    from ._state import TrainingState as TrainingState
    from ._weights_import import StoredWeights as StoredWeights
    from ._weights_import import from_safetensors as from_safetensors
    from .checkpoint import Resumed as Resumed
    from .clique import Clique as Clique
    from .clique import open_clique as open_clique

_SUBMODULES = ("checkpoint", "control", "launch", "schedules", "trackers")
_FROM: dict[str, tuple[str, ...]] = {
    "._effects": (
        "BatchSource",
        "CheckpointLoopState",
        "CheckpointState",
        "OnPassEvent",
        "OptimizerFactory",
        "PassAwareBatchSource",
        "SaveBestModel",
        "TrainEpoch",
        "ValidationEpoch",
    ),
    "._errors": (
        "AuthenticationError",
        "BadBatch",
        "CheckpointError",
        "CheckpointVersionError",
        "CliqueError",
        "CliqueTimeout",
        "CollectiveFailed",
        "ConfigError",
        "ControlError",
        "Interrupted",
        "JoinRejected",
        "JoinTimeout",
        "LampdistError",
        "LampdistTimeout",
        "MismatchError",
        "NonFiniteLoss",
        "PeerDisconnected",
        "PeerUnresponsive",
        "ProtocolError",
        "RankFailed",
        "TrainingError",
    ),
    "._fsdp_options": ("FsdpPolicy", "Precision"),
    "._loop": ("epochs",),
    "._loss_model": ("LossModel",),
    "._metric": ("Metric",),
    "._model": ("SupervisedModel",),
    "._monitor": ("EarlyStopping", "Monitor"),
    "._options": ("LoopOptions", "ModelWithData", "Recovery", "StepOptions", "Timeouts"),
    "._roles": (
        "Evaluation",
        "drive_distributed_training",
        "evaluate",
        "evaluate_locally",
        "follow_distributed_training",
        "local_data_parallel_training_loop",
        "run_until_signal",
        "train",
    ),
    "._random_batches": ("RandomBatches",),
    "._source": ("PassContext",),
    "._state": (
        "CurvePoint",
        "EarlyStoppingState",
        "LoopState",
        "PassEvent",
        "Recovered",
        "StepSplit",
        "TrainingState",
    ),
    "._weights_import": ("StoredWeights", "from_safetensors"),
    ".checkpoint": ("Resumed",),
    ".clique": ("Clique", "open_clique"),
}
_WHERE = {name: module for module, names in _FROM.items() for name in names} | {
    name: f".{name}" for name in _SUBMODULES
}
"""Each public name's module, relative to this package (a public submodule maps to itself)."""


def _resolve(name: str) -> object:
    """Import the public name ``name`` on its first use and keep it in the package."""
    try:
        where = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module = importlib.import_module(where, __name__)
    value = module if where == f".{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names (resolved or not) and the package's own underscored ones."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("_"))})


if not TYPE_CHECKING:  # type checkers see the imports above, and no name they do not know
    __getattr__ = _resolve


__all__ = [
    "AuthenticationError",
    "BadBatch",
    "BatchSource",
    "CheckpointError",
    "CheckpointLoopState",
    "CheckpointState",
    "CheckpointVersionError",
    "Clique",
    "CliqueError",
    "CliqueTimeout",
    "CollectiveFailed",
    "ConfigError",
    "ControlError",
    "CurvePoint",
    "EarlyStopping",
    "EarlyStoppingState",
    "Evaluation",
    "FsdpPolicy",
    "Interrupted",
    "JoinRejected",
    "JoinTimeout",
    "LampdistError",
    "LampdistTimeout",
    "LoopOptions",
    "LoopState",
    "LossModel",
    "Metric",
    "MismatchError",
    "ModelWithData",
    "Monitor",
    "NonFiniteLoss",
    "OnPassEvent",
    "OptimizerFactory",
    "PassAwareBatchSource",
    "PassContext",
    "PassEvent",
    "PeerDisconnected",
    "PeerUnresponsive",
    "Precision",
    "ProtocolError",
    "RandomBatches",
    "RankFailed",
    "Recovered",
    "Recovery",
    "Resumed",
    "SaveBestModel",
    "StepOptions",
    "StepSplit",
    "StoredWeights",
    "SupervisedModel",
    "Timeouts",
    "TrainEpoch",
    "TrainingError",
    "TrainingState",
    "ValidationEpoch",
    "checkpoint",
    "control",
    "drive_distributed_training",
    "epochs",
    "evaluate",
    "evaluate_locally",
    "follow_distributed_training",
    "from_safetensors",
    "launch",
    "local_data_parallel_training_loop",
    "open_clique",
    "run_until_signal",
    "schedules",
    "trackers",
    "train",
]
