"""The demo's closing summary."""

from __future__ import annotations

from rich.console import Console

from .._words import counted
from ._demo import CHECKPOINTS, CURVE, METRICS, MODEL, DemoResult

__all__ = ["print_summary", "summary_lines"]


def summary_lines(result: DemoResult) -> list[str]:
    """The summary as plain lines: accuracy, best epoch, time, and where the files are."""
    state = result.state
    trained = state.epoch - result.first_epoch
    if trained == 0:
        done = f"no epoch left to train (the run has {state.epoch}; raise --epochs to go on)"
    else:
        done = f"{counted(trained, 'epoch')} ({result.first_epoch + 1}-{state.epoch})"
    lines = [
        f"{done} on {counted(result.nranks, 'rank')} ({result.device}) in {result.seconds:.1f} s",
        f"validation accuracy {result.accuracy:.1%}",
    ]
    if state.min_validation_epoch is not None and state.min_validation_loss is not None:
        lines.append(  # the demo chooses its best model by validation accuracy
            f"best epoch {state.min_validation_epoch + 1} "
            f"(validation accuracy {state.min_validation_loss:.1%}); the model ends there"
        )
    out = result.out
    checkpoints = sorted(p.name for p in (out / CHECKPOINTS).glob("epoch-*"))
    lines += [
        f"files in {out}:",
        f"  {CHECKPOINTS}/  {', '.join(checkpoints) or 'none'}  (--resume continues from it)",
        f"  {METRICS}  one JSON line per pass (loss, metrics, speed)",
        f"  {CURVE}  loss and accuracy per epoch",
        f"  {MODEL}  the model's state dict",
    ]
    if result.tensorboard is not None:
        lines.append(f"TensorBoard: tensorboard --logdir {result.tensorboard}")
    return lines


def print_summary(console: Console, result: DemoResult) -> None:
    """Print :func:`summary_lines` to ``console``, the headline in bold."""
    lines = summary_lines(result)
    console.print(f"[bold]{lines[1]}[/bold]", highlight=False, soft_wrap=True)
    for line in [lines[0], *lines[2:]]:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
