"""The epoch loop: the effect-parameterised epoch driver (its values live in ``_state``).

Nothing here touches torch.distributed: the driver composes effects it is given.
"""

from ._driver import check_epochs_arguments as check_epochs_arguments
from ._driver import epochs as epochs

__all__ = ["check_epochs_arguments", "epochs"]
