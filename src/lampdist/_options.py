"""What the entry points take: option objects that travel together.

Every entry point takes the same objects, so a setting declared once reaches every role:

- :class:`StepOptions`: how every rank steps (what all ranks must agree on; checked at join);
- :class:`LoopOptions`: the root's epoch loop (lamp's names: ``max_epochs``,
  ``validation_frequency``, the schedule, smoothing, the best-model epochs, the checkpoint
  effect), what the best model and early stopping watch, and its progress effect;
- :class:`Timeouts`: the deadlines of joining, clique setup, each collective and a stop;
- :class:`ModelWithData`: one rank's model and batch sources.

The rest of the package imports them from here; each is defined in a module of its own
(``_step_options``, ``_loop_options``, ``_timeouts``, ``_model_with_data``), on the
validators of ``_option_checks``.
"""

from __future__ import annotations

from ._loop_options import LoopOptions, Recovery, check_monitors
from ._model_with_data import ModelWithData
from ._step_options import StepOn, StepOptions
from ._timeouts import Timeouts

__all__ = [
    "LoopOptions",
    "ModelWithData",
    "Recovery",
    "StepOn",
    "StepOptions",
    "Timeouts",
    "check_monitors",
]
