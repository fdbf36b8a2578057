"""int8 / int4 weights (and w8a8: int8 activations too) against float32 on this CPU, one thread,
side by side in one run.

1. The embedded model on held-out math (the same prompts for every variant): accuracy, token
   agreement with float32 (whole outputs identical, and positions equal), median TPS and the
   median per-prompt TPS ratio against float32, and the weights' bytes, for the README's
   decoders. Variants: float32, int8 (float32 activations), bfloat16 and int4 (bfloat16
   activations: int4 runs in bfloat16 only, so bfloat16 is its like-for-like baseline). For
   each prompt and decoder every variant runs, in an order rotated per prompt.
2. A random-weight model of the published LLaDA-8B shape scaled down (the speed and memory
   columns, where the embedded model is too small to show them), loaded from a folder as LLM
   loads one: each variant's weight bytes and resident memory (after and peak while loading,
   in a fresh process), the median forward time at two sizes, and decode TPS of `threshold`
   and `fast` (random weights: speed, not accuracy).

    python scripts/bench/quantize_bench.py [--n 16] [--gen-length 256] [--out benchmarks/bench/quantize.md]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from unmask import LLM
from unmask.api import useful_length
from unmask.checkpoint import load_model, save_checkpoint
from unmask.config import ModelConfig
from unmask.decoding.params import DecodeParams
from unmask.engine import decode
from unmask.models import build_model
from unmask.quantize import mib, quantize_model, torchao_version, weight_bytes
from unmask.tasks import TASKS

# the table of docs/decoders.md, "Choosing the default", exact with early exit as there
DECODERS = ("threshold", "exact,early_exit=true", "balanced", "fast")
# (name, dtype, scheme): the variants, float32 first (the reference of agreement and speed)
VARIANTS = (("float32", "float32", None), ("int8", "float32", "int8"),
            ("bfloat16", "bfloat16", None), ("int4", "bfloat16", "int4"),
            ("w8a8", "bfloat16", "w8a8"))
# LLaDA-8B (d_model 4096, 32 heads of 128, 32 layers, MLP 3x, vocabulary 126,464) at 1/4 width,
# 12 layers, 1/8 vocabulary: 163M parameters in the blocks, 34M in embedding and head (17%,
# against 13% at 8B).
SCALED = dict(model_type="llada", d_model=1024, n_heads=8, n_kv_heads=8, n_layers=12,
              mlp_hidden_size=3072, vocab_size=16384, embedding_size=16384, mask_token_id=2,
              eos_token_id=1, max_sequence_length=2048)


@dataclass
class Run:
    token_ids: list[int]
    tps: float
    correct: bool


def variant_model(base: torch.nn.Module, dtype: str, scheme: str | None) -> torch.nn.Module:
    model = copy.deepcopy(base).to(getattr(torch, dtype))
    if scheme is not None:
        quantize_model(model, scheme)
    return model


# --- 1. the embedded model ------------------------------------------------------------------------
def embedded_table(n: int, gen_length: int, block_length: int, model: str | None = None,
                   decoders: tuple[str, ...] = DECODERS) -> str:
    llm = LLM(model, device="cpu")
    base = llm.model
    models = {name: variant_model(base, dtype, scheme) for name, dtype, scheme in VARIANTS}
    examples = TASKS["math"].load("heldout", n)
    ids = [llm.encode_prompt(ex.prompt) for ex in examples]
    decoders = [DecodeParams.parse(s, gen_length=gen_length, block_length=block_length)
                for s in decoders]
    eos = llm.config.eos_token_id
    runs: dict[tuple[str, str], list[Run]] = {(v, d.spec): [] for v in models for d in decoders}
    names = list(models)
    for d in decoders:  # warm-up, untimed
        for name in names:
            decode(models[name], d, ids[:1])
    for i, (ex, prompt) in enumerate(zip(examples, ids, strict=True)):
        for d in decoders:
            for k in range(len(names)):
                name = names[(k + i) % len(names)]
                r = decode(models[name], d, [prompt])[0]
                useful = useful_length(r.token_ids, eos)
                text = llm.detokenize(r.token_ids[:useful])
                runs[name, d.spec].append(Run(r.token_ids, useful / r.seconds,
                                              TASKS["math"].check(ex, text)))
        print(f"prompt {i + 1}/{n}", file=sys.stderr, flush=True)
    rows = ["| decoder | weights | weight bytes | accuracy | same output as float32 | positions "
            "equal | TPS (median) | TPS vs float32 (median of per-prompt ratios) |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for d in decoders:
        ref = runs["float32", d.spec]
        for name in names:
            rs = runs[name, d.spec]
            same = sum(r.token_ids == f.token_ids for r, f in zip(rs, ref, strict=True))
            equal = sum(a == b for r, f in zip(rs, ref, strict=True)
                        for a, b in zip(r.token_ids, f.token_ids, strict=True))
            ratio = statistics.median(r.tps / f.tps for r, f in zip(rs, ref, strict=True))
            rows.append(f"| `{d.spec}` | {name} | {mib(weight_bytes(models[name]))} | "
                        f"{sum(r.correct for r in rs)}/{n} | {same}/{n} | "
                        f"{100 * equal / (n * gen_length):.1f}% | "
                        f"{statistics.median(r.tps for r in rs):.1f} | {ratio:.2f}x |")
    return "\n".join(rows)


# --- 2. the scaled random model -------------------------------------------------------------------
def scaled_folders(root: Path) -> dict[str, Path]:
    """The scaled model, random weights, saved in float32 and in bfloat16 under root."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(**SCALED))
    model.init_weights()
    return {dtype: save_checkpoint(model.to(getattr(torch, dtype)), root / dtype)
            for dtype in ("float32", "bfloat16")}


def loaded(folder: Path, scheme: str | None) -> torch.nn.Module:
    """As LLM loads it: weights memory-mapped from the folder, then quantized."""
    model = load_model(folder, "cpu")
    if scheme is not None:
        quantize_model(model, scheme)
    return model


def memory_of(folder: Path, scheme: str | None) -> dict:
    """In this (fresh) process: load and quantize, then the weights' bytes, and the resident
    memory after and at its peak while loading, above the process's before the load."""
    before = status_bytes("VmRSS")
    model = loaded(folder, scheme)
    gc.collect()
    return {"weight_bytes": weight_bytes(model), "rss": status_bytes("VmRSS") - before,
            "peak": status_bytes("VmHWM") - before}


def status_bytes(key: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS: resident now; VmHWM:
    the peak, which unlike getrusage's maxrss does not carry the parent's over an exec)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def median_seconds(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def scaled_table(repeat: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        folders = scaled_folders(Path(tmp))
        memory = {name: json.loads(subprocess.run(
            [sys.executable, __file__, "--memory-of", str(folders[dtype]), str(scheme)],
            check=True, capture_output=True, text=True).stdout) for name, dtype, scheme in VARIANTS}
        models = {name: loaded(folders[dtype], scheme) for name, dtype, scheme in VARIANTS}
        forward = forward_seconds(models, repeat)
        tps = decode_tps(models, repeat)
    rows = ["| weights | weight bytes | resident memory after loading | peak while loading | "
            f"forward {FORWARDS[0][0]} x {FORWARDS[0][1]}, ms | forward {FORWARDS[1][0]} x "
            f"{FORWARDS[1][1]}, ms | `threshold` TPS | `fast` TPS |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in models:
        m = memory[name]
        rows.append(f"| {name} | {mib(m['weight_bytes'])} | {mib(m['rss'])} | {mib(m['peak'])} | "
                    f"{1e3 * forward[name][0]:.0f} | {1e3 * forward[name][1]:.0f} | "
                    f"{tps[name]['threshold']:.1f} | {tps[name]['fast']:.1f} |")
    return "\n".join(rows)


# (rows, positions) of one forward: a block's worth for one request, and a small batch's canvas
FORWARDS = ((1, 32), (4, 64))


def forward_seconds(models: dict[str, torch.nn.Module], repeat: int) -> dict[str, list[float]]:
    names = list(models)
    out: dict[str, list[float]] = {name: [] for name in names}
    for j, shape in enumerate(FORWARDS):
        ids = torch.randint(3, SCALED["vocab_size"], shape)
        pos = torch.arange(shape[1]).expand(shape)
        for k in range(len(names)):  # in an order rotated per shape
            name = names[(k + j) % len(names)]
            with torch.no_grad():
                out[name].append(median_seconds(
                    lambda m=models[name], i=ids, p=pos: m(i, p), repeat))
    return out


def decode_tps(models: dict[str, torch.nn.Module], repeat: int) -> dict[str, dict[str, float]]:
    """Positions decoded per second, one 16-token prompt, gen_length 16 (random weights commit
    about one position per step)."""
    prompt = list(range(3, 19))
    out: dict[str, dict[str, float]] = {name: {} for name in models}
    for spec in ("threshold", "fast"):
        params = DecodeParams.parse(spec, gen_length=16, block_length=16)
        for name, model in models.items():
            out[name][spec] = 16 / median_seconds(lambda m=model, p=params: decode(m, p, [prompt]),
                                                  repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16, help="held-out math problems (default: 16)")
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5, help="timed repeats on the scaled model")
    ap.add_argument("--model", default=None,
                    help="the held-out table alone, for this model (a shipped name or folder)")
    ap.add_argument("--decoders", default=";".join(DECODERS),
                    help="with --model: decoder specs, separated by ';'")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    ap.add_argument("--memory-of", nargs=2, metavar=("FOLDER", "SCHEME"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.memory_of:
        folder, scheme = args.memory_of
        print(json.dumps(memory_of(Path(folder), None if scheme == "None" else scheme)))
        return
    started = time.perf_counter()
    if args.model is not None:  # the held-out table alone, for a shipped or local model
        decoders = tuple(args.decoders.split(";"))
        report = (f"# int8 / int4 weights vs float32, {args.model}, held-out math: {args.n} "
                  f"problems, gen_length {args.gen_length}, block_length {args.block_length} "
                  f"(torchao {torchao_version()}, torch {torch.__version__}, one CPU thread)\n\n"
                  f"{embedded_table(args.n, args.gen_length, args.block_length, args.model, decoders)}"
                  f"\n\nCommand: `python scripts/bench/quantize_bench.py {' '.join(sys.argv[1:])}`; "
                  f"{time.perf_counter() - started:.0f} s.\n")
    else:
        report = full_report(args, started)
    print(report)
    if args.out is not None:
        args.out.write_text(report)


def full_report(args: argparse.Namespace, started: float) -> str:
    return (f"# int8 / int4 weights vs float32 (torchao {torchao_version()}, torch "
            f"{torch.__version__}, one CPU thread)\n\n"
            f"## Embedded model, held-out math: {args.n} problems, gen_length {args.gen_length}, "
            f"block_length {args.block_length}\n\n"
            f"{embedded_table(args.n, args.gen_length, args.block_length)}\n\n"
            f"## Random-weight LLaDA-8B shape scaled down ({json.dumps(SCALED)})\n\n"
            f"{scaled_table(args.repeat)}\n\n"
            f"Command: `python scripts/bench/quantize_bench.py {' '.join(sys.argv[1:])}`; "
            f"{time.perf_counter() - started:.0f} s.\n")


if __name__ == "__main__":
    main()
