"""Optional packages: imported when a tracker opens, never when lampdist is imported."""

from __future__ import annotations

import importlib
from types import ModuleType

from .._errors import ConfigError

__all__ = ["require"]


def require(module: str, *, package: str, extra: str, tracker: str) -> ModuleType:
    """Import ``module`` (the sink's package is ``package``), or raise
    :class:`~lampdist.ConfigError` saying which extra to install.

    ``package`` is imported first, so that a missing package is reported as such even when
    ``module`` (torch's TensorBoard writer, say) was imported before.
    """
    try:
        importlib.import_module(package)
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f'{tracker} needs the {package} package ({exc}): pip install "lampdist[{extra}]"',
            phase="configure",
        ) from exc
