"""An earlier commit checked out beside this tree, and Python run against either, for the
before/after scripts (engine.py, startup.py, mixed_knobs.py; scripts/check/commit_order.py): the
same measuring code, the tree under test chosen by PYTHONPATH."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """REV in a temporary git worktree, removed at the end."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "rev"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree),
                        rev], check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           check=False)


def python_in(tree: Path, args: list[str], cwd: str | None = None) -> str:
    """stdout of this venv's Python run with `tree`'s unmask first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                         check=True, cwd=cwd)
    return out.stdout
