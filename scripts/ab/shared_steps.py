"""Engine steps with a shared system prompt, an earlier commit against this tree, side by side
(BENCHMARKS.md, "Prefix reuse"): the shipped SDAR model, the prefix store on, one torch thread,
CPU milliseconds of the engine's thread per step, the two trees in alternation for --rounds
rounds; ratios taken within a round, then their median and range.

- steady: 16 requests decoding at once, each replaced as soon as it finishes (the server's
  closed loop at concurrency 16): the median step, those that admit a request ("admit") and
  those that do not ("plain") apart.
- burst: then 16 requests added at once to the idle engine, whose store holds the system
  prompt: the step that admits them all (the median of six bursts).

Each question is the shared ~540-token system prompt (scripts/bench/prefix_reuse_cpu.py) and a
held-out math question through the chat template, gen_length 32, `static-1,early_exit=true`
(the server's default decoder). The generated tokens are compared (their digest).

    .venv/bin/python scripts/ab/shared_steps.py REV [--rounds 5] [--n 48]
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from pathlib import Path

from worktree import ratio_range, rev_rounds

BURSTS = 6
DECODER = "static-1,early_exit=true"


def measure(n: int) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from prefix_reuse_cpu import SYSTEM

    from unmask.api import LLM
    from unmask.bench.tasks import load_task
    from unmask.decoding.params import DecodeParams
    from unmask.engine.engine import Engine
    from unmask.engine.prefix_store import PrefixStore
    from unmask.engine.scheduler import SchedulerConfig

    torch.set_num_threads(1)
    llm = LLM("unmask-sdar", device="cpu", prefix_cache=False)
    bs = llm.config.block_size
    system = SYSTEM.read_text().strip()
    questions = [e.prompt for e in load_task("math", n + 16 * BURSTS + 1, seed=0).examples]
    prompts = [llm.encode_messages([{"role": "system", "content": system},
                                    {"role": "user", "content": q}]) for q in questions]
    params = DecodeParams.parse(DECODER, gen_length=32, block_length=bs)

    def engine() -> Engine:
        eng = Engine(llm.model, SchedulerConfig(max_running=16), prefix=PrefixStore(bs, 1 << 30))
        eng.add_request(prompts[-1], params)  # the system prompt into the store
        eng.run()
        return eng

    def step(eng: Engine) -> float:
        t = time.thread_time()
        eng.step()
        return (time.thread_time() - t) * 1e3

    eng = engine()
    queue, done = list(prompts[:n]), []
    live = [eng.add_request(queue.pop(0), params) for _ in range(16)]
    admit, plain, joined = [], [], False
    while eng.has_unfinished:
        ms = step(eng)
        if queue:  # the batch is full: a steady step
            (admit if joined else plain).append(ms)
        joined = False
        for i, r in enumerate(live):
            if r.status == "finished" and r not in done:
                done.append(r)
                if queue:
                    live[i] = eng.add_request(queue.pop(0), params)
                    joined = True
    burst = []
    for b in range(BURSTS):  # the same engine, idle now: its pool and store as a server's
        reqs = [eng.add_request(p, params) for p in prompts[n + 16 * b : n + 16 * (b + 1)]]
        burst.append(step(eng))
        eng.run()
        done += reqs
    digest = hashlib.sha256(str([r.token_ids for r in done]).encode()).hexdigest()[:12]
    return {"steady": statistics.median(admit + plain), "admit": statistics.median(admit),
            "plain": statistics.median(plain), "burst": statistics.median(burst),
            "tokens": digest}


def report(args, runs: dict[str, list[dict]]) -> str:
    b, a = runs["before"], runs["after"]
    same = all(x["tokens"] == y["tokens"] for x, y in zip(b, a, strict=True))
    lines = [f"`scripts/ab/shared_steps.py {args.rev} --rounds {args.rounds} --n {args.n}` "
             f"(CPU ms of the engine's thread a step, medians; same tokens: {same})", "",
             "| step | before ms | after ms | after / before, median [range] |",
             "|:---|---:|---:|---:|"]
    for key in ("steady", "plain", "admit", "burst"):
        before, after = [r[key] for r in b], [r[key] for r in a]
        lines.append(f"| {key} | {statistics.median(before):.2f} | {statistics.median(after):.2f} "
                     f"| {ratio_range(after, before)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    rev_rounds(__file__, __doc__, measure, report, default_rounds=5)
