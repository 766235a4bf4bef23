"""The epoch loop: loop state, learning curve and the effect-parameterised epoch driver.

Nothing here touches torch.distributed: the driver composes effects it is given.
"""

from ._driver import check_epochs_arguments as check_epochs_arguments
from ._driver import epochs as epochs
from ._state import CurvePoint as CurvePoint
from ._state import LoopState as LoopState
from ._state import TrainingState as TrainingState

__all__ = [
    "CurvePoint",
    "LoopState",
    "TrainingState",
    "check_epochs_arguments",
    "epochs",
]
