"""Where a constrained decode's forwards go: per commit step of each request, the holes the
rule could commit (its window), each with its constrained confidence and the size of its
allowed set (1: forced), which the rule selected and which the commit check kept; then per
output the best TPF any rule could reach given the model's blocks (docs/decoders.md §
Structured output, "Measured"). One request at a time, one thread.

    python scripts/probe/grammar_steps.py [--model unmask-sdar] [--n 4] [--gen-length 64]
        [--schema answer|steps+answer] [--spec threshold,threshold=0.9] [--out FILE]

The ceiling: a forward commits in the current block only (a block-causal model's, or the spec's
block_length for LLaDA), so the slots the rule decided (not the scaffold, not what settling wrote,
not the fill after the stop) in m blocks need m forwards at least: no rule deciding them
reaches more than their number / m.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from unmask import LLM
from unmask.api import resolve_params
from unmask.decoding.grammar import ResponseFormat, TokenMasks
from unmask.engine.decoder import Decoder
from unmask.engine.layout import model_defaults
from unmask.tasks.math import make_split

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from structured_output import SCHEMAS  # noqa: E402  (the benchmark's schemas, one source)


class Recorder:
    """Hooks on the decoder's constrained step: the allowed-set sizes each scored hole had
    (TokenMasks.at) and each step's selection before and after the commit check."""

    def __init__(self) -> None:
        self.allowed: dict[int, int] = {}  # generated slot -> allowed tokens at its last scoring
        self.steps: list[dict] = []
        at, restrict = TokenMasks.at, Decoder._restrict
        rec = self

        def hooked_at(masks, rows, slots, vocab):
            out = at(masks, rows, slots, vocab)
            for s, w in zip((slots - masks.P).tolist(), out, strict=True):
                rec.allowed[s] = int(np.isfinite(w).sum())
            return out

        def hooked_restrict(dec, b, x, cons, sel, token, ranks):
            kept = restrict(dec, b, x, cons, sel, token, ranks)
            if x.shape[0] == len(b):  # the rule's step (not a FreeDave target)
                rec.step(b, x, sel, kept)
            return kept

        TokenMasks.at, Decoder._restrict = hooked_at, hooked_restrict

    def step(self, b, x, sel, kept) -> None:
        g = slice(b.P, None)
        pr = b.preds
        window = np.flatnonzero(pr.fresh[0, g] & (x[0, g] == b.mask_id))
        self.steps.append({"window": [
            {"slot": int(s), "token": int(pr.token[0, g][s]), "conf": float(pr.conf[0, g][s]),
             "allowed": self.allowed.get(int(s), -1), "selected": bool(sel[0, g][s]),
             "kept": bool(kept[0, g][s])} for s in window]})


def ceiling(steps: list[dict], block: int, offset: int) -> tuple[int, int]:
    """(decided, blocks): the slots the rule committed (neither scaffold, nor settled, nor
    filled after the stop) and the blocks holding them. A forward commits in one block, so no
    rule deciding these slots reaches more than decided / blocks tokens a forward.
    offset: the generated region's first slot within its block."""
    decided = {w["slot"] for s in steps for w in s["window"] if w["kept"]}
    return len(decided), len({(i + offset) // block for i in decided})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="unmask-sdar")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--schema", default="answer", choices=sorted(SCHEMAS))
    ap.add_argument("--spec", default="threshold,threshold=0.9")
    ap.add_argument("--threshold", type=float, default=0.9,
                    help="the spec's threshold, for counting the steps no hole reached")
    ap.add_argument("--out", default=None, help="write the per-step records as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model)
    problems = [p for p in make_split("heldout", 4 * args.n) if p.answer.lstrip("-").isdigit()]
    fmt = ResponseFormat.json_schema(SCHEMAS[args.schema])
    rec = Recorder()
    records = []
    for p in problems[: args.n]:
        rec.steps, rec.allowed = [], {}
        out = llm.generate([p.prompt], args.spec, response_format=fmt,
                           gen_length=args.gen_length)[0]
        c = llm.constraint(fmt, args.gen_length)
        scaffold = int((c.initial != c.mask_id).sum())
        block = resolve_params(args.spec, {"gen_length": args.gen_length},
                               model_defaults(llm.model)).block_length
        offset = len(llm.encode_prompt(p.prompt)) % block
        decided, blocks = ceiling(rec.steps, block, offset)
        # commit steps where no hole reached the threshold: the rule commits its best one alone
        unsure = sum(1 for st in rec.steps if st["window"]
                     and max(w["conf"] for w in st["window"]) < args.threshold)
        records.append({"text": out.text, "nfe": out.nfe, "tpf": out.tpf, "scaffold": scaffold,
                        "decided": decided, "blocks": blocks, "ceiling": decided / blocks,
                        "unsure": unsure,
                        "steps": rec.steps})
        print(f"\n{out.text!r}  NFE {out.nfe}  TPF {out.tpf:.2f}  scaffold {scaffold}  useful "
              f"{out.useful}  decided {decided} in {blocks} blocks: ceiling {decided / blocks:.2f}; "
              f"{unsure} of {len(rec.steps) - 1} commit steps under {args.threshold}")
        for k, s in enumerate(rec.steps):
            cells = [f"{w['slot']}:{llm.detokenize([w['token']])!r} c={w['conf']:.2f} "
                     f"a={w['allowed']}{' S' if w['selected'] else ''}"
                     f"{' K' if w['kept'] else ''}" for w in s["window"]]
            print(f"  step {k + 1}: " + " | ".join(cells))
    print(f"\nmean TPF {statistics.mean(r['tpf'] for r in records):.2f}, NFE "
          f"{statistics.mean(r['nfe'] for r in records):.2f}, ceiling "
          f"{statistics.mean(r['ceiling'] for r in records):.2f}, commit steps under the threshold "
          f"{sum(r['unsure'] for r in records)} of {sum(len(r['steps']) - 1 for r in records)}")
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
