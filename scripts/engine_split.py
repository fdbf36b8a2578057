"""Side by side: the runner's padding split on and off, at engine concurrency 1 and 16.

    .venv/bin/python scripts/engine_split.py

32 held-out math prompts at gen_length 256, all submitted to one Engine with max_running = the
concurrency; useful tokens/s (up to the first EOS) over the wall time; cells interleaved over 2
rounds, medians; asserts the tokens are identical in every cell (BENCHMARKS.md, "Engine
batching").
"""

import statistics
import time

import torch

torch.set_num_threads(1)
from unmask import LLM
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine.runner import Runner
from unmask.tasks import TASKS

llm = LLM(); m = llm.model
prompts = [llm.encode_prompt(e.prompt) for e in TASKS["math"].load("heldout", 32)]
real_split = Runner._split
def run(spec, conc, split):
    Runner._split = staticmethod(real_split) if split else staticmethod(lambda n: None)
    p = DecodeParams.parse(spec, gen_length=256)
    eng = Engine(m, SchedulerConfig(max_running=conc))
    reqs = [eng.add_request(q, p) for q in prompts]
    t = time.perf_counter()
    with torch.no_grad():
        while eng.has_unfinished: eng.step()
    wall = time.perf_counter() - t
    eos = m.config.eos_token_id
    useful = sum((r.token_ids.index(eos) if eos in r.token_ids else len(r.token_ids)) for r in reqs)
    return useful / wall, [r.token_ids for r in reqs]
res = {}
cells = [(s, c, sp) for s in ("fast", "threshold,cache=entropy") for c in (1, 16) for sp in (False, True)]
for rnd in range(2):
    for i in range(len(cells)):
        cell = cells[(i + rnd) % len(cells)]
        tps, toks = run(*cell)
        res.setdefault(cell, []).append(tps)
        res.setdefault(("toks",) + cell, toks)
for s in ("fast", "threshold,cache=entropy"):
    base = statistics.median(res[(s, 1, False)])
    for c in (1, 16):
        for sp in (False, True):
            v = statistics.median(res[(s, c, sp)])
            print(f"{s:26s} conc={c:2d} split={sp!s:5s} useful tok/s={v:8.1f}  x vs conc1={v/base:.2f}")
    assert res[("toks", s, 16, True)] == res[("toks", s, 1, False)]
print("tokens identical across cells")
