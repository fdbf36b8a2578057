"""Decode speed at 1 thread against 2, side by side in one process: the rule behind the CLI's
default --threads (unmask.api.default_threads; docs/cli.md, "Threads").

    python scripts/bench/threads_bench.py [--out benchmarks/bench/threads.md] [--rounds 5] [--n 4]

Models: `shipped`, the embedded model on its held-out math prompts; `medium`, random weights of
LLaDA's layout at 60M parameters (compile_bench.py's `large` at d_model 512, 8 layers; half of
them the 32,000-token embedding and head) on the same prompts' token ids (speed, not text).
Each round runs every model at 1 and 2 threads back to back (the order alternating by round),
the decoder `fast`, batch 1, gen_length 64: the medians over rounds of useful tokens/s, and of
each round's 2-thread / 1-thread ratio. The load average is recorded: the machine is shared,
and contention is what the rule is about.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from compile_bench import large_model

from unmask.api import LLM
from unmask.bench.tasks import load_task
from unmask.decoding.params import DecodeParams
from unmask.engine import decode


def tokens_per_second(model: torch.nn.Module, prompts: list[list[int]], params: DecodeParams,
                      threads: int) -> float:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    with torch.no_grad():
        reqs = decode(model, params, prompts, max_running=1)
    return sum(r.useful for r in reqs) / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n", type=int, default=4)
    args = p.parse_args()
    llm = LLM()
    task = load_task("math", args.n, seed=0)
    prompts = [llm.encode_prompt(e.prompt) for e in task.examples]
    models = {"shipped": llm.model,
              "medium": large_model(llm.config.eos_token_id, llm.config.mask_token_id,
                                    d_model=512, n_layers=8)}
    params = DecodeParams.parse("fast", gen_length=64, block_length=32)
    for model in models.values():  # warm-up: first calls allocate
        tokens_per_second(model, prompts[:1], params, 1)
    runs = {(m, t): [] for m in models for t in (1, 2)}
    loads = []
    for r in range(args.rounds):
        for name, model in models.items():
            for t in (1, 2) if r % 2 == 0 else (2, 1):
                runs[name, t].append(tokens_per_second(model, prompts, params, t))
                print(f"round {r + 1} {name} {t} thread(s): {runs[name, t][-1]:.1f} tokens/s",
                      flush=True)
        loads.append(os.getloadavg()[0])
    lines = ["| model | parameters | tokens/s, 1 thread | tokens/s, 2 threads | 2 / 1 |",
             "|---|---:|---:|---:|---:|"]
    for name, model in models.items():
        n = sum(q.numel() for q in model.parameters())
        one, two = runs[name, 1], runs[name, 2]
        ratio = statistics.median(b / a for a, b in zip(one, two, strict=True))
        lines.append(f"| {name} | {n / 1e6:.1f}M | {statistics.median(one):.1f} | "
                     f"{statistics.median(two):.1f} | {ratio:.2f} |")
    info = SimpleNamespace(cpus=len(os.sched_getaffinity(0)), torch=torch.__version__,
                           load=f"{min(loads):.2f}..{max(loads):.2f}")
    text = (f"Medians of {args.rounds} rounds, {args.n} prompts each, decoder fast, batch 1, "
            f"gen_length 64; {info.cpus} CPUs, torch {info.torch}, 1-minute load average "
            f"{info.load} during the run (other processes share the machine).\n\n"
            + "\n".join(lines) + "\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
