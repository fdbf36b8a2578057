"""Side by side: the runner's two answers to padding, packing and attention row groups, each on
and off, at engine concurrency 1 and 16.

    .venv/bin/python scripts/engine_padding.py [--rounds 2] [--model DIR] [--device D]
        [--group-cost-only] [--group-cost-widths 128x4,512x8,1024x8]

32 held-out math prompts at gen_length 256, all submitted to one Engine with max_running = the
concurrency; useful tokens/s (up to the first EOS) over the wall time; cells interleaved over
--rounds rounds, medians; asserts the tokens are identical in every cell (BENCHMARKS.md, "Engine
batching"). The attention pairs column is an operation count the machine's noise does not move:
the (query, key) pairs attention computes, padding included, over those it needs (each row's
tokens x (its tokens + its stored keys)), summed over the cell's model calls.

First it measures what `Runner.group_cost` stands for, on the model alone: the time one more
attention group adds to a call (8 identical rows, 30 tokens and 100 stored keys each, as one,
two and four groups: a cut that saves no pairs) over the time one more (query, key) pair adds
(the same call with 300 stored keys), medians of rounds (thread CPU time; wall time after a
synchronize on a GPU). Both costs depend on the model's shape and the device: --model and
--device measure another pair, and --group-cost-only stops there. --group-cost-widths measures
it on random 4-layer LLaDA models of each d_model x n_heads instead, and stops.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from unmask import LLM
from unmask.api import useful_length
from unmask.config import ModelConfig
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine import runner as runner_mod
from unmask.engine.runner import Past, Runner, _pairs
from unmask.kv import KVStore
from unmask.models import build_model
from unmask.suffix import make_suffix_policy
from unmask.tasks import TASKS

SPECS = ("fast", "threshold,cache=entropy")
GROUP_COST = Runner.group_cost
PACK_MIN_PADDING = Runner.pack_min_padding
NEVER = 2.0  # pack_min_padding above 100%: no call is packed for its padding
GROUPS = runner_mod.attention_groups
PAIRS = [0, 0]  # (computed, needed) attention pairs of the cell being run


def counted_groups(n_tokens, n_past, cost):
    groups = GROUPS(n_tokens, n_past, cost)
    PAIRS[0] += sum(_pairs(n_tokens[g], n_past[g]) for g in groups)
    PAIRS[1] += int((n_tokens * (n_tokens + n_past)).sum())
    return groups


runner_mod.attention_groups = counted_groups


def run(llm: LLM, prompts: list[list[int]], spec: str, concurrency: int,
        groups: bool, pack: float) -> tuple[float, list[list[int]], float]:
    # One attention group (group_cost inf) leaves packing to pack_min_padding alone; several
    # groups always go packed.
    Runner.group_cost = GROUP_COST if groups else float("inf")
    Runner.pack_min_padding = pack
    params = DecodeParams.parse(spec, gen_length=256)
    engine = Engine(llm.model, SchedulerConfig(max_running=concurrency))
    reqs = [engine.add_request(q, params) for q in prompts]
    PAIRS[:] = [0, 0]
    start = time.perf_counter()
    with torch.no_grad():
        while engine.has_unfinished:
            engine.step()
    wall = time.perf_counter() - start
    eos = llm.config.eos_token_id
    return (sum(useful_length(r.token_ids, eos) for r in reqs) / wall, [r.token_ids for r in reqs],
            PAIRS[0] / PAIRS[1])


def group_cost(model: torch.nn.Module, rounds: int = 5, reps: int = 30) -> str:
    c = model.config
    params = DecodeParams.parse("fast", gen_length=256)
    runner = Runner(model, params, c.mask_token_id, c.eos_token_id, make_suffix_policy(params))
    weight = next(model.parameters())
    store = KVStore.empty(c.n_layers, 8, c.n_kv_heads, 512, c.head_dim, weight.dtype,
                          weight.device)
    store.kv.normal_()
    cuda = weight.device.type == "cuda"
    clock = time.perf_counter if cuda else time.thread_time

    def call(n_past: int, n_groups: int) -> float:  # median thread seconds of one call
        r, t = 8, 30
        ok = np.ones((r, t), dtype=bool)
        ids = torch.randint(3, c.vocab_size, (r, t), device=weight.device)
        pos = torch.arange(t, device=weight.device).repeat(r, 1) + n_past
        past = Past(store, np.arange(r), np.tile(np.arange(n_past), (r, 1)),
                    np.ones((r, n_past), dtype=bool))
        rows, cols = np.nonzero(ok)
        groups = np.array_split(np.arange(r), n_groups)
        runner_mod.attention_groups = lambda *a: groups
        times = []
        with torch.no_grad():
            for _ in range(reps):
                t0 = clock()
                runner._call(ids, pos, ok, None, past, rows, cols)
                if cuda:
                    torch.cuda.synchronize()
                times.append(clock() - t0)
        return statistics.median(times)

    per_group, per_pair = [], []
    try:
        for _ in range(rounds):
            one, two, four = call(100, 1), call(100, 2), call(100, 4)
            per_group += [two - one, (four - one) / 3]
            per_pair.append((call(300, 1) - one) / (8 * 30 * 200))
    finally:
        runner_mod.attention_groups = counted_groups
    g, p = statistics.median(per_group), statistics.median(per_pair)
    return (f"One more attention group: {1e6 * g:.0f} us a call; one more (query, key) pair: "
            f"{1e9 * p:.1f} ns (all layers); a group costs {g / p:.0f} pairs "
            f"(`Runner.group_cost` is {GROUP_COST:.0f}).")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", help="checkpoint folder (default: the embedded model)")
    p.add_argument("--device")
    p.add_argument("--group-cost-only", action="store_true")
    p.add_argument("--group-cost-widths", help="e.g. 128x4,512x8: d_model x n_heads")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.group_cost_widths:
        for width in args.group_cost_widths.split(","):
            d, h = (int(v) for v in width.split("x"))
            torch.manual_seed(0)
            model = build_model(ModelConfig(
                model_type="llada", d_model=d, n_heads=h, n_kv_heads=h, n_layers=4,
                mlp_hidden_size=3 * d, vocab_size=2048, embedding_size=2048, mask_token_id=2,
                eos_token_id=1, max_sequence_length=2048)).eval()
            print(f"d_model {d}, {h} heads x {d // h}: {group_cost(model)}")
        return
    llm = LLM(args.model, device=args.device)
    print(group_cost(llm.model), "\n")
    if args.group_cost_only:
        return
    prompts = [llm.encode_prompt(e.prompt) for e in TASKS["math"].load("heldout", 32)]
    # (row groups, pack calls with at least this share of padding; NEVER, 0.0: any padding)
    variants = [(False, NEVER), (False, 0.0), (False, PACK_MIN_PADDING), (True, 0.0),
                (True, PACK_MIN_PADDING)]
    cells = [(s, c, *v) for s in SPECS for c in (1, 16) for v in (variants if c > 1 else variants[:1])]
    tps: dict[tuple, list[float]] = {}
    tokens: dict[tuple, list[list[int]]] = {}
    pairs: dict[tuple, float] = {}
    for rnd in range(args.rounds):
        for i in range(len(cells)):
            cell = cells[(i + rnd) % len(cells)]
            value, tokens[cell], pairs[cell] = run(llm, prompts, *cell)
            tps.setdefault(cell, []).append(value)
    print("| decoder | concurrency | row groups | packed for padding | useful tokens/s | "
          "x vs concurrency 1 | attention pairs computed / needed |")
    print("|---|---|---|---|---|---|---|")
    group_label = {False: "off (one)", True: "on"}
    pack_label = {NEVER: "never", 0.0: "any padding", PACK_MIN_PADDING: f">= {PACK_MIN_PADDING:.0%}"}
    for cell in cells:
        s, c, gr, pk = cell
        v = statistics.median(tps[cell])
        base = statistics.median(tps[(s, 1, False, NEVER)])
        default = " **(default)**" if gr and pk == PACK_MIN_PADDING else ""
        print(f"| `{s}` | {c} | {group_label[gr]} | {pack_label[pk]}{default} | {v:.1f} | "
              f"{v / base:.2f} | {pairs[cell]:.2f} |")
    assert all(tokens[cell] == tokens[(cell[0], 1, False, NEVER)] for cell in cells)
    print(f"\n{args.rounds} rounds, medians; tokens identical in every cell")


if __name__ == "__main__":
    main()
