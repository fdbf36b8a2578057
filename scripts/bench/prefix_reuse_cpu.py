"""Prefix reuse on vs off in one process, in CPU time (tokens per CPU-second of the decoding
thread, which other processes on a shared machine do not move): the shipped SDAR model, one
torch thread, 16 requests at a time, the engine without HTTP.

    .venv/bin/python scripts/bench/prefix_reuse_cpu.py [--rounds 3] [--n 16]

Workloads: "shared" (the ~540-token system prompt of benchmarks/data/shared-system-prompt.txt +
a held-out math question each), "nothing" (the questions alone: they share only the chat
template's first tokens), each after one untimed request of another question (a server's steady
state: the store has seen an earlier request), "4 turns" (conversations whose turn k resends
the questions and the answers so far; the turns of all conversations run together, one turn
after another). Each
round runs every workload off (no store) and on (a new, empty store), in turn first, so no round
is warmed by another; ratios are taken within a round, then their median (range in brackets).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from unmask.api import LLM
from unmask.bench.tasks import load_task
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine.prefix_store import PrefixStore

SYSTEM = Path(__file__).resolve().parents[2] / "benchmarks/data/shared-system-prompt.txt"


def decode(llm: LLM, prompts: list[list[int]], params: DecodeParams,
           store: PrefixStore | None, prime: list[int] | None = None, at_once: int = 16,
           ) -> tuple[float, int, list[list[int]]]:
    """(CPU seconds, useful tokens, token ids) of the prompts decoded `at_once` at a time, after
    `prime` (untimed: a server in its steady state has seen an earlier request)."""
    eng = Engine(llm.model, SchedulerConfig(max_running=at_once), prefix=store)
    if prime is not None:
        eng.add_request(prime, params)
        eng.run()
    reqs = [eng.add_request(p, params) for p in prompts]
    t = time.process_time()
    eng.run()
    return time.process_time() - t, sum(r.useful for r in reqs), [r.token_ids for r in reqs]


def conversations(llm: LLM, questions: list[list[str]], params: DecodeParams,
                  store: PrefixStore | None) -> tuple[float, int, list[list[int]]]:
    """Turn by turn: each conversation's turn k is its questions and answers so far."""
    history: list[list[dict]] = [[] for _ in questions]
    cpu, useful, ids = 0.0, 0, []
    for k in range(len(questions[0])):
        for h, qs in zip(history, questions, strict=True):
            h.append({"role": "user", "content": qs[k]})
        c, u, out = decode(llm, [llm.encode_messages(h) for h in history], params, store)
        cpu, useful, ids = cpu + c, useful + u, ids + out
        for h, answer in zip(history, out, strict=True):
            text = llm.detokenize(answer[: answer.index(llm.config.eos_token_id)]
                                  if llm.config.eos_token_id in answer else answer)
            h.append({"role": "assistant", "content": text})
    return cpu, useful, ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM("unmask-sdar", device="cpu", prefix_cache=False)
    bs = llm.config.block_size
    params = DecodeParams.parse("threshold", gen_length=32, block_length=bs)
    qs = [ex.prompt for ex in load_task("math", args.n * 4 + 1, seed=0).examples]
    system = SYSTEM.read_text().strip()
    shared = [llm.encode_messages([{"role": "system", "content": system},
                                   {"role": "user", "content": q}]) for q in qs[: args.n]]
    alone = [llm.encode_messages([{"role": "user", "content": q}]) for q in qs[: args.n]]
    prime = qs[-1]  # a question none of the timed requests asks
    primes = {"shared": llm.encode_messages([{"role": "system", "content": system},
                                             {"role": "user", "content": prime}]),
              "nothing": llm.encode_messages([{"role": "user", "content": prime}])}
    turns = [qs[i * 4 : i * 4 + 4] for i in range(args.n)]
    runs = {"shared": lambda s: decode(llm, shared, params, s, primes["shared"]),
            "nothing": lambda s: decode(llm, alone, params, s, primes["nothing"]),
            "4 turns": lambda s: conversations(llm, turns, params, s)}
    rates: dict = {(w, m): [] for w in runs for m in ("off", "on")}
    same: dict = {w: True for w in runs}
    for rnd in range(args.rounds):
        for w, run in runs.items():
            if rnd % 2:  # rotated: neither always runs first
                on = run(PrefixStore(bs, 1 << 30))
                off = run(None)
            else:
                off = run(None)
                on = run(PrefixStore(bs, 1 << 30))
            rates[(w, "off")].append(off[1] / off[0])
            rates[(w, "on")].append(on[1] / on[0])
            same[w] &= off[2] == on[2]
    print(f"Generated by `python scripts/bench/prefix_reuse_cpu.py --rounds {args.rounds} --n "
          f"{args.n}` (unmask-sdar, one thread, 16 at a time, threshold, 32 generated): useful "
          f"tokens per CPU-second, medians of {args.rounds} rounds.\n")
    print("| workload | off | on | on / off | same tokens |")
    print("|:---|---:|---:|:---|:---|")
    for w in runs:
        print(f"| {w} | {side_by_side(rates[(w, 'off')], rates[(w, 'on')])} | "
              f"{'yes' if same[w] else 'NO'} |")


def side_by_side(off: list[float], on: list[float]) -> str:
    """Table cells: the median of each, and the median (range) of the rounds' on / off."""
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    return (f"{statistics.median(off):.0f} | {statistics.median(on):.0f} | "
            f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]")


if __name__ == "__main__":
    main()
