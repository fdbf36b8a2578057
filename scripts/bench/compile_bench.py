"""`--compile` against eager, side by side in one process (BENCHMARKS.md, "Compiled forward").

    python scripts/bench/compile_bench.py [--out benchmarks/bench/compile-cpu.md] [--n 32] [--rounds 3]
        [--device cpu] [--dtype float32] [--mode default] [--models shipped,large]
        [--large-n 16] [--large-batch1-n 4] [--gen-length 64] [--large-gen-length 16] [--example]

For each model, the same weights eager and compiled (unmask.compiling; a copy of the model):

- the first pass of every (decoder, batch) cell with the compiled copy, against the same pass
  eager: compile time, on an empty inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR), and the
  recompilations it took;
- then --rounds rounds in which each cell runs eager and compiled back to back (the order
  alternating by round): the medians over rounds of ms per engine step, of which inside
  `model.forward` (model) and outside it (host), and useful tokens/s (up to the first EOS, over
  the run's wall time), and the compiled / eager ratio of each round's pair; recompilations
  over the rounds (each a 32-prompt run of the shipped model).

Models: `shipped`, the embedded model and its held-out math prompts; `large`, random weights of
LLaDA-8B's shape scaled to ~140M parameters (12 layers instead of 32, d_model 768 instead of
4096, 12 heads, MLP 3 x d_model as there, vocabulary 32,000 instead of 126,464), on the first
--large-n of the same prompts' token ids (random weights: speed, not text; at batch 1 only the
first --large-batch1-n, at --large-gen-length: one thread takes seconds a step). Decoders `fast`
and `threshold`, batch (max_running) 1 and 16, block_length 32 (gen_length when shorter).

--example: the README's quickstart, `unmask generate "What is 47 + 38?"`, run as a fresh process
eager and with --compile (empty inductor cache), alternating, --rounds times each: whether
compiling pays for itself there. Writes markdown to --out and prints it.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from engine_throughput import ForwardTimer, Run, decode

from unmask.api import LLM, resolve_device
from unmask.bench.tasks import load_task
from unmask.compiling import check_compile, compile_model, recompile_count
from unmask.config import ModelConfig
from unmask.decoding.params import DecodeParams
from unmask.models import build_model

DECODERS = ("fast", "threshold")
BATCHES = (1, 16)
EXAMPLE = "What is 47 + 38?"


def large_model(eos: int, mask: int, d_model: int = 768, n_layers: int = 12) -> torch.nn.Module:
    """LLaDA-8B's shape, scaled down (module docstring; 64-wide heads), random weights."""
    heads = d_model // 64
    config = ModelConfig(model_type="llada", d_model=d_model, n_heads=heads, n_kv_heads=heads,
                         n_layers=n_layers, mlp_hidden_size=3 * d_model, vocab_size=32000,
                         embedding_size=32000,
                         mask_token_id=mask, eos_token_id=eos, max_sequence_length=4096)
    torch.manual_seed(0)
    model = build_model(config)
    model.init_weights()
    return model.eval()


def compare(name: str, eager: torch.nn.Module, prompts: dict[int, list[list[int]]],
            gen_length: int, rounds: int, mode: str) -> str:
    """One model's table (module docstring); prompts: per batch size."""
    compiled = copy.deepcopy(eager)
    compile_model(compiled, mode)
    sides = {}
    for side, model in (("eager", eager), ("compiled", compiled)):
        sides[side] = SimpleNamespace(model=model, config=model.config), ForwardTimer(model)
    params = {d: DecodeParams.parse(d, gen_length=gen_length, block_length=min(gen_length, 32))
              for d in DECODERS}
    first = {}
    for side in ("eager", "compiled"):
        before, t = recompile_count(), time.perf_counter()
        for d in DECODERS:
            for b in BATCHES:
                decode(*sides[side], prompts[b], params[d], b)
        first[side] = time.perf_counter() - t, recompile_count() - before
    before = recompile_count()
    runs: dict = {}
    for rnd in range(rounds):
        order = ("eager", "compiled") if rnd % 2 == 0 else ("compiled", "eager")
        for d in DECODERS:
            for b in BATCHES:
                for side in order:
                    runs.setdefault((d, b, side), []).append(
                        decode(*sides[side], prompts[b], params[d], b))
    later = recompile_count() - before
    lines = [f"### {name}: {sum(p.numel() for p in eager.parameters()) / 1e6:.1f}M parameters, "
             f"{' / '.join(str(len(prompts[b])) for b in BATCHES)} prompts at batch "
             f"{' / '.join(map(str, BATCHES))}, gen_length {gen_length}, mode {mode}\n",
             f"First pass of the {len(DECODERS) * len(BATCHES)} cells: eager "
             f"{first['eager'][0]:.1f} s, compiled {first['compiled'][0]:.1f} s (compile time "
             f"about {first['compiled'][0] - first['eager'][0]:.1f} s), "
             f"{first['compiled'][1]} recompilations; then {later} recompilations over "
             f"{rounds} rounds of every cell.\n",
             "| decoder | batch | ms/step eager | compiled | x | model ms/step eager | compiled | "
             "host ms/step eager | compiled | tokens/s eager | compiled | x |",
             "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in DECODERS:
        for b in BATCHES:
            e, c = runs[(d, b, "eager")], runs[(d, b, "compiled")]
            lines.append(cell_row(d, b, e, c))
    return "\n".join(lines)


def cell_row(decoder: str, batch: int, eager: list[Run], compiled: list[Run]) -> str:
    def med(rs: list[Run], f) -> float:
        return statistics.median(f(r) for r in rs)

    def ratio(f) -> float:  # each round's pair, then the median
        return statistics.median(f(c) / f(e) for e, c in zip(eager, compiled, strict=True))

    step = lambda r: 1e3 * r.wall / r.steps  # noqa: E731
    model = lambda r: 1e3 * r.forward_s / r.steps  # noqa: E731
    host = lambda r: step(r) - model(r)  # noqa: E731
    tps = lambda r: r.useful / r.wall  # noqa: E731
    return (f"| `{decoder}` | {batch} | {med(eager, step):.1f} | {med(compiled, step):.1f} | "
            f"{ratio(step):.2f} | {med(eager, model):.1f} | {med(compiled, model):.1f} | "
            f"{med(eager, host):.1f} | {med(compiled, host):.1f} | {med(eager, tps):.0f} | "
            f"{med(compiled, tps):.0f} | {ratio(tps):.2f} |")


def example(rounds: int, device: str) -> str:
    """The README's quickstart as a user runs it, eager and --compile (module docstring)."""
    times: dict[str, list[float]] = {"eager": [], "--compile": []}
    cmd = [sys.executable, "-m", "unmask.cli", "generate", EXAMPLE, "--threads", "1",
           "--device", device]
    for _ in range(rounds):
        for side, extra in (("eager", []), ("--compile", ["--compile"])):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
                t = time.perf_counter()
                subprocess.run(cmd + extra, env=env, check=True, capture_output=True)
                times[side].append(time.perf_counter() - t)
    e, c = (statistics.median(times[s]) for s in ("eager", "--compile"))
    return (f"### The README's example\n\n`unmask generate \"{EXAMPLE}\"` as a fresh process "
            f"(imports, load, decode), median of {rounds}: eager {e:.1f} s, --compile {c:.1f} s "
            f"(empty inductor cache), {c / e:.1f}x the time.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="markdown file to write")
    p.add_argument("--n", type=int, default=32, help="prompts of the shipped model's runs")
    p.add_argument("--large-n", type=int, default=16, help="prompts of the large model's runs")
    p.add_argument("--large-batch1-n", type=int, default=4,
                   help="prompts of the large model's batch-1 runs")
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--large-gen-length", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--mode", default="default", help="torch.compile mode")
    p.add_argument("--models", default="shipped,large")
    p.add_argument("--example", action="store_true", help="also time the README's example")
    args = p.parse_args()
    torch.set_num_threads(1)
    device = resolve_device(args.device)
    check_compile(device)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-bench-")
    llm = LLM(device=str(device), dtype=args.dtype)
    prompts = [llm.encode_prompt(e.prompt) for e in load_task("math", args.n).examples]
    parts = [f"## --compile vs eager: {device}, {args.dtype}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} thread(s)\n"]
    for name in args.models.split(","):
        if name == "shipped":
            model = llm.model
        else:
            model = large_model(llm.config.eos_token_id, llm.config.mask_token_id)
            model = model.to(device, getattr(torch, args.dtype))
        if name == "shipped":
            cells, gen = {b: prompts for b in BATCHES}, args.gen_length
        else:
            cells = {b: prompts[: args.large_n if b > 1 else args.large_batch1_n] for b in BATCHES}
            gen = args.large_gen_length
        parts.append(compare(name, model, cells, gen, args.rounds, args.mode))
        print(parts[-1] + "\n", flush=True)
    if args.example:
        parts.append(example(args.rounds, str(device)))
        print(parts[-1], flush=True)
    text = "\n\n".join(parts) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
