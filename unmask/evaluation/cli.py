"""``unmask-lm-eval`` (also ``python -m unmask.evaluation``): lm-eval's own command line with the
``unmask`` model registered and unmask's task folder on ``--include_path``.

Plain ``lm_eval --model unmask`` works too (the hook in ``_unmask_lm_eval.py``, started by the
``unmask_lm_eval.pth`` an install puts in site-packages); this command predates it and stays:
it registers the model itself (so ``python -m unmask.evaluation`` also works without the .pth),
adds the task folder, and reports unmask's errors in one line. Arguments are lm-eval's, unchanged.
"""

from __future__ import annotations

import sys

from unmask.errors import UnmaskError
from unmask.evaluation import TASKS_DIR

PROG = "unmask-lm-eval"


def with_task_folder(argv: list[str]) -> list[str]:
    """argv plus ``--include_path`` unmask's task folder, unless it names one or asks for help."""
    if not argv or argv[0] in ("-h", "--help"):
        return argv
    if any(a == "--include_path" or a.startswith("--include_path=") for a in argv):
        return argv
    return [*argv, "--include_path", str(TASKS_DIR)]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        from lm_eval.__main__ import cli_evaluate

        import unmask.evaluation.harness  # noqa: F401  (registers the `unmask` model)
    except ImportError as e:
        print(f"{PROG}: error: lm-evaluation-harness is not installed ({e}); "
              "pip install 'unmask[eval]'", file=sys.stderr)
        return 2
    sys.argv = [PROG, *with_task_folder(args)]
    try:
        cli_evaluate()
    except UnmaskError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0
