"""Attention at each row's exact shape against the canonical (padded) shapes, side by side: how
far an engine call is from the plain forward of the same canvas, and what each costs.

    .venv/bin/python scripts/probe/varlen_attention.py [--part diff|cost|both] [--n 16] [--rounds 3]
        [--clock wall|cpu] [--decoder SPEC ...]

diff: held-out math prompts on the shipped model, decoded without a cache (`static-1`,
`threshold`) at engine concurrency 1 and 16 (rows of different lengths), float32 and bfloat16.
At every model call each row's scored logits are compared with the plain forward (no frame,
batch 1: the reference's forward, bit for bit; tests/test_models.py) of that row's forwarded
tokens: the max |logit diff| over the call, the share of calls bit-identical, and the scored
positions whose top token differs.

cost: 32 prompts at gen_length 256, one thread, all submitted to one Engine with max_running =
the concurrency; useful tokens/s (up to the first EOS) over the wall time; cells interleaved
over --rounds rounds, medians; asserts the tokens are identical across the two shapes.
--clock cpu: this thread's CPU seconds in place of wall seconds (one torch thread: the whole
decode runs on it), for a machine shared with other work. --decoder: the cost part's decoders.
Prints markdown on stdout (benchmarks/probe/varlen-attention.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from unmask import LLM
from unmask.api import useful_length
from unmask.decoding.params import DecodeParams
from unmask.engine import decode
from unmask.engine.runner import Runner, shape_groups
from unmask.tasks import TASKS

SHAPES = ("canonical", "exact")  # before, after
DIFF_SPECS = ("static-1", "threshold")
COST_SPECS = ("fast", "threshold", "threshold,cache=entropy")
CALL = Runner._call
STATS: dict[str, list] = {"diff": [], "flips": [], "scored": [], "groups": []}
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


def compared_call(self, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks, rows, cols):
    """The runner's model call, each row's logits held against its plain forward."""
    logits, fresh, at = CALL(self, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks, rows, cols)
    worst = 0.0
    for i in np.unique(rows):
        n = int(ok[i].sum())
        ref = self.model(ids[i : i + 1, :n], pos[i : i + 1, :n])[0]
        mine = torch.from_numpy(rows == i)
        got, want = logits[mine].float(), ref[torch.from_numpy(cols[rows == i])].float()
        worst = max(worst, (got - want).abs().max().item())
        STATS["flips"].append(int((got.argmax(-1) != want.argmax(-1)).sum()))
        STATS["scored"].append(int(mine.sum()))
    STATS["diff"].append(worst)
    return logits, fresh, at


def counted_call(self, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks, rows, cols):
    k_hat = past.shape if past is not None else 0 * n_tokens
    STATS["groups"].append(len(shape_groups(t_hat, k_hat)))
    return CALL(self, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks, rows, cols)


def decode_all(llm: LLM, prompts: list[list[int]], spec: str, concurrency: int, shapes: str,
               gen: int) -> tuple[float, list]:
    """(useful tokens/s, the requests) of the prompts decoded at this concurrency and shape."""
    Runner.attention_shapes = shapes
    params = DecodeParams.parse(spec, gen_length=gen)
    start = clock()
    with torch.no_grad():
        reqs = decode(llm.model, params, prompts, max_running=concurrency)
    wall = clock() - start
    eos = llm.config.eos_token_id
    return sum(useful_length(r.token_ids, eos) for r in reqs) / wall, reqs


def diff_table(n: int, gen: int) -> None:
    Runner._call = compared_call
    print("| decoder | dtype | concurrency | shapes | calls | bit-identical calls | "
          "max \\|logit diff\\| | median per-call max | top token differs / scored |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype)
        prompts = [llm.encode_prompt(e.prompt) for e in TASKS["math"].load("heldout", n)]
        for spec in DIFF_SPECS:
            for conc in (1, 16):
                for shapes in SHAPES:
                    for v in STATS.values():
                        v.clear()
                    decode_all(llm, prompts, spec, conc, shapes, gen)
                    d = np.array(STATS["diff"])
                    print(f"| `{spec}` | {dtype} | {conc} | {shapes} | {d.size} | "
                          f"{(d == 0).mean():.1%} | {d.max():.3g} | {np.median(d):.3g} | "
                          f"{sum(STATS['flips'])} / {sum(STATS['scored'])} |", flush=True)
    Runner._call = CALL
    print(f"\n{n} held-out math prompts, gen_length {gen}, block_length 32, no cache; "
          "one thread")


def cost_table(rounds: int, specs: list[str]) -> None:
    Runner._call = counted_call
    llm = LLM()
    prompts = [llm.encode_prompt(e.prompt) for e in TASKS["math"].load("heldout", 32)]
    cells = [(s, c, v) for s in specs for c in (1, 16) for v in SHAPES]
    tps: dict[tuple, list[float]] = {}
    tokens: dict[tuple, list[list[int]]] = {}
    groups: dict[tuple, float] = {}
    for rnd in range(rounds):
        for i in range(len(cells)):
            cell = cells[(i + rnd) % len(cells)]
            STATS["groups"].clear()
            value, reqs = decode_all(llm, prompts, *cell, 256)
            tokens[cell] = [r.token_ids for r in reqs]
            groups[cell] = statistics.mean(STATS["groups"])
            tps.setdefault(cell, []).append(value)
    Runner._call = CALL
    unit = "useful tokens/s" if clock is CLOCKS["wall"] else "useful tokens/CPU-s"
    print(f"| decoder | concurrency | shapes | {unit} | exact / canonical "
          "(range of rounds) | groups a call |")
    print("|---|---:|---|---:|---:|---:|")
    for cell in cells:
        s, c, shapes = cell
        v = statistics.median(tps[cell])
        base = tps[(s, c, "canonical")]
        ratio = [a / b for a, b in zip(tps[cell], base, strict=True)]
        rel = (f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})"
               if shapes == "exact" else "")
        print(f"| `{s}` | {c} | {shapes} | {v:.1f} | {rel} | {groups[cell]:.2f} |")
    assert all(tokens[cell] == tokens[(cell[0], cell[1], "canonical")] for cell in cells)
    print(f"\n{rounds} rounds, medians (ratios within a round); tokens identical across shapes")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("diff", "cost", "both"), default="both")
    p.add_argument("--n", type=int, default=16, help="prompts for the diff part")
    p.add_argument("--gen-length", type=int, default=64, help="for the diff part")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    p.add_argument("--decoder", action="append", help=f"cost part (default: {COST_SPECS})")
    args = p.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    if args.part in ("diff", "both"):
        diff_table(args.n, args.gen_length)
    if args.part in ("cost", "both"):
        print()
        cost_table(args.rounds, args.decoder or list(COST_SPECS))


if __name__ == "__main__":
    main()
