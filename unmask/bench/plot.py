"""Speedup-vs-accuracy scatter of a bench run (matplotlib, Agg: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_speedup_accuracy(results: Sequence[dict[str, Any]], out: str | Path, title: str,
                          metric_label: str = "accuracy") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    pts = [(r["speedup"], r["accuracy"], r["decoder"]) for r in results if r["speedup"]]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    try:
        for i, (x, y, label) in enumerate(pts):
            ax.scatter([x], [100 * y], s=50, zorder=3, color=f"C{i % 10}")
            # Alternate label offsets so neighbouring points' labels do not sit on each other.
            dy = 8 if i % 2 == 0 else -14
            ax.annotate(label, (x, 100 * y), textcoords="offset points", xytext=(6, dy),
                        fontsize=8, color=f"C{i % 10}")
        ax.set_xscale("log")
        # "0.5x" reads better than matplotlib's default "5 x 10^-1" on a log axis.
        times = FuncFormatter(lambda v, _: f"{v:g}x")
        ax.xaxis.set_major_formatter(times)
        ax.xaxis.set_minor_formatter(times)
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.axvline(1.0, color="grey", lw=0.8, ls="--", zorder=1)
        if pts:
            xs = [p[0] for p in pts]
            ax.set_xlim(min(xs + [1.0]) / 1.5, max(xs + [1.0]) * 2.0)
        ax.set_ylim(-5, 105)
        ax.set_xlabel("speedup over baseline (TPS ratio, log scale)")
        ax.set_ylabel(f"{metric_label} (%)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out
