"""This process's rank as the launcher's variables give it, for what acts on the root only and
is opened before any entry point runs (the trackers)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ._errors import ConfigError

__all__ = ["launched_rank"]


def launched_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank by the rule of :func:`lampdist.launch.from_env`: torchrun's
    ``RANK`` when it or ``WORLD_SIZE`` is set, else SLURM's ``SLURM_PROCID``; 0 (the root of
    a run of its own) for a process no launcher started. ``environ`` is by default this
    process's environment, read when called.

    Raises :class:`~lampdist.ConfigError` for a rank variable that is not an integer.
    """
    if environ is None:
        environ = os.environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        name = "RANK"
    elif "SLURM_PROCID" in environ:
        name = "SLURM_PROCID"
    else:
        return 0
    text = environ.get(name, "0")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"{name} must be an integer, got {text!r}: the launcher sets it", phase="configure"
        ) from None
