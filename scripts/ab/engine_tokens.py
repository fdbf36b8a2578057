"""Whether an earlier commit's engine and this tree's decode the same: per request, its tokens,
NFE, token-forwards and cached prompt tokens, on a closed loop of clients (requests join a
batch already decoding and leave it as they finish), for several decoders on both shipped
models, the prefix store off and on where it applies. Prints a markdown table: per cell, the
engine steps and model calls of each tree and whether every request's numbers are the same.

    .venv/bin/python scripts/ab/engine_tokens.py REV [--n 16]

--n held-out math prompts a cell, a closed loop of CONCURRENCY clients, GEN_LENGTH tokens each.
REV is checked out into a temporary git worktree (scripts/ab/worktree.py); `--measure` decodes
every cell with the tree on PYTHONPATH and prints JSON. Nothing is timed: one torch thread.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worktree import rev_rounds  # noqa: E402

CONCURRENCY, GEN_LENGTH = 8, 32
SYSTEM = Path(__file__).resolve().parents[2] / "benchmarks/data/shared-system-prompt.txt"
# (model, decoder, prefix store): the server's default decoder, a rule committing several
# positions a step, FreeDave++ with caches, and LLaDA's cached decoders (entropy, dual)
CELLS = [("unmask-sdar", "static-1,early_exit=true", False),
         ("unmask-sdar", "static-1,early_exit=true", True),
         ("unmask-sdar", "threshold", True),
         ("unmask-sdar", "fast", True),
         ("unmask-llada", "static-1,early_exit=true", False),
         ("unmask-llada", "balanced", False),
         ("unmask-llada", "threshold,cache=dual", False),
         ("unmask-llada", "fast", False)]


def closed_loop(engine, prompts: list[list[int]], params, conc: int) -> list:
    """Every prompt decoded, `conc` at a time: the next is sent as soon as one finishes."""
    reqs = [engine.add_request(p, params) for p in prompts[:conc]]
    sent = len(reqs)
    while engine.has_unfinished:
        for ev in engine.step():
            if ev.finished and sent < len(prompts):
                reqs.append(engine.add_request(prompts[sent], params))
                sent += 1
    return reqs


def measure(n: int) -> dict:
    """Every cell decoded by the tree on PYTHONPATH."""
    import torch

    from unmask.api import LLM
    from unmask.bench.tasks import load_task
    from unmask.decoding.params import DecodeParams
    from unmask.engine import Engine, SchedulerConfig
    from unmask.engine.prefix_store import PrefixStore

    torch.set_num_threads(1)
    questions = [e.prompt for e in load_task("math", n, seed=0).examples]
    out = {}
    for name in dict.fromkeys(m for m, _, _ in CELLS):
        llm = LLM(name, device="cpu", prefix_cache=False)
        system = SYSTEM.read_text() if llm.config.block_size else None
        prompts = [llm.encode_messages(([{"role": "system", "content": system}] if system else [])
                                       + [{"role": "user", "content": q}]) for q in questions]
        for model, decoder, reuse in CELLS:
            if model != name:
                continue
            block = llm.config.block_size or min(GEN_LENGTH, 32)
            params = DecodeParams.parse(decoder, gen_length=GEN_LENGTH, block_length=block)
            store = PrefixStore(llm.config.block_size, 1 << 30) if reuse else None
            engine = Engine(llm.model, SchedulerConfig(max_running=CONCURRENCY), prefix=store)
            reqs = closed_loop(engine, prompts, params, CONCURRENCY)
            out[f"{model} {decoder} {'on' if reuse else 'off'}"] = dict(
                steps=sum(r.steps for r in reqs), model_calls=engine.model_calls,
                requests=[[r.token_ids, r.nfe, r.token_forwards, r.cached_tokens, r.finish_reason]
                          for r in reqs])
    return out


def report(args, runs: dict[str, list[dict]]) -> str:
    """The cells of the first round (decoding is deterministic: later rounds repeat it)."""
    before, after = runs["before"][0], runs["after"][0]
    lines = [f"Before: `{args.rev}`; after: this tree. {args.n} requests a cell, a closed loop "
             f"of {CONCURRENCY}, gen_length {GEN_LENGTH}; steps: the requests' engine steps "
             f"summed.\n",
             "| cell (model, decoder, prefix store) | steps before | after | model calls before | "
             "after | same tokens, NFE, token-forwards, cached tokens, finish |",
             "|:---|---:|---:|---:|---:|:---|"]
    for cell, b in before.items():
        a = after[cell]
        same = "yes" if a["requests"] == b["requests"] else "NO"
        lines.append(f"| {cell} | {b['steps']} | {a['steps']} | {b['model_calls']} | "
                     f"{a['model_calls']} | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    rev_rounds(str(Path(__file__).resolve()), __doc__, measure, report, default_rounds=1)
