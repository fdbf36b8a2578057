"""How long a process takes to load the embedded model (`LLM()`), and what it imports: this tree
against an earlier commit, in fresh processes, alternating.

    .venv/bin/python scripts/ab/startup.py REV [--runs 5]

REV is checked out in a temporary git worktree and imported from there (PYTHONPATH), with this
venv's packages. Prints each run and the medians (BENCHMARKS.md, "Start-up").
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from worktree import ROOT, checkout, python_in

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


def probe(tree: Path) -> dict:
    # from a neutral folder, so that the working directory puts no unmask on the path
    out = python_in(tree, ["-c", PROBE], cwd=tempfile.gettempdir())
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {args.rev: [], "this tree": []}
    with checkout(args.rev) as base:
        for i in range(args.runs):
            for name, tree in ((args.rev, base), ("this tree", ROOT)):
                r = probe(tree)
                runs[name].append(r)
                print(f"run {i + 1} {name}: LLM() {r['llm']:.2f} s, import torch "
                      f"{r['torch']:.2f} s, torch._dynamo imported: {r['dynamo']}")
    print("\n| tree | LLM() s, median (range) | torch._dynamo imported |\n|:---|---:|:---|")
    for name, rs in runs.items():
        llm = [r["llm"] for r in rs]
        dynamo = {r["dynamo"] for r in rs}
        seen = "some runs" if len(dynamo) > 1 else "yes" if dynamo.pop() else "no"
        print(f"| {name} | {statistics.median(llm):.2f} ({min(llm):.2f}-{max(llm):.2f}) | "
              f"{seen} |")


if __name__ == "__main__":
    main()
