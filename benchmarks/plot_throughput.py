"""Draw the scaling efficiency of ``throughput.py`` reports as one SVG bar chart.

    python benchmarks/plot_throughput.py results/gpt.json results/mlp.json -o throughput.svg

One panel per report (one model on one machine), one bar per multi-rank configuration: its
samples/s over the ranks times the single-device loop's samples/s of the same run, with the
ratio to DDP beside it. Plain SVG, written without plotting libraries, so that the docs build
needs nothing more.
"""

from __future__ import annotations

import argparse
import json
from html import escape
from pathlib import Path
from typing import Any

__all__ = ["render"]

WIDTH = 720
BAR_HEIGHT = 22
GAP = 8
LEFT = 170  # room for the configuration names
RIGHT = 150  # room for the value labels
PANEL_TITLE = 34
COLOURS = {"ddp": "#7f7f7f", "lampdist": "#1f77b4"}


def _bars(report: dict[str, Any]) -> list[tuple[str, float, float | None, str]]:
    """(name, efficiency, vs DDP, kind) of every configuration that has an efficiency."""
    bars = []
    for name, entry in report["configs"].items():
        efficiency = entry.get("scaling_efficiency")
        if efficiency is not None:
            bars.append((name, float(efficiency), entry.get("vs_ddp"), entry.get("kind", "")))
    return bars


def render(reports: list[dict[str, Any]]) -> str:
    """The SVG text for ``reports`` (each a parsed ``throughput.py --json`` file).

    Raises ValueError when a report has no single-device loop to compare with."""
    panels = []
    for report in reports:
        bars = _bars(report)
        if not bars:
            raise ValueError(
                f"report for {report['meta']['model']} has no scaling efficiency: run it with "
                "the 'single' configuration"
            )
        panels.append((report["meta"], bars))
    scale_max = max(1.0, *(bar[1] for _, bars in panels for bar in bars))
    plot_width = WIDTH - LEFT - RIGHT
    height = sum(PANEL_TITLE + len(bars) * (BAR_HEIGHT + GAP) + GAP for _, bars in panels) + 24
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="13">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
    ]
    y = 0
    for meta, bars in panels:
        title = (
            f"{meta['model']}: {meta['nranks']} x {meta['device']} ({meta['backend']}), "
            f"batch {meta['batch_size_per_rank']} per rank, torch {meta['torch']}"
        )
        out.append(f'<text x="8" y="{y + 22}" font-weight="bold">{escape(title)}</text>')
        y += PANEL_TITLE
        top = y
        for name, efficiency, vs_ddp, kind in bars:
            width = plot_width * efficiency / scale_max
            colour = COLOURS.get(kind, "#ff7f0e")
            label = f"{100 * efficiency:.1f}%"
            if vs_ddp is not None:
                label += f"  ({vs_ddp:.2f}x DDP)"
            out += [
                f'<text x="{LEFT - 8}" y="{y + 16}" text-anchor="end">{escape(name)}</text>',
                f'<rect x="{LEFT}" y="{y}" width="{width:.1f}" height="{BAR_HEIGHT}" '
                f'fill="{colour}"/>',
                f'<text x="{LEFT + width + 6:.1f}" y="{y + 16}">{escape(label)}</text>',
            ]
            y += BAR_HEIGHT + GAP
        ideal = LEFT + plot_width / scale_max
        out.append(
            f'<line x1="{ideal:.1f}" y1="{top - 4}" x2="{ideal:.1f}" y2="{y - GAP + 4}" '
            'stroke="black" stroke-dasharray="4 3"/>'
        )
        y += GAP
    out.append(
        f'<text x="{LEFT}" y="{height - 8}" fill="#444">scaling efficiency: samples/s over '
        "ranks x the single-device loop (dashed: 100%)</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Read the reports named on the command line and write the chart."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("reports", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    reports = [json.loads(path.read_text()) for path in args.reports]
    args.output.write_text(render(reports))


if __name__ == "__main__":
    main()
