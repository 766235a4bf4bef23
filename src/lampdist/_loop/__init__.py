"""The epoch loop: the effect-parameterised epoch driver (its values live in ``_state``).

Nothing here touches torch.distributed: the driver composes effects it is given.
"""

from ._driver import EpochEffects as EpochEffects
from ._driver import EpochRules as EpochRules
from ._driver import check_max_epochs as check_max_epochs
from ._driver import check_smoothing as check_smoothing
from ._driver import check_validation_frequency as check_validation_frequency
from ._driver import epochs as epochs
from ._driver import run_epochs as run_epochs
from ._sets import merge_sets as merge_sets

__all__ = [
    "EpochEffects",
    "EpochRules",
    "check_max_epochs",
    "check_smoothing",
    "check_validation_frequency",
    "epochs",
    "merge_sets",
    "run_epochs",
]
