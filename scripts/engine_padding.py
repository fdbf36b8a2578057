"""Side by side: the runner's two answers to padding, packing and the split, each on and off,
at engine concurrency 1 and 16.

    .venv/bin/python scripts/engine_padding.py [--rounds 2]

32 held-out math prompts at gen_length 256, all submitted to one Engine with max_running = the
concurrency; useful tokens/s (up to the first EOS) over the wall time; cells interleaved over
--rounds rounds, medians; asserts the tokens are identical in every cell (BENCHMARKS.md, "Engine
batching").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from unmask import LLM
from unmask.api import useful_length
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine.runner import Runner
from unmask.tasks import TASKS

SPECS = ("fast", "threshold,cache=entropy")
REAL_SPLIT = Runner._split
PACK_MIN_PADDING = Runner.pack_min_padding


def run(llm: LLM, prompts: list[list[int]], spec: str, concurrency: int,
        split: bool, pack: float) -> tuple[float, list[list[int]]]:
    Runner._split = staticmethod(REAL_SPLIT if split else (lambda n_tokens: None))
    Runner.pack_min_padding = pack
    params = DecodeParams.parse(spec, gen_length=256)
    engine = Engine(llm.model, SchedulerConfig(max_running=concurrency))
    reqs = [engine.add_request(q, params) for q in prompts]
    start = time.perf_counter()
    with torch.no_grad():
        while engine.has_unfinished:
            engine.step()
    wall = time.perf_counter() - start
    eos = llm.config.eos_token_id
    return sum(useful_length(r.token_ids, eos) for r in reqs) / wall, [r.token_ids for r in reqs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM()
    prompts = [llm.encode_prompt(e.prompt) for e in TASKS["math"].load("heldout", 32)]
    # (split, pack calls with at least this share of padding; 1.0: never, 0.0: any padding)
    packs = (1.0, 0.0, PACK_MIN_PADDING)
    variants = [(sp, pk) for sp in (False, True) for pk in packs]
    cells = [(s, c, *v) for s in SPECS for c in (1, 16) for v in (variants if c > 1 else variants[:1])]
    tps: dict[tuple, list[float]] = {}
    tokens: dict[tuple, list[list[int]]] = {}
    for rnd in range(args.rounds):
        for i in range(len(cells)):
            cell = cells[(i + rnd) % len(cells)]
            value, tokens[cell] = run(llm, prompts, *cell)
            tps.setdefault(cell, []).append(value)
    print("| decoder | concurrency | split | packed | useful tokens/s | x vs concurrency 1 |")
    print("|---|---|---|---|---|---|")
    # (two dicts: False == 0.0 and True == 1.0 as dict keys)
    split_label = {False: "off", True: "on"}
    pack_label = {1.0: "never", 0.0: "any padding",
                  PACK_MIN_PADDING: f"padding >= {PACK_MIN_PADDING:.0%} (default)"}
    for cell in cells:
        s, c, sp, pk = cell
        v = statistics.median(tps[cell])
        base = statistics.median(tps[(s, 1, False, 1.0)])
        print(f"| `{s}` | {c} | {split_label[sp]} | {pack_label[pk]} | {v:.1f} | {v / base:.2f} |")
    assert all(tokens[cell] == tokens[(cell[0], 1, False, 1.0)] for cell in cells)
    print(f"\n{args.rounds} rounds, medians; tokens identical in every cell")


if __name__ == "__main__":
    main()
