"""Share of decode time spent on EntropyCache's refresh decision.

The decision needs the entropy of each newly committed token's distribution (O(V) per position)
and a max over them; this times both against the whole decode, on the embedded model.

    python scripts/probe/entropy_overhead.py [--model DIR] [--n 8] [--gen-length 512]
"""

from __future__ import annotations

import argparse
import time

import torch

import unmask.decoding.scoring as rules
from unmask import LLM
from unmask.caching import EntropyCache
from unmask.tasks import TASKS


def timed(fn, bucket: list[float]):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            bucket[0] += time.perf_counter() - t
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--gen-length", type=int, default=512)
    ap.add_argument("--decoder", default="threshold,cache=entropy")
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model)
    prompts = [ex.prompt for ex in TASKS["math"].load("heldout", args.n)]
    llm.generate(prompts[:1], args.decoder, gen_length=args.gen_length)  # warm-up
    ent, plan = [0.0], [0.0]
    rules.entropy_of = timed(rules.entropy_of, ent)
    EntropyCache.plan = timed(EntropyCache.plan, plan)
    t = time.perf_counter()
    outs = llm.generate(prompts, args.decoder, gen_length=args.gen_length, batch_size=1)
    total = time.perf_counter() - t
    steps = sum(g.nfe for g in outs)
    print(f"{args.decoder}, gen_length {args.gen_length}, {len(prompts)} prompts, {steps} steps, "
          f"{total:.2f} s: entropy {1e3 * ent[0] / steps:.3f} ms/step ({100 * ent[0] / total:.2f}%), "
          f"decision {1e3 * plan[0] / steps:.3f} ms/step ({100 * plan[0] / total:.2f}%), "
          f"together {100 * (ent[0] + plan[0]) / total:.2f}% of decode time")


if __name__ == "__main__":
    main()
