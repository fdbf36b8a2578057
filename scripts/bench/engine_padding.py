"""Side by side: what the runner's padding costs, at engine concurrency 1 and 16, with calls
packed for padding (the default, >= `Runner.pack_min_padding`), for any padding, and never.

    .venv/bin/python scripts/bench/engine_padding.py [--rounds 2] [--model DIR] [--device D]

32 held-out math prompts at gen_length 256, all submitted to one Engine with max_running = the
concurrency; useful tokens/s (up to the first EOS) over the wall time; cells interleaved over
--rounds rounds, medians; asserts the tokens are identical in every cell (BENCHMARKS.md, "Engine
batching"). The other columns are operation counts the machine's noise does not move, summed
over the cell's model calls:

- attention pairs computed / needed: the (query, key) pairs attention computes, each row at its
  canonical shape (`unmask.engine.runner.canonical_tokens`, `canonical_keys`), over those its
  rows need (each row's tokens x (its tokens + its stored keys));
- groups a call: the attention batches (`shape_groups`) of a model call, on average;
- tokens forwarded / needed: the tokens the projections and MLPs see (padded rows, or packed
  real tokens plus those added up to the runner's `ProductRows.blocks`) over the rows' real tokens.
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
from unmask.engine.runner import Runner, shape_groups
from unmask.tasks import TASKS

SPECS = ("fast", "threshold,cache=entropy")
PACK_MIN_PADDING = Runner.pack_min_padding
NEVER = 2.0  # pack_min_padding above 100%: no call is packed for its padding alone
COUNTS = {"pairs": 0, "needed": 0, "groups": 0, "calls": 0, "forwarded": 0, "tokens": 0}
CALL = Runner._call


def counted_call(self, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks, rows, cols):
    n_past = past.n if past is not None else 0 * n_tokens
    k_hat = past.shape if past is not None else 0 * n_tokens
    groups = shape_groups(t_hat, k_hat)
    n = int(n_tokens.sum())
    r, t = ok.shape
    unpacked = self.unpacked(len(groups), r, t, n)
    COUNTS["pairs"] += int((t_hat * (t_hat + k_hat)).sum())
    COUNTS["needed"] += int((n_tokens * (n_tokens + n_past)).sum())
    COUNTS["groups"] += len(groups)
    COUNTS["calls"] += 1
    COUNTS["forwarded"] += r * t if unpacked else max(n, self.rows.blocks)
    COUNTS["tokens"] += n
    return CALL(self, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks, rows, cols)


Runner._call = counted_call


def run(llm: LLM, prompts: list[list[int]], spec: str, concurrency: int,
        pack: float) -> tuple[float, list[list[int]], dict[str, int]]:
    Runner.pack_min_padding = pack
    params = DecodeParams.parse(spec, gen_length=256)
    engine = Engine(llm.model, SchedulerConfig(max_running=concurrency))
    reqs = [engine.add_request(q, params) for q in prompts]
    COUNTS.update(dict.fromkeys(COUNTS, 0))
    start = time.perf_counter()
    with torch.no_grad():
        while engine.has_unfinished:
            engine.step()
    wall = time.perf_counter() - start
    eos = llm.config.eos_token_id
    return (sum(useful_length(r.token_ids, eos) for r in reqs) / wall, [r.token_ids for r in reqs],
            dict(COUNTS))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    p.add_argument("--device")
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, device=args.device)
    prompts = [llm.encode_prompt(e.prompt) for e in TASKS["math"].load("heldout", 32)]
    variants = (PACK_MIN_PADDING, 0.0, NEVER)
    cells = [(s, c, v) for s in SPECS for c in (1, 16) for v in variants]
    tps: dict[tuple, list[float]] = {}
    tokens: dict[tuple, list[list[int]]] = {}
    counts: dict[tuple, dict[str, int]] = {}
    for rnd in range(args.rounds):
        for i in range(len(cells)):
            cell = cells[(i + rnd) % len(cells)]
            value, tokens[cell], counts[cell] = run(llm, prompts, *cell)
            tps.setdefault(cell, []).append(value)
    print("| decoder | concurrency | packed for padding | useful tokens/s | x vs concurrency 1 | "
          "attention pairs computed / needed | groups a call | tokens forwarded / needed |")
    print("|---|---|---|---|---|---|---|---|")
    label = {NEVER: "never", 0.0: "any padding", PACK_MIN_PADDING: f">= {PACK_MIN_PADDING:.0%}"}
    for cell in cells:
        s, c, pk = cell
        v = statistics.median(tps[cell])
        base = statistics.median(tps[(s, 1, PACK_MIN_PADDING)])
        n = counts[cell]
        default = " **(default)**" if pk == PACK_MIN_PADDING else ""
        print(f"| `{s}` | {c} | {label[pk]}{default} | {v:.1f} | {v / base:.2f} | "
              f"{n['pairs'] / n['needed']:.2f} | {n['groups'] / n['calls']:.2f} | "
              f"{n['forwarded'] / n['tokens']:.2f} |")
    assert all(tokens[cell] == tokens[(cell[0], 1, PACK_MIN_PADDING)] for cell in cells)
    print(f"\n{args.rounds} rounds, medians; tokens identical in every cell")


if __name__ == "__main__":
    main()
