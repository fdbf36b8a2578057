"""1,000 distinct prompts through a small prefix store on the shipped SDAR model: the store
never holds more than its budget (checked after every engine step), and what it evicted.

    python scripts/bench/prefix_store_budget.py [--n 1000] [--blocks 256]

Prints a markdown list (scripts/bench/prefix_reuse.sh puts it in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from unmask.api import LLM
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine.prefix_store import PrefixStore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--blocks", type=int, default=256, help="the budget, in blocks of K/V")
    p.add_argument("--prompt-length", type=int, default=48)
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM("unmask-sdar", device="cpu", prefix_cache=False)
    c = llm.config
    block = c.block_size * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 4  # float32
    store = PrefixStore(c.block_size, args.blocks * block)
    eng = Engine(llm.model, SchedulerConfig(max_running=16), prefix=store)
    rng = np.random.default_rng(0)
    vocab = range(3, c.vocab_size)
    params = DecodeParams.parse("threshold", gen_length=8, block_length=c.block_size)
    for _ in range(args.n):
        eng.add_request(rng.choice(vocab, args.prompt_length).tolist(), params)
    peak = 0
    while eng.has_unfinished:
        eng.step()
        peak = max(peak, store.stats.stored_bytes)
        assert store.stats.stored_bytes <= store.budget, "the store went past its budget"
    s = store.stats
    print(f"- {args.n} distinct random prompts of {args.prompt_length} tokens, 8 generated, 16 at "
          f"a time, budget {args.blocks} blocks ({store.budget:,} bytes)")
    print(f"- peak stored {peak:,} bytes (<= budget after every step), at the end "
          f"{s.stored_blocks} blocks, {s.stored_bytes:,} bytes; {s.inserted_blocks:,} blocks "
          f"stored in all, {s.evictions:,} evicted; {s.hit_tokens} prompt tokens reused")


if __name__ == "__main__":
    main()
