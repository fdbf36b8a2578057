"""Evaluation outside unmask's own bench: lm-evaluation-harness (``harness``) and the
Monte Carlo likelihood bound it scores with (``likelihood``)."""

from pathlib import Path

# lm-eval task YAMLs shipped with the package (pass to lm_eval --include_path).
TASKS_DIR = Path(__file__).resolve().parent.parent / "eval_tasks"
