"""Benchmarks: decoders side by side on a task (``unmask bench``) and accuracy (``unmask eval``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unmask._lazy import lazy_exports

if TYPE_CHECKING:
    from unmask.bench.runner import Sample, run_side_by_side, summarize
    from unmask.bench.tasks import BenchExample, BenchTask, load_task

__all__ = ["BenchExample", "BenchTask", "Sample", "load_task", "run_side_by_side", "summarize"]

# Imported on first use: the runner needs torch, the CLI's argument definitions do not.
__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(["Sample", "run_side_by_side", "summarize"], "unmask.bench.runner"),
    **dict.fromkeys(["BenchExample", "BenchTask", "load_task"], "unmask.bench.tasks")})
