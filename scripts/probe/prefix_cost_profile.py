"""Where prefix reuse's cost goes: the tree on PYTHONPATH (or this one) decodes the workloads of
scripts/ab/prefix_cost.py once under torch.profiler and once under cProfile, one torch thread,
and prints one markdown row per workload: attention calls (aten::scaled_dot_product_attention)
and their CPU time, the share of the decode's CPU time in attention (the kernel with the frame's
Python around it: `Frame.attend`), and in the prefix store (offer and restore), under cProfile
and, for the store-on cells, timed once more without a profiler.

    PYTHONPATH=TREE .venv/bin/python scripts/probe/prefix_cost_profile.py [--n 16] [--label NAME]

Run it once per tree (an earlier commit checked out beside this one, e.g. with
scripts/ab/worktree.py) and put the rows side by side; the profilers slow the run down, so the
shares, not the seconds, are the result (the A/B in CPU time is scripts/ab/prefix_cost.py).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from unmask.api import LLM
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ab"))
from prefix_cost import load, unshared_prompts  # noqa: E402  (the A/B's workloads, one definition)

CELLS = [("short", "threshold", 16, "off"), ("short", "threshold", 16, "on"),
         ("short", "static-1", 1, "off"), ("long", "threshold", 1, "off"),
         ("long", "threshold", 16, "off"), ("long", "threshold", 16, "on")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--label", default="this tree")
    args = p.parse_args()
    llm, PrefixStore = load()  # noqa: N806
    bs = llm.config.block_size
    prompts = unshared_prompts(llm, args.n)  # the A/B's workloads
    print("| tree | workload | attention calls | their CPU ms | CPU s (cProfile) | in "
          "`Frame.attend` | in the prefix store | in the store, no profiler |")
    print("|:---|:---|---:|---:|---:|---:|---:|---:|")
    for work, spec, conc, mode in CELLS:
        if mode == "on" and PrefixStore is None:
            continue
        params = DecodeParams.parse(spec, gen_length=32, block_length=bs)
        store = (lambda: PrefixStore(bs, 1 << 30)) if mode == "on" else (lambda: None)
        run = functools.partial(decode, llm, prompts[work], params, conc, store,
                                PrefixStore is not None)
        run()  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
        sdpa = [e for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention"]
        calls = sdpa[0].count if sdpa else 0
        ms = sdpa[0].cpu_time_total / 1e3 if sdpa else 0.0
        pr = cProfile.Profile(time.process_time)
        pr.runcall(run)
        stats = pstats.Stats(pr).stats
        total = sum(tt for (_, _, tt, _, _) in stats.values())
        attend = cumulative(stats, "attend", "unmask/kv.py")
        kept = cumulative(stats, "offer", "prefix_store.py") + cumulative(stats, "restore",
                                                                         "prefix_store.py")
        alone = "" if mode == "off" else f"{store_share(llm, prompts[work], params, conc, bs):.1%}"
        print(f"| {args.label} | {work} {spec} c={conc} {mode} | {calls} | {ms:.0f} | "
              f"{total:.2f} | {attend / total:.0%} | {kept / total:.1%} | {alone} |")


def decode(llm: LLM, prompts: list[list[int]], params: DecodeParams, conc: int,
           store: Callable, has_store: bool) -> None:
    """The prompts but the last, 16 at a time, after the last (untimed in the A/B)."""
    kw = {"prefix": store()} if has_store else {}
    eng = Engine(llm.model, SchedulerConfig(max_running=conc), **kw)
    *timed, prime = prompts
    eng.add_request(prime, params)
    eng.run()
    for q in timed:
        eng.add_request(q, params)
    eng.run()


def store_share(llm: LLM, prompts: list[list[int]], params: DecodeParams, conc: int,
                bs: int) -> float:
    """The share of a decode's CPU time spent in the store's offer and restore, timed without a
    profiler (which slows Python-heavy code more than the model's kernels); a new store, so its
    pool's memory is touched for the first time as blocks arrive."""
    from unmask.engine.prefix_store import PrefixStore

    spent = [0.0]

    class Timed(PrefixStore):
        def offer(self, b, leaving) -> None:
            t = time.process_time()
            super().offer(b, leaving)
            spent[0] += time.process_time() - t

        def restore(self, b, reqs) -> None:
            t = time.process_time()
            super().restore(b, reqs)
            spent[0] += time.process_time() - t

    t = time.process_time()
    decode(llm, prompts, params, conc, lambda: Timed(bs, 1 << 30), True)
    return spent[0] / (time.process_time() - t)


def cumulative(stats: dict, name: str, file: str) -> float:
    """Seconds inside the functions `name` of files ending with `file` (cProfile's cumulative)."""
    return sum(ct for (f, _, fn), (_, _, _, ct, _) in stats.items()
               if fn == name and f.endswith(file))


if __name__ == "__main__":
    main()
