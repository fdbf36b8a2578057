"""What prefix reuse costs traffic that shares nothing: an earlier commit (the engine before
reuse) against this tree with the store off and on, on the shipped SDAR model, one torch
thread, in CPU time (useful tokens per CPU-second of the decoding thread, which other processes
on a shared machine do not move as they move wall seconds).

    .venv/bin/python scripts/ab/prefix_cost.py REV [--rounds 7] [--n 16]

Workloads, each decoded with threshold and static-1 at concurrency 1 and 16, 32 tokens
generated, after one untimed request of another prompt (a server's steady state: the store has
seen an earlier request): "short", held-out math questions in the chat template (they share its
first tokens only, as `unmask bench-serve --fresh-prompts` does), and "long", the same questions
after a ~540-token system prompt whose words are shuffled differently for every request
(benchmarks/data/shared-system-prompt.txt: the same prefill, nothing shared).

This tree runs every cell three times in rotated order, from a random start in each process:
store off, store off again, and on (an empty store that the untimed request primes). "off
again / off" is two identical runs: the spread of its ratios is the noise a ratio must clear.
The trees alternate (rotated) within each round, one process each; ratios are taken within a
round, then their median (range in brackets).
Requests whose tokens differ are counted against this tree's store-off run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from worktree import ROOT, ratio_range, rev_rounds

SYSTEM = ROOT / "benchmarks/data/shared-system-prompt.txt"
DECODERS = ("threshold", "static-1")
CONCURRENCY = (1, 16)
MODES = ("off", "off again", "on")


def load() -> tuple:
    """The shipped SDAR model on one thread with no store of its own, and the tree's
    PrefixStore class (None in a tree from before reuse)."""
    import torch

    from unmask.api import LLM
    try:
        from unmask.engine.prefix_store import PrefixStore
    except ImportError:  # the engine before reuse
        PrefixStore = None  # noqa: N806
    torch.set_num_threads(1)
    llm = LLM("unmask-sdar", device="cpu", **({} if PrefixStore is None else
                                               {"prefix_cache": False}))
    return llm, PrefixStore


def unshared_prompts(llm, n: int) -> dict[str, list[list[int]]]:
    """The workloads' n + 1 prompts each (the module's docstring): "short", the questions in
    the chat template; "long", each after the system prompt with its words shuffled anew."""
    from unmask.bench.tasks import load_task

    questions = [ex.prompt for ex in load_task("math", n + 1, seed=0).examples]
    words = SYSTEM.read_text().split()

    def shuffled(seed: int) -> str:
        w = list(words)
        random.Random(seed).shuffle(w)
        return " ".join(w)

    return {
        "short": [llm.encode_messages([{"role": "user", "content": q}]) for q in questions],
        "long": [llm.encode_messages([{"role": "system", "content": shuffled(i)},
                                      {"role": "user", "content": q}])
                 for i, q in enumerate(questions)]}


def measure(n: int) -> dict:
    """In the tree on PYTHONPATH: {cell: {mode: [tokens per CPU-s, token lists]}}; a tree
    without a prefix store measures "off" only."""
    from unmask.decoding.params import DecodeParams
    from unmask.engine import Engine, SchedulerConfig

    llm, PrefixStore = load()  # noqa: N806
    bs = llm.config.block_size
    workloads = unshared_prompts(llm, n)
    modes = MODES if PrefixStore is not None else ("off",)
    # the rotation starts anywhere: with a fixed start, a cell's first mode was the same in
    # every round, and the first run after a change of workload pays page faults the next
    # ones do not (benchmarks/ab/prefix-cost.md)
    first = random.SystemRandom().randrange(len(modes))
    modes = modes[first:] + modes[:first]
    out: dict = {}
    for work, prompts in workloads.items():
        *timed, prime = prompts
        for spec in DECODERS:
            params = DecodeParams.parse(spec, gen_length=32, block_length=bs)
            for conc in CONCURRENCY:
                cell = out.setdefault(f"{work} {spec} c={conc}", {})
                for mode in modes:
                    store = PrefixStore(bs, 1 << 30) if mode == "on" else None
                    kw = {} if PrefixStore is None else {"prefix": store}
                    eng = Engine(llm.model, SchedulerConfig(max_running=conc), **kw)
                    eng.add_request(prime, params)
                    eng.run()
                    reqs = [eng.add_request(p, params) for p in timed]
                    t = time.process_time()
                    eng.run()
                    cpu = time.process_time() - t
                    cell[mode] = (sum(r.useful for r in reqs) / cpu, [r.token_ids for r in reqs])
                modes = modes[1:] + modes[:1]  # rotated, so no mode always runs first
    return out


def main() -> None:
    rev_rounds(str(Path(__file__)), __doc__, measure, report, default_rounds=7)


def report(args: argparse.Namespace, runs: dict[str, list]) -> str:
    med = statistics.median


    lines = [f"Generated by `python scripts/ab/prefix_cost.py {args.rev} --rounds {args.rounds} "
             f"--n {args.n}`. Before: `{args.rev}`; after: this tree, store off, off again and "
             f"on; useful tokens per CPU-second, medians of {args.rounds} rounds; ratios: the "
             f"median of the rounds' ratios (their range in brackets).\n",
             "| workload | before | off | on | off / before | on / before | on / off | "
             "off again / off (noise) | tokens differ |",
             "|:---|---:|---:|---:|:---|:---|:---|:---|---:|"]
    for cell in runs["after"][0]:
        b = [r[cell]["off"][0] for r in runs["before"]]
        a = {m: [r[cell][m][0] for r in runs["after"]] for m in MODES}
        ref = runs["after"][0][cell]["off"][1]
        differ = sum(x != y for x, y in zip(ref, runs["before"][0][cell]["off"][1], strict=True))
        differ_on = sum(x != y for x, y in zip(ref, runs["after"][0][cell]["on"][1], strict=True))
        lines.append(f"| {cell} | {med(b):.0f} | {med(a['off']):.0f} | {med(a['on']):.0f} | "
                     f"{ratio_range(a['off'], b)} | {ratio_range(a['on'], b)} | "
                     f"{ratio_range(a['on'], a['off'])} | "
                     f"{ratio_range(a['off again'], a['off'])} | before {differ}, on {differ_on} "
                     f"of {len(ref)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
