"""Multiple-choice accuracy and spread of the likelihood bounds on the shipped models: the LLaDA
model by the masked-diffusion bound, unmask-sdar by the block-diffusion one
(unmask.evaluation.block_likelihood), through the lm-eval adapter.

    python scripts/bench/block_likelihood.py --problems 200 --out benchmarks/bench/block-likelihood.md

Accuracy: the first N held-out math problems, each as 1 true + up to 3 wrong continuations (the
worked solution ending in the true `#### answer` or a wrong one; tests/helpers.py
math_choice_wins), a problem right when the true one scores highest. Spread: for the true
continuation of the first K problems, the estimate's reported stderr and its std over seeds,
per mc_num, medians over problems. Cost: CPU seconds per request of the one-forward form against
the naive loop of tests/test_block_likelihood.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # helpers

from helpers import math_choice_wins  # noqa: E402
from test_block_likelihood import naive_block_losses  # noqa: E402

from unmask.evaluation.block_likelihood import target_blocks  # noqa: E402
from unmask.evaluation.harness import UnmaskLM  # noqa: E402
from unmask.tasks import TASKS  # noqa: E402

MODELS = {"unmask-llada": "masked-diffusion", "unmask-sdar": "block-diffusion"}


def accuracy_rows(problems: int, mc_nums: list[int]) -> list[str]:
    rows = []
    for name, bound in MODELS.items():
        for mc in mc_nums:
            lm = UnmaskLM(pretrained=name, device="cpu", mc_num=mc, greedy_check=False)
            start = time.process_time()
            wins, n, chance = math_choice_wins(lm, problems)
            cpu = time.process_time() - start
            rows.append(f"| {name} | {bound} | {mc} | {wins}/{n} = {wins / n:.3f} | {chance:.3f} "
                        f"| {cpu:.0f} |")
            print(rows[-1], flush=True)
    return rows


def spread_rows(k: int, seeds: int, mc_nums: list[int]) -> list[str]:
    rows = []
    for name, bound in MODELS.items():
        lm = UnmaskLM(pretrained=name, device="cpu", greedy_check=False)
        pairs = []
        for ex in TASKS["math"].load("heldout", k):
            context = lm.apply_chat_template([{"role": "user", "content": ex.prompt}])
            pairs.append(lm._encode_pair(context, ex.response))
        for mc in mc_nums:
            lm.mc_num = mc
            stderr, over_seeds, value = [], [], []
            for prompt, target in pairs:
                runs = []
                for seed in range(seeds):
                    lm.params = lm.params.replace(seed=seed)
                    runs.append(lm.bound(prompt, target))
                stderr.append(runs[0].stderr)
                over_seeds.append(statistics.stdev(r.logprob for r in runs))
                value.append(statistics.mean(r.logprob for r in runs))
            rows.append(f"| {name} | {bound} | {mc} | {statistics.median(value):.2f} | "
                        f"{statistics.median(stderr):.3f} | {statistics.median(over_seeds):.3f} |")
            print(rows[-1], flush=True)
    return rows


def cost_rows(k: int, mc: int) -> list[str]:
    """CPU seconds per request, unmask-sdar's true continuations: the one-forward estimate (one
    forward of mc rows x 2T) against the naive loop the tests check it with (a forward per draw
    and target block)."""
    lm = UnmaskLM(pretrained="unmask-sdar", device="cpu", mc_num=mc, mc_batch_size=mc)
    fast, naive, blocks = [], [], []
    for ex in TASKS["math"].load("heldout", k):
        context = lm.apply_chat_template([{"role": "user", "content": ex.prompt}])
        prompt, target = lm._encode_pair(context, ex.response)
        blocks.append(len(target_blocks(len(prompt), len(target), lm.llm.config.block_size)))
        start = time.process_time()
        lm.bound(prompt, target)
        fast.append(time.process_time() - start)
        start = time.process_time()
        with torch.no_grad():
            naive_block_losses(lm.llm.model, prompt, target, mc, seed=0)
        naive.append(time.process_time() - start)
    return [f"| {mc} | {statistics.median(blocks)} | 1 | {mc * statistics.median(blocks)} | "
            f"{statistics.median(fast):.3f} | {statistics.median(naive):.3f} | "
            f"{statistics.median(n / f for n, f in zip(naive, fast, strict=True)):.1f} |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--accuracy-mc", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--spread-problems", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--spread-mc", type=int, nargs="+", default=[4, 16, 32, 128])
    ap.add_argument("--cost-problems", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = ["| model | bound | mc_num | true answer highest | chance | CPU s |",
             "|---|---|---|---|---|---|", *accuracy_rows(args.problems, args.accuracy_mc), "",
             "| model | bound | mc_num | median log-lik | median stderr | median std over "
             f"{args.seeds} seeds |", "|---|---|---|---|---|---|",
             *spread_rows(args.spread_problems, args.seeds, args.spread_mc), "",
             "| mc_num | target blocks | forwards | naive forwards | CPU s | naive CPU s | "
             "naive / one-forward |", "|---|---|---|---|---|---|---|",
             *cost_rows(args.cost_problems, 32)]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
