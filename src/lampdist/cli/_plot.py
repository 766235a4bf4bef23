"""The learning-curve picture of a run, drawn with matplotlib's Agg backend (no display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .._state import CurvePoint

__all__ = ["plot_learning_curve"]


def plot_learning_curve(path: Path, curve: Sequence[CurvePoint]) -> None:
    """Draw the training and validation loss of ``curve`` and its validation accuracy per
    epoch (numbered from 1) into the PNG file ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 3.5), layout="constrained")
    losses, accuracies = figure.subplots(1, 2)
    epochs = [p.epoch + 1 for p in curve]
    losses.plot(epochs, [p.training_loss for p in curve], marker="o", label="training")
    validated = [p for p in curve if p.validation_loss is not None]
    losses.plot(
        [p.epoch + 1 for p in validated],
        [p.validation_loss for p in validated],
        marker="o",
        label="validation",
    )
    losses.set(xlabel="epoch", ylabel="cross-entropy loss", yscale="log", title="loss")
    losses.legend()
    points = [
        (p.epoch + 1, accuracy)
        for p in curve
        if isinstance(accuracy := p.metrics.get("validation_accuracy"), float)
    ]
    accuracies.plot([e for e, _ in points], [a * 100 for _, a in points], marker="o")
    accuracies.set(xlabel="epoch", ylabel="%", title="validation accuracy")
    for axes in (losses, accuracies):
        axes.grid(alpha=0.3)
    figure.savefig(path, dpi=100)
