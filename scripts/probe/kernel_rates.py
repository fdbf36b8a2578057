"""The CPU kernels under a forward of the embedded model, on one thread: matrix products (its
projection, MLP and LM-head shapes) by rows, and attention per row by batch size. Why batching
rows gains little on this CPU (BENCHMARKS.md, "Host overhead"): a product that runs
near the core's peak at 16 rows has no per-row saving left for a larger batch to take.

    .venv/bin/python scripts/probe/kernel_rates.py

Medians of 5 timings of 200 calls each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from unmask.api import LLM


def us(f: Callable[[], object], n: int = 200) -> float:
    """Median microseconds a call of f."""
    for _ in range(10):
        f()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        runs.append((time.perf_counter() - t) / n)
    return sorted(runs)[2] * 1e6


def main() -> None:
    torch.set_num_threads(1)
    c = LLM().config
    d, hidden, vocab, heads = c.d_model, c.mlp_hidden_size, c.vocab_size, c.n_heads
    rows = [1, 16, 32, 64, 128, 256]
    print(f"Matrix products (F.linear, float32), GFLOP/s by rows; d_model {d}:\n")
    print("| in -> out | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|:---|" + "---:|" * len(rows))
    for k, n in [(d, d), (d, hidden), (hidden, d), (d, vocab)]:
        w = torch.randn(n, k)
        cells = []
        for m in rows:
            x = torch.randn(m, k)
            cells.append(f"{2 * m * k * n / us(partial(F.linear, x, w)) / 1e3:.0f}")
        print(f"| {k} -> {n} | " + " | ".join(cells) + " |")
    head = d // heads
    batches = [1, 2, 4, 8]
    print(f"\nAttention (scaled_dot_product_attention, {heads} heads of {head}), us per row by "
          "rows in the call:\n")
    print("| queries x keys | " + " | ".join(f"{b} rows" for b in batches) + " |")
    print("|:---|" + "---:|" * len(batches))
    for tq, tk in [(16, 112), (32, 160), (96, 96)]:
        cells = []
        for b in batches:
            q, k, v = (torch.randn(b, t, heads, head).transpose(1, 2) for t in (tq, tk, tk))
            mask = torch.ones(b, 1, 1, tk, dtype=torch.bool)
            mask[..., -3:] = False
            call = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask)
            cells.append(f"{us(call) / b:.1f}")
        print(f"| {tq} x {tk} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
