"""What the root refuses before it opens its rank: a loop that the chosen stepping design cannot
carry out (:func:`check_design_loop`), and snapshots within a pass where a pass has no place to
go back to (:func:`check_segments`)."""

from __future__ import annotations

from .._checkpoint import Storage
from .._epoch import DESIGNS
from .._errors import ConfigError
from .._options import LoopOptions, StepOptions

__all__ = ["check_design_loop", "check_segments"]


def check_design_loop(step: StepOptions, loop: LoopOptions, storage: Storage | None) -> None:
    """Raise :class:`ConfigError` for what the design of ``step.step_on`` does not do: a
    design whose ranks write their own shards (fsdp) needs a storage that holds them
    (:func:`lampdist.checkpoint.to_directory` or ``to_url``), and one whose root does not
    hold the whole model keeps no best model."""
    design = DESIGNS[step.step_on]
    for unsupported, name, instead in (
        (
            design.loads_checkpoints and storage is not None and not storage.holds_shards,
            "checkpoint_state other than checkpoint.to_directory(...) or to_url(...)",
            "checkpoint_state=checkpoint.to_directory(path)",
        ),
        (
            not design.keeps_best_model and bool(loop.return_min_validation_loss_model),
            "return_min_validation_loss_model",
            "return_min_validation_loss_model=()",
        ),
    ):
        if unsupported:
            raise ConfigError(
                f"step_on={step.step_on!r} does not support {name} (every rank holds shards "
                f"of the model): pass {instead}",
                rank=0,
                phase="configure",
            )


def check_segments(step: StepOptions, loop: LoopOptions) -> None:
    """Raise :class:`ConfigError` for ``Recovery.snapshot_every_steps`` without windows: a
    pass over the whole data has no place in it that a rank can go back to."""
    every = None if loop.recovery is None else loop.recovery.snapshot_every_steps
    if every is not None and step.steps_per_epoch is None:
        raise ConfigError(
            f"Recovery.snapshot_every_steps={every!r} needs StepOptions.steps_per_epoch (a "
            "snapshot within a pass goes back to a place in the training stream): pass "
            "steps_per_epoch=N, or snapshot_every_steps=None",
            rank=0,
            phase="configure",
        )
