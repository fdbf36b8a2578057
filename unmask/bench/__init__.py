"""Benchmarks: decoders side by side on a task (``unmask bench``) and accuracy (``unmask eval``)."""

from unmask.bench.runner import Sample, run_side_by_side, summarize
from unmask.bench.tasks import BenchExample, BenchTask, load_task

__all__ = ["BenchExample", "BenchTask", "Sample", "load_task", "run_side_by_side", "summarize"]
