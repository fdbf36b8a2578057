"""Markdown tables with aligned columns, shared by the bench's reports (unmask/bench/report.py)
and its per-bucket tables (unmask/bench/strata.py)."""

from __future__ import annotations

from collections.abc import Sequence


def aligned_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: set[int]) -> str:
    """Columns padded to their widest cell; ``left`` columns left-aligned, the rest right."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i in left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    rule = "|" + "|".join((":" + "-" * (w + 1)) if i in left else ("-" * (w + 1) + ":")
                          for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])
