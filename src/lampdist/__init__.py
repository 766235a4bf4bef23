"""lampdist: data-parallel PyTorch training driven from async Python.

A root rank drives the epochs and steps the optimizer; follower ranks follow commands from a
control channel; tensors move through a collective-communication clique.
"""

from . import control as control
from . import schedules as schedules
from ._errors import AuthenticationError as AuthenticationError
from ._errors import BadBatch as BadBatch
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointVersionError as CheckpointVersionError
from ._errors import CliqueError as CliqueError
from ._errors import CliqueTimeout as CliqueTimeout
from ._errors import CollectiveFailed as CollectiveFailed
from ._errors import ConfigError as ConfigError
from ._errors import ControlError as ControlError
from ._errors import JoinRejected as JoinRejected
from ._errors import JoinTimeout as JoinTimeout
from ._errors import LampdistError as LampdistError
from ._errors import LampdistTimeout as LampdistTimeout
from ._errors import MismatchError as MismatchError
from ._errors import NonFiniteLoss as NonFiniteLoss
from ._errors import PeerDisconnected as PeerDisconnected
from ._errors import ProtocolError as ProtocolError
from ._errors import RankFailed as RankFailed
from ._errors import TrainingError as TrainingError
from .loop import CurvePoint as CurvePoint
from .loop import LoopState as LoopState
from .loop import TrainingState as TrainingState
from .loop import epochs as epochs

__version__ = "0.1.0.dev0"

__all__ = [
    "AuthenticationError",
    "BadBatch",
    "CheckpointError",
    "CheckpointVersionError",
    "CliqueError",
    "CliqueTimeout",
    "CollectiveFailed",
    "ConfigError",
    "ControlError",
    "CurvePoint",
    "JoinRejected",
    "JoinTimeout",
    "LampdistError",
    "LampdistTimeout",
    "LoopState",
    "MismatchError",
    "NonFiniteLoss",
    "PeerDisconnected",
    "ProtocolError",
    "RankFailed",
    "TrainingError",
    "TrainingState",
    "control",
    "epochs",
    "schedules",
]
