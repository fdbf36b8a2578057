"""How long a process takes to load the embedded model (`LLM()`), and what it imports: this tree
against an earlier commit, in fresh processes, alternating.

    .venv/bin/python scripts/startup.py REV [--runs 5]

REV is checked out in a temporary git worktree and imported from there (PYTHONPATH), with this
venv's packages. Prints each run and the medians (BENCHMARKS.md, "Start-up").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from unmask.api import LLM
t2 = time.perf_counter()
LLM()
t3 = time.perf_counter()
print(json.dumps({"torch": t1 - t0, "unmask": t2 - t1, "llm": t3 - t2,
                  "dynamo": "torch._dynamo" in sys.modules}))
"""


def probe(path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(path)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         check=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "-q", "--detach", str(base),
                        args.rev], check=True)
        try:
            runs: dict[str, list[dict]] = {args.rev: [], "this tree": []}
            for i in range(args.runs):
                for name, path in ((args.rev, base), ("this tree", root)):
                    r = probe(path)
                    runs[name].append(r)
                    print(f"run {i + 1} {name}: LLM() {r['llm']:.2f} s, import torch "
                          f"{r['torch']:.2f} s, torch._dynamo imported: {r['dynamo']}")
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(base)],
                           check=True)
    print("\n| tree | LLM() s, median (range) | torch._dynamo imported |\n|:---|---:|:---|")
    for name, rs in runs.items():
        llm = [r["llm"] for r in rs]
        dynamo = {r["dynamo"] for r in rs}
        seen = "some runs" if len(dynamo) > 1 else "yes" if dynamo.pop() else "no"
        print(f"| {name} | {statistics.median(llm):.2f} ({min(llm):.2f}-{max(llm):.2f}) | "
              f"{seen} |")


if __name__ == "__main__":
    main()
