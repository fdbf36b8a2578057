"""Block-causal calls of fewer places than their products' fewest rows widened
(`Runner.widen_small_calls`, this tree's default) against packed (the path before), side by side in
one process (BENCHMARKS.md, "Host overhead"): the shipped SDAR model decoding held-out math one
prompt at a time, as scripts/check/sdar_generate.py runs ours, one torch thread, CPU seconds of the
process, the two settings in alternating order for --rounds rounds; ratios taken within a round,
then their median and range. Tokens compared.

    .venv/bin/python scripts/ab/small_calls.py [--decoder static-1 ...] [--rounds 5] [--n 16]
        [--gen-length 64] [--model unmask-sdar]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import unmask
from unmask.bench.tasks import load_task
from unmask.engine import runner as runner_mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decoder", action="append", help="default: static-1, threshold")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--model", default="unmask-sdar")
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = unmask.LLM(args.model, device="cpu", dtype="float32", prefix_cache=False)
    prompts = [llm.encode_prompt(e.prompt) for e in load_task("math", args.n).examples]
    print(f"`python scripts/ab/small_calls.py` ({args.model}, {args.n} held-out math prompts one "
          f"at a time, gen_length {args.gen_length}, {args.rounds} rounds, one thread, CPU "
          f"seconds; load average at the start {os.getloadavg()[0]:.1f})\n")
    print("| decoder | widened s (median) | packed s (median) | widened / packed, median "
          "[range] | same tokens |\n|:---|---:|---:|---:|:---|")
    for spec in args.decoder or ["static-1", "threshold"]:
        params = unmask.DecodeParams.parse(spec, gen_length=args.gen_length,
                                           block_length=llm.config.block_size)

        def run(widen: bool, params: unmask.DecodeParams = params) -> tuple[float, list]:
            runner_mod.Runner.widen_small_calls = widen
            t = time.process_time()
            outs = llm.generate_ids(prompts, params, batch_size=1)
            return time.process_time() - t, [g.token_ids for g in outs]

        run(True)  # warm-up
        seconds: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list] = {}
        for i in range(args.rounds):
            for widen in (True, False) if i % 2 == 0 else (False, True):
                s, tokens[widen] = run(widen)
                seconds[widen].append(s)
        ratios = [a / b for a, b in zip(seconds[True], seconds[False], strict=True)]
        print(f"| `{spec}` | {statistics.median(seconds[True]):.2f} | "
              f"{statistics.median(seconds[False]):.2f} | {statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}] | {tokens[True] == tokens[False]} |")
    runner_mod.Runner.widen_small_calls = True


if __name__ == "__main__":
    main()
