"""The constraint's cold step on a 128k-token vocabulary, this tree against an earlier commit,
side by side: the masks of a block of 32 holes on a 64-slot canvas with no hole vector nor
memoized move kept from the last step (scripts/bench/grammar_libraries.py's measurement, on its
synthetic 128,000-token vocabulary), per JSON schema, rounds rotating which side runs first,
medians. One thread, CPU clock.

    python scripts/ab/grammar_cold_step.py --before REV [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from worktree import ab_main  # noqa: E402

SCHEMAS = ("answer", "steps+answer")


def child(n: int) -> dict:
    """One side: per schema, the median cold step (ms) of the bench's measurement."""
    import torch
    from grammar_libraries import SCHEMAS as ALL
    from grammar_libraries import unmask_constraint, vocabularies

    torch.set_num_threads(1)
    big = next(v for name, v in vocabularies().items() if "128" in name)
    return {s: unmask_constraint(big, ALL[s])[1] * 1e3 for s in SCHEMAS}


def write(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    lines = [f"Produced by `python scripts/ab/grammar_cold_step.py --before {args.before} --rounds "
             f"{args.rounds}`: the masks of 32 holes on a 64-slot canvas, nothing kept from the",
             "last step, on the synthetic 128,000-token vocabulary of",
             "scripts/bench/grammar_libraries.py; one thread, CPU clock, the median of the rounds",
             "(each side's value a median of 5 steps; sides rotating first).", "",
             "| schema | cold step before (ms) | cold step after (ms) | after/before |",
             "|---|---|---|---|"]
    for s in SCHEMAS:
        b = statistics.median(r[s] for r in runs["before"])
        a = statistics.median(r[s] for r in runs["after"])
        lines.append(f"| {s} | {b:.1f} | {a:.1f} | {a / b:.2f}x |")
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(ab_main(__file__, __doc__, "benchmarks/ab/grammar-cold-step.md", child, write))
