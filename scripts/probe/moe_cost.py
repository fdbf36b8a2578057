"""A mixture-of-experts forward against a dense model of the same active size, one thread.

    python scripts/probe/moe_cost.py [--out benchmarks/probe/moe-cost.md] [--rounds 7]

Two random LLaDA2-layout models (`llada2_moe`, block-causal forwards without a frame) that differ
only in their MLPs: `moe` has one dense layer then mixture-of-experts layers of 64 routed experts
of width 128, 8 per token (8 groups, 4 drawn) plus one shared expert; `dense` has the dense
layer's MLP everywhere, of width (8 + 1) x 128 = 1152, so a token's forward uses the same
parameters (the router's 64 x d_model aside). Calls of R rows x 32 tokens, R = 1, 4, 16, 64: a
round times each (model, R) once, the two models back to back in an order alternating by round,
after a warm-up; the medians over rounds are reported, with the ratio moe / dense of each round's
pair, and how many tokens an expert receives on average in a call (the GEMM sizes the grouping
produces). The load average is recorded: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from unmask.config import ModelConfig
from unmask.models import build_model

ROWS = (1, 4, 16, 64)
TOKENS = 32
MOE = dict(num_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4, num_shared_experts=1,
           moe_intermediate_size=128, routed_scaling_factor=2.5, partial_rotary_factor=0.5)


def model(dense: bool) -> torch.nn.Module:
    config = ModelConfig(model_type="llada2_moe", d_model=512, n_heads=8, n_kv_heads=2,
                         head_size=64, n_layers=4, mlp_hidden_size=1152, vocab_size=4096,
                         max_sequence_length=4096, block_size=32, mask_token_id=4095,
                         eos_token_id=4094, first_k_dense_replace=4 if dense else 1, **MOE)
    torch.manual_seed(0)
    m = build_model(config)
    m.init_weights()
    return m.eval()


def active(m: torch.nn.Module) -> int:
    from unmask.catalog import active_parameters

    return active_parameters(m.config)


def seconds(m: torch.nn.Module, rows: int) -> float:
    ids = torch.randint(0, 4000, (rows, TOKENS), generator=torch.Generator().manual_seed(rows))
    pos = torch.arange(TOKENS)[None].expand(rows, TOKENS)
    start = time.perf_counter()
    with torch.no_grad():
        m(ids, pos)
    return time.perf_counter() - start


def tokens_per_expert(m: torch.nn.Module, rows: int) -> float:
    """Mean (token, expert) pairs an expert used in a call receives, over the MoE layers."""
    from unmask.models.llada2 import LLaDA2MoE

    counts = []

    def hook(module, args, out):
        chosen = out[0]
        used = torch.bincount(chosen.flatten(), minlength=module.weight.shape[0])
        counts.append(used[used > 0].float().mean().item())

    handles = [mod.gate.register_forward_hook(hook) for mod in m.modules() if isinstance(mod, LLaDA2MoE)]
    seconds(m, rows)
    for h in handles:
        h.remove()
    return statistics.mean(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    models = {"moe": model(False), "dense": model(True)}
    for m in models.values():  # warm-up: first calls allocate
        for r in ROWS:
            seconds(m, r)
    times = {(n, r): [] for n in models for r in ROWS}
    ratios = {r: [] for r in ROWS}
    loads = []
    started = time.perf_counter()
    for k in range(args.rounds):
        order = list(models) if k % 2 == 0 else list(reversed(models))
        for r in ROWS:
            got = {n: seconds(models[n], r) for n in order}
            for n, t in got.items():
                times[n, r].append(t)
            ratios[r].append(got["moe"] / got["dense"])
        loads.append(os.getloadavg()[0])
    lines = [
        "# Mixture of experts vs dense of the same active size, one thread",
        "",
        f"`python scripts/probe/moe_cost.py --rounds {args.rounds}` (torch {torch.__version__}, 1 thread, "
        f"{time.perf_counter() - started:.0f} s, load average {min(loads):.1f}-{max(loads):.1f} on a "
        "shared 2-core machine). Random LLaDA2-layout models, d_model 512, 4 layers, 8 heads of "
        "64 (2 K/V), vocabulary 4096: `moe` = 1 dense layer + 3 MoE layers (64 experts of width "
        "128, 8 per token from 4 of 8 groups, + 1 shared), "
        f"{sum(p.numel() for p in models['moe'].parameters()) / 1e6:.1f}M parameters, "
        f"{active(models['moe']) / 1e6:.2f}M active per token; `dense` = 4 dense layers of MLP "
        f"width 1152, {active(models['dense']) / 1e6:.2f}M. One forward of R rows x {TOKENS} "
        "tokens, block-causal, no frame; medians over rounds; ratio = median of each round's "
        "moe / dense.",
        "",
        "| rows x 32 | dense ms | moe ms | moe / dense | moe us per token | tokens per used expert |",
        "|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        dense, moe = (statistics.median(times[n, r]) * 1e3 for n in ("dense", "moe"))
        lines.append(f"| {r} | {dense:.1f} | {moe:.1f} | {statistics.median(ratios[r]):.2f} | "
                     f"{moe * 1e3 / (r * TOKENS):.0f} | {tokens_per_expert(models['moe'], r):.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
