"""How many engine steps and how much time a request waits for its first streamed token on a
busy engine: the tree on PYTHONPATH (or this one) runs a closed loop of `--concurrency` clients
on the engine alone (no server), each sending the next request as soon as its last finishes,
with the shared-prompt workload of scripts/bench/prefix_reuse.sh (the shared system prompt and
a math question, unmask-sdar's chat template, 32 tokens, `static-1,early_exit=true`, the server's
default decoder), prefix store on or off, one torch thread. Per request after the first wave:
engine steps from the step that admits it to the step that commits its first leading position
(what a stream can send), the wall time from its arrival to that step's end, and the useful
tokens of the finished requests per CPU-second of the loop (what the engine's throughput pays).

    PYTHONPATH=TREE .venv/bin/python scripts/probe/first_token_steps.py [--label NAME]

Run it once per tree and put the rows side by side (benchmarks/probe/first-token-steps.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from unmask.api import LLM
from unmask.bench.tasks import load_task
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine.prefix_store import PrefixStore

SYSTEM = Path(__file__).resolve().parents[2] / "benchmarks/data/shared-system-prompt.txt"


def closed_loop(llm: LLM, prompts: list[list[int]], params: DecodeParams, conc: int,
                n: int, store: PrefixStore | None
                ) -> tuple[list[int], list[float], list[float], float]:
    """Per request after the first `conc`: steps from admission to its first leading token and
    the seconds from its arrival to then; every step's seconds; and the useful tokens of the
    requests finished per CPU-second of the loop."""
    eng = Engine(llm.model, SchedulerConfig(max_running=conc), prefix=store)
    arrived: dict[str, tuple[float, int]] = {}  # request -> (arrival time, steps run before it)
    steps: list[int] = []
    waited: list[float] = []
    step_s: list[float] = []
    sent = 0
    finished = []

    def send() -> None:
        nonlocal sent
        req = eng.add_request(prompts[sent % len(prompts)], params)
        finished.append(req)
        arrived[req.request_id] = (time.perf_counter(), len(step_s))
        sent += 1

    for _ in range(conc):
        send()
    first: set[str] = set()
    done = 0
    cpu = time.process_time()
    while done < n:
        t0 = time.perf_counter()
        events = eng.step()
        t1 = time.perf_counter()
        step_s.append(t1 - t0)
        for ev in events:
            if ev.prefix > 0 and ev.request_id not in first:
                first.add(ev.request_id)
                at, before = arrived[ev.request_id]
                if sent > conc and before > 0:  # the first wave arrives at an idle engine
                    steps.append(len(step_s) - before)
                    waited.append(t1 - at)
            if ev.finished:
                done += 1
                send()
    cpu = time.process_time() - cpu
    return steps, waited, step_s, sum(r.useful for r in finished if r.finished) / cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="this tree")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--n", type=int, default=80, help="requests finished per run")
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM("unmask-sdar", device="cpu", prefix_cache=False)
    bs = llm.config.block_size
    system = SYSTEM.read_text()
    prompts = [llm.encode_messages([{"role": "system", "content": system},
                                    {"role": "user", "content": ex.prompt}])
               for ex in load_task("math", 100, seed=0).examples]
    params = DecodeParams.parse("static-1,early_exit=true", gen_length=32, block_length=bs)
    print(f"| tree | store | requests | steps to first token (count) | steps p50 | first token "
          f"p50 ms | step p50 ms | tokens / CPU-s |  <!-- concurrency {args.concurrency} -->")
    print("|:---|:---|---:|:---|---:|---:|---:|---:|")
    for mode in ("off", "on"):
        store = PrefixStore(bs, 1 << 30) if mode == "on" else None
        steps, waited, step_s, tps = closed_loop(llm, prompts, params, args.concurrency, args.n, store)
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(Counter(steps).items()))
        print(f"| {args.label} | {mode} | {len(steps)} | {counts} | "
              f"{statistics.median(steps):g} | {1000 * statistics.median(waited):.1f} | "
              f"{1000 * statistics.median(step_s):.1f} | {tps:.0f} |")


if __name__ == "__main__":
    main()
