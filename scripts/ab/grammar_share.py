"""The structured-output constraint's CPU share of a decode, this tree against an earlier
commit, side by side: the same prompts, decoder, JSON schemas and the models' own format as a
regular expression on both sides, with the length prior off here (weight 0) so that both sides
decode the same tokens (checked), rounds rotating which side runs first, medians. One thread,
CPU clock.

    python scripts/ab/grammar_share.py --before REV [--n 16] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from structured_output import OWN_FORMAT, SCHEMAS  # noqa: E402  (the benchmark's formats)
from worktree import ab_main  # noqa: E402

MODELS = ("unmask-llada", "unmask-sdar")
SPEC = "threshold,threshold=0.9"
# The constraint's entry points on either side (the older one has no `weights`): the time
# inside any of them, counted once when they call each other.
ENTRIES = ("weights", "write_weights", "allowed", "restrict", "feasible", "settle")


def child(n: int) -> dict:
    """One side's measurement: per model, schema and batch size, the grammar share, the CPU
    seconds and a digest of the tokens."""
    import torch

    from unmask import LLM
    from unmask.decoding.grammar import Constraint, ResponseFormat
    from unmask.tasks.math import make_split

    torch.set_num_threads(1)
    spent = {"s": 0.0, "inside": False}
    for name in ENTRIES:
        if hasattr(Constraint, name):
            setattr(Constraint, name, _timed(getattr(Constraint, name), spent))
    prompts = [p.prompt for p in make_split("heldout", 4 * n)
               if p.answer.lstrip("-").isdigit()][:n]
    out = {}
    for model in MODELS:
        llm = LLM(model)
        formats = {s: ResponseFormat.json_schema(schema) for s, schema in SCHEMAS.items()}
        formats["own format (regex)"] = ResponseFormat.regex(OWN_FORMAT)
        for sname, fmt in formats.items():
            if "length_penalty" in {f.name for f in dataclasses.fields(fmt)}:
                fmt = dataclasses.replace(fmt, length_penalty=0.0)
            for batch in (1, 16):
                before, t = spent["s"], time.process_time()
                gens = llm.generate(prompts, SPEC, batch_size=batch, response_format=fmt,
                                    gen_length=64)
                total = time.process_time() - t
                digest = hashlib.sha256(json.dumps([g.token_ids for g in gens]).encode())
                out[f"{model} {sname} b{batch}"] = {
                    "share": (spent["s"] - before) / total, "cpu": total,
                    "tokens": digest.hexdigest()[:16]}
    return out


def _timed(inner, spent: dict):
    def timed(self, *a, **kw):
        if spent["inside"]:
            return inner(self, *a, **kw)
        spent["inside"] = True
        t = time.process_time()
        try:
            return inner(self, *a, **kw)
        finally:
            spent["s"] += time.process_time() - t
            spent["inside"] = False
    return timed


def write(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    lines = [f"Produced by `python scripts/ab/grammar_share.py --before {args.before} --n {args.n} "
             f"--rounds {args.rounds}`: the constraint's CPU time (masks, commit checks) as a share",
             "of the decode's, one thread, CPU clock, the median of the rounds (sides rotating",
             f"first); {args.n} held-out math prompts, `{SPEC}`, 64 tokens, the length prior off",
             "(weight 0: both sides decode the same tokens, checked).", "",
             "| model, schema, batch | share before | share after | CPU s before | CPU s after "
             "| same tokens |", "|---|---|---|---|---|---|"]
    for key in runs["before"][0]:
        b = [r[key] for r in runs["before"]]
        a = [r[key] for r in runs["after"]]
        same = {x["tokens"] for x in a} == {x["tokens"] for x in b}
        lines.append(f"| {key} | {statistics.median(x['share'] for x in b):.1%} | "
                     f"{statistics.median(x['share'] for x in a):.1%} | "
                     f"{statistics.median(x['cpu'] for x in b):.3f} | "
                     f"{statistics.median(x['cpu'] for x in a):.3f} | {'yes' if same else 'NO'} |")
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(ab_main(__file__, __doc__, "benchmarks/ab/grammar-share.md", child, write))
