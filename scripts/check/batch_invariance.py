"""How many requests come out differently decoded in a batch than alone, at scale (BENCHMARKS.md,
"Engine batching": batch invariance at the bit level).

    .venv/bin/python scripts/check/batch_invariance.py [--n 96] [--dtype bfloat16] [--model DIR]
        [--decoder SPEC ...] [--concurrency 16]

The --n held-out math prompts (gen_length 256) are all submitted to one Engine with
max_running 1 and again with max_running = --concurrency; a request differs when its tokens,
NFE or token-forwards differ between the two. The tests hold this at zero on tiny models (bit
for bit, float32 and bfloat16) and on the embedded model (float32, and 16 prompts in bfloat16);
this script measures it where they do not look (another model, more prompts). Prints markdown
on stdout.
"""

from __future__ import annotations

import argparse

import torch

from unmask import LLM
from unmask.bench.tasks import load_task
from unmask.decoding.params import DecodeParams
from unmask.engine import decode


def outcomes(llm: LLM, prompts: list[list[int]], params: DecodeParams, concurrency: int) -> list[tuple]:
    reqs = decode(llm.model, params, prompts, max_running=concurrency)
    return [(r.token_ids, r.nfe, r.token_forwards) for r in reqs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=96)
    p.add_argument("--dtype")
    p.add_argument("--model")
    p.add_argument("--decoder", action="append")
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, dtype=args.dtype)
    prompts = [llm.encode_prompt(e.prompt) for e in load_task("math", args.n).examples]
    dtype = str(next(llm.model.parameters()).dtype).removeprefix("torch.")
    print(f"| decoder | dtype | requests | differ at concurrency {args.concurrency} vs 1 | "
          "of which in tokens |\n|:---|:---|---:|---:|---:|")
    for spec in args.decoder or ["fast", "threshold,cache=entropy", "balanced"]:
        params = DecodeParams.parse(spec, gen_length=256)
        one = outcomes(llm, prompts, params, 1)
        many = outcomes(llm, prompts, params, args.concurrency)
        differ = sum(a != b for a, b in zip(one, many, strict=True))
        tokens = sum(a[0] != b[0] for a, b in zip(one, many, strict=True))
        print(f"| `{spec}` | {dtype} | {len(prompts)} | {differ} | {tokens} |", flush=True)


if __name__ == "__main__":
    main()
