"""An earlier commit checked out beside this tree, and Python run against either, for the
before/after scripts (engine.py, startup.py, mixed_knobs.py; scripts/check/commit_order.py): the
same measuring code, the tree under test chosen by PYTHONPATH."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
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


def rounds(before: str, script: str, args: list[str], n_rounds: int) -> dict[str, list[dict]]:
    """`script args` run against REV `before` and against this tree, n_rounds each, the side
    that runs first rotating; each run's last stdout line is a JSON object. Returns
    {"before": [...], "after": [...]}, one object a round."""
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with checkout(before) as old:
        trees = {"before": old, "after": ROOT}
        for r in range(n_rounds):
            for side in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
                got = python_in(trees[side], [script, *args], cwd=str(trees[side]))
                runs[side].append(json.loads(got.strip().splitlines()[-1]))
                print(side, "round", r, file=sys.stderr)
    return runs


def rev_rounds(script: str, doc: str, measure, report, default_rounds: int) -> None:
    """The command line of a before/after script given REV as its argument: `REV [--rounds R]
    [--n N]` prints report(args, runs) over `rounds`' runs; `--measure [--n N]` (the script
    measuring the tree on PYTHONPATH) prints measure(n) as JSON."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("rev", nargs="?")
    p.add_argument("--rounds", type=int, default=default_rounds)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--measure", action="store_true", help="measure the tree on PYTHONPATH")
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.n)))
        return
    if args.rev is None:
        p.error("give REV, the commit to compare with")
    print(report(args, rounds(args.rev, script, ["--measure", "--n", str(args.n)], args.rounds)))


def ratio_range(num: list[float], den: list[float]) -> str:
    """Per-round ratios num / den as "median x [min, max]"."""
    r = [a / b for a, b in zip(num, den, strict=True)]
    return f"{statistics.median(r):.2f}x [{min(r):.2f}, {max(r):.2f}]"


def ab_main(script: str, doc: str, out: str, child, write) -> int:
    """The command line of a before/after script measured in rounds: `--before REV [--n N]
    [--rounds R] [--out FILE]`; child(n) -> a JSON-able dict measures one side (the script
    runs itself with --child), write(runs, args) writes the comparison."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--before", help="the earlier commit (required)")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=out)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.n)))
        return 0
    if not args.before:
        ap.error("--before REV is required")
    write(rounds(args.before, script, ["--child", "--n", str(args.n)], args.rounds), args)
    return 0
