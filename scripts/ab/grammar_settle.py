"""Constrained decoding, this tree against an earlier commit, side by side: the benchmark's
formats (the two JSON schemas at their default length prior, the models' own format as a
regular expression) on both shipped models, one request at a time (batch 1, what a request
waits for), rounds rotating which side runs first, medians of the CPU time. Reports TPF, NFE,
useful tokens, valid outputs and the decode's CPU seconds per side, and whether the texts are
the same. One thread, CPU clock (the counts do not depend on the clock or the round).

    python scripts/ab/grammar_settle.py --before REV [--n 16] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
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


def child(n: int) -> dict:
    """One side: per model and format, the mean TPF, NFE and useful tokens, the valid share,
    the CPU seconds of the whole decode and a digest of the texts."""
    import torch

    from unmask import LLM
    from unmask.decoding.grammar import ResponseFormat
    from unmask.tasks.math import make_split

    torch.set_num_threads(1)
    prompts = [p.prompt for p in make_split("heldout", 4 * n)
               if p.answer.lstrip("-").isdigit()][:n]
    formats = {s: ResponseFormat.json_schema(schema) for s, schema in SCHEMAS.items()}
    formats["own format (regex)"] = ResponseFormat.regex(OWN_FORMAT)
    out = {}
    for model in MODELS:
        llm = LLM(model)
        for sname, fmt in formats.items():
            t = time.process_time()
            gens = llm.generate(prompts, SPEC, batch_size=1, response_format=fmt, gen_length=64)
            cpu = time.process_time() - t
            texts = [g.text for g in gens]
            out[f"{model} {sname}"] = {
                "tpf": statistics.mean(g.tpf for g in gens),
                "nfe": statistics.mean(g.nfe for g in gens),
                "useful": statistics.mean(g.useful for g in gens),
                "valid": sum(fmt.accepts(x) for x in texts) / len(texts), "cpu": cpu,
                "texts": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16]}
    return out


def write(runs: dict[str, list[dict]], args: argparse.Namespace) -> None:
    lines = [f"Produced by `python scripts/ab/grammar_settle.py --before {args.before} --n {args.n} "
             f"--rounds {args.rounds}`: {args.n} held-out math prompts, `{SPEC}`, 64 tokens, one",
             "request at a time, one thread; TPF, NFE and useful tokens are means over the prompts",
             "(TPF counts what forwards decided: the scaffold, the fixed text and forced tokens",
             "written after a commit, and early exit's EOS fill are not counted); CPU s: the whole",
             "decode's CPU seconds, the median of the rounds (sides rotating first).", "",
             "| model, format | TPF before | TPF after | NFE before | NFE after | useful before "
             "| useful after | valid before | valid after | CPU s before | CPU s after "
             "| CPU after/before | same text |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(key, runs) for key in runs["before"][0]]
    Path(args.out).write_text("\n".join(lines) + "\n")


def _row(key: str, runs: dict[str, list[dict]]) -> str:
    """One model and format: the counts (the same every round) and the median CPU seconds."""
    b, a = runs["before"][0][key], runs["after"][0][key]
    cpu = {side: statistics.median(r[key]["cpu"] for r in got) for side, got in runs.items()}
    cells = [key, f"{b['tpf']:.2f}", f"{a['tpf']:.2f}", f"{b['nfe']:.1f}", f"{a['nfe']:.1f}",
             f"{b['useful']:.1f}", f"{a['useful']:.1f}", f"{b['valid']:.0%}", f"{a['valid']:.0%}",
             f"{cpu['before']:.2f}", f"{cpu['after']:.2f}", f"{cpu['after'] / cpu['before']:.2f}x",
             "yes" if a["texts"] == b["texts"] else "no"]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    sys.exit(ab_main(__file__, __doc__, "benchmarks/ab/grammar-settle.md", child, write))
