"""Side by side: the runner's padding split on and off, at engine concurrency 1 and 16.

    .venv/bin/python scripts/engine_split.py

32 held-out math prompts at gen_length 256, all submitted to one Engine with max_running = the
concurrency; useful tokens/s (up to the first EOS) over the wall time; cells interleaved over 2
rounds, medians; asserts the tokens are identical in every cell (BENCHMARKS.md, "Engine
batching").
"""

from __future__ import annotations

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


def run(llm: LLM, prompts: list[list[int]], spec: str, concurrency: int,
        split: bool) -> tuple[float, list[list[int]]]:
    Runner._split = staticmethod(REAL_SPLIT if split else (lambda n_tokens: None))
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
    torch.set_num_threads(1)
    llm = LLM()
    prompts = [llm.encode_prompt(e.prompt) for e in TASKS["math"].load("heldout", 32)]
    cells = [(s, c, sp) for s in SPECS for c in (1, 16) for sp in (False, True)]
    tps: dict[tuple, list[float]] = {}
    tokens: dict[tuple, list[list[int]]] = {}
    for rnd in range(2):
        for i in range(len(cells)):
            cell = cells[(i + rnd) % len(cells)]
            value, tokens[cell] = run(llm, prompts, *cell)
            tps.setdefault(cell, []).append(value)
    print("| decoder | concurrency | split | useful tokens/s | x vs concurrency 1 (no split) |")
    print("|---|---|---|---|---|")
    for s in SPECS:
        base = statistics.median(tps[(s, 1, False)])
        for c in (1, 16):
            for sp in (False, True):
                v = statistics.median(tps[(s, c, sp)])
                print(f"| `{s}` | {c} | {'on' if sp else 'off'} | {v:.1f} | {v / base:.2f} |")
        assert all(tokens[(s, c, sp)] == tokens[(s, 1, False)] for c in (1, 16) for sp in (0, 1))
    print("\ntokens identical in every cell")


if __name__ == "__main__":
    main()
