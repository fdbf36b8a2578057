"""Speedup-vs-accuracy scatter of a bench run (matplotlib, Agg: no display needed).

A bench often has a dozen decoders at nearly the same accuracy and speedup, and full decoder specs
written next to the points would overprint each other. So each point carries a short number,
nudged upward until it clears the numbers already placed, and a legend maps numbers to specs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKERS = "os^Dvp*Xh<>"


def plot_formats() -> list[str]:
    """File extensions matplotlib can write (a name without one is written as PNG)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def plot_path(path: str | Path) -> str:
    """The file a plot to ``path`` is written to: matplotlib appends its default format's
    extension to a name without one (``out`` is written as ``out.png``), so output checks and the
    writers both go by this name, not the one typed (the same-file check missed ``--plot out
    --json out.png``, and the JSON was overwritten). As matplotlib's print_figure decides it."""
    import matplotlib

    text = os.fspath(path)
    if os.path.splitext(text)[1][1:]:
        return text
    return text.rstrip(".") + "." + matplotlib.rcParams["savefig.format"]


def plot_speedup_accuracy(results: Sequence[dict[str, Any]], out: str | Path, title: str,
                          metric_label: str = "accuracy") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    # Decoders with no defined speedup (baseline never produced a useful token) cannot be drawn.
    pts = [(i + 1, r["speedup"], 100 * r["accuracy"], r["decoder"])
           for i, r in enumerate(results) if r["speedup"]]
    fig, ax = plt.subplots(figsize=(10, 6), dpi=120)
    try:
        for num, x, y, label in pts:
            ax.scatter([x], [y], s=45, zorder=3, color=f"C{(num - 1) % 10}",
                       marker=MARKERS[(num - 1) % len(MARKERS)], label=f"{num}  {label}")
        ax.set_xscale("log")
        # "0.5x" reads better than matplotlib's default "5 x 10^-1" on a log axis.
        times = FuncFormatter(lambda v, _: f"{v:g}x")
        ax.xaxis.set_major_formatter(times)
        ax.xaxis.set_minor_formatter(times)
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.axvline(1.0, color="grey", lw=0.8, ls="--", zorder=1)
        xs = [p[1] for p in pts] + [1.0]
        ax.set_xlim(min(xs) / 1.3, max(xs) * 1.3)
        ax.set_ylim(-5, 105)
        ax.set_xlabel("speedup over the baseline (median per-prompt TPS ratio, log scale)")
        ax.set_ylabel(f"{metric_label} (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if pts:
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
                      borderaxespad=0)
        fig.tight_layout()
        _thin_minor_labels(ax, times)
        _place_numbers(ax, pts)
        out = Path(plot_path(out))
        fig.savefig(out, bbox_inches="tight")
    finally:
        plt.close(fig)
    return out


def _thin_minor_labels(ax: Any, label: Any) -> None:
    """Label a minor tick of the log axis only where its label clears the major ones and the
    minor ones already kept, left to right: over two decades "0.7x 0.8x 0.9x" ran together."""
    from matplotlib.ticker import FuncFormatter

    renderer = ax.figure.canvas.get_renderer()
    ax.figure.draw(renderer)  # lays the ticks out, labels and all, at their final positions
    xmin, xmax = sorted(ax.get_xlim())
    kept = [t.label1.get_window_extent(renderer).expanded(1.15, 1.0)
            for t in ax.xaxis.get_major_ticks() if xmin <= t.get_loc() <= xmax]
    shown = set()
    for tick in sorted(ax.xaxis.get_minor_ticks(), key=lambda t: t.get_loc()):
        box = tick.label1.get_window_extent(renderer).expanded(1.15, 1.0)
        if xmin <= tick.get_loc() <= xmax and not any(box.overlaps(b) for b in kept):
            kept.append(box)
            shown.add(tick.get_loc())
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, i: label(v, i) if v in shown else ""))


def _place_numbers(ax: Any, pts: Sequence[tuple[int, float, float, str]]) -> None:
    """Write each point's number just above-right of it, moving up in steps of one text line
    while it would overlap a number already written (boxes in display pixels)."""
    placed: list[tuple[float, float, float, float]] = []
    line_px, char_px, gap = 11.0, 7.5, 4.0
    for num, x, y, _ in sorted(pts, key=lambda p: (p[2], p[1])):
        px, py = ax.transData.transform((x, y))
        w = char_px * len(str(num))
        dy = 4.0
        while any(px + 4 - gap < bx1 and bx0 < px + 4 + w + gap and py + dy < by1
                  and by0 < py + dy + line_px for bx0, by0, bx1, by1 in placed):
            dy += line_px
        placed.append((px + 4, py + dy, px + 4 + w, py + dy + line_px))
        ax.annotate(str(num), (x, y), textcoords="offset pixels", xytext=(4, dy), fontsize=7,
                    color=f"C{(num - 1) % 10}", va="bottom")
