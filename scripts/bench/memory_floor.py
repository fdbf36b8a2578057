"""How far a model call is from its memory floor, per weight format (BENCHMARKS.md, "Memory-bound
calls").

A call that forwards a few positions (a block-diffusion model's block of 4, with its stored K/V)
reads every weight to compute almost nothing: its floor is the bytes it must read over this
machine's read bandwidth. For a model folder (or a random-weight SDAR shape built from its
config in a temporary folder) and call shapes (rows x positions, K/V length), this reports:

- the weight bytes a call reads (every parameter but the embedding table, of which a call reads
  only its tokens' rows) plus the stored K/V it attends to;
- the read bandwidth of one thread and of all threads (a float32 sum over a buffer far larger
  than the last-level cache);
- per format (bfloat16, int8, int4, w8a8) and thread count: ms per call (median, formats interleaved
  round-robin in one process), x its floor, x bfloat16's time;
- decode tokens/s of `static-1` and `threshold` (random weights: speed, not accuracy);
- the weights' bytes, and the resident memory after loading and at its peak while loading, each
  format loaded in a fresh process.

    .venv/bin/python scripts/bench/memory_floor.py --shape sdar-170m [--threads 1,2] [--out FILE]
    .venv/bin/python scripts/bench/memory_floor.py --model DIR --rows 1 --positions 4 --kv 64

With one thread the times are this process's CPU time (other processes' load on a shared
machine does not count); with more, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from unmask import LLM
from unmask.checkpoint import load_model, save_checkpoint
from unmask.config import ModelConfig
from unmask.decoding.params import DecodeParams
from unmask.engine import decode
from unmask.engine.product_rows import DEFAULT_MIN_ROWS, block_products, product_rows
from unmask.hub import SHIPPED
from unmask.kv import KVStore, Past, Span
from unmask.models import build_model
from unmask.quantize import mib, weight_bytes

# Random-weight SDAR shapes with the shipped SDAR model's tokenizer (vocabulary 2,048).
# sdar-1.7b: the published SDAR-1.7B-Chat shape (Qwen3-1.7B's layers).
SHAPES = {
    "sdar-170m": dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                      num_key_value_heads=16, head_dim=64, intermediate_size=3072),
    "sdar-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=6144),
}
# name -> --quantize; "bfloat16 F.linear" is bfloat16 as loaded before unmask.packing (the plain
# weights through F.linear), "int4 through torchao" int4 as loaded before unmask.int4call (torchao's
# dispatch), for the side-by-side comparison: load_model's weights, which LLM then converts
FORMATS = {"bfloat16": None, "bfloat16 F.linear": "plain", "int8": "int8", "int4": "int4",
           "int4 through torchao": "plain int4", "w8a8": "w8a8"}


def load(folder: Path, scheme: str | None) -> torch.nn.Module:
    if scheme is not None and scheme.startswith("plain"):
        return load_model(folder, "cpu", "bfloat16", quantize=scheme.partition(" ")[2] or None)
    return LLM(folder, device="cpu", dtype="bfloat16", quantize=scheme).model
BANDWIDTH_BYTES = 1 << 30  # 1 GiB of float32: 32x this machine's last-level cache


def random_folder(shape: str, root: Path, dtype: str = "bfloat16") -> Path:
    """A random-weight SDAR model of `shape`, saved in `dtype` (one file) with the shipped SDAR
    tokenizer."""
    shipped = SHIPPED["unmask-sdar"]
    config = json.loads((shipped / "config.json").read_text())
    config.update(SHAPES[shape], torch_dtype=dtype, max_position_embeddings=4096)
    (root / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = build_model(ModelConfig.load(root))
    model.init_weights()
    return save_checkpoint(model.to(getattr(torch, dtype)), root, tokenizer_dir=shipped)


def clock(threads: int) -> Callable[[], float]:
    return time.process_time if threads == 1 else time.perf_counter


def bandwidth(threads: int, repeat: int = 5) -> float:
    """Bytes per second a float32 sum reads, on `threads` threads (median of `repeat`)."""
    torch.set_num_threads(threads)
    buf = torch.ones(BANDWIDTH_BYTES // 4)
    buf.sum()
    tick = clock(threads)
    times = []
    for _ in range(repeat):
        t = tick()
        buf.sum()
        times.append(tick() - t)
    return BANDWIDTH_BYTES / statistics.median(times)


def bytes_read(model: torch.nn.Module, rows: int, kv: int) -> int:
    """Bytes one call of `rows` rows over `kv` stored positions must read: the weights but the
    embedding table, and the stored K/V (in the model's activation dtype)."""
    skip = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, torch.nn.Embedding))
    c = model.config
    kv_bytes = rows * kv * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2
    return weight_bytes(model) - skip + kv_bytes


def call(model: torch.nn.Module, rows: int, positions: int, kv: int) -> Callable[[], object]:
    """One forward of `rows` x `positions` tokens after `kv` stored positions, framed as the
    engine's exact block cache frames a decode step (`Runner._spans`): the stored K/V read from
    a `KVStore` row each, the forwarded block one span over every key, no mask."""
    c = model.config
    ids = torch.randint(3, c.vocab_size, (rows, positions))
    pos = torch.arange(kv, kv + positions).expand(rows, -1)
    store = KVStore.empty(c.n_layers, rows, c.n_kv_heads, kv + positions, c.head_dim,
                          torch.bfloat16, torch.device("cpu"))
    store.kv.normal_()
    full = np.full(rows, kv)
    past = Past(store, np.arange(rows), np.tile(np.arange(kv), (rows, 1)),
                np.ones((rows, kv), dtype=bool), full, full, None)
    spans = [Span(0, positions, kv + positions)]

    def run() -> object:
        frame = past.frame(None, None, spans, c.block_size or positions)
        with torch.no_grad():
            return model(ids, pos, frame, logits_at=None)
    return run


def call_shapes(args: argparse.Namespace) -> list[tuple[int, int, str, bool]]:
    """(rows, positions per row, label, as the engine) of each call to time: rows x positions
    as asked and, where that is fewer than DEFAULT_MIN_ROWS tokens, the call as the engine makes
    it: its matrix products get the rows their kind needs (`engine_positions`)."""
    out = []
    for rows in (int(r) for r in args.rows.split(",")):
        out.append((rows, args.positions, f"{rows} x {args.positions}", False))
        if rows * args.positions < DEFAULT_MIN_ROWS:
            out.append((rows, args.positions, f"{rows} x {args.positions} as the engine calls it",
                        True))
    return out


def engine_positions(model: torch.nn.Module, rows: int, positions: int) -> int:
    """Positions per row of `model`'s call of rows x positions as the engine makes it: the
    runner pads a call's products to the rows their kind needs (`product_rows`) with tokens no
    row attends with; here each row's positions are padded instead."""
    return max(positions, -(-product_rows(model).blocks // rows))


def timed(fns: dict[str, Callable[[], object]], threads: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each fn, interleaved round-robin."""
    torch.set_num_threads(threads)
    tick = clock(threads)
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, f in fns.items():
            t = tick()
            f()
            times[k].append(tick() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def profile(models: dict[str, torch.nn.Module], args: argparse.Namespace) -> list[str]:
    """Where a 1-row call's time goes, per format: torch.profiler's self CPU time by op, one
    thread, the top ops covering most of it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(1)
    out = ["", f"Where the time goes: 1 x {args.positions} after {args.kv} stored positions, one "
           f"thread, torch.profiler self CPU time per call (share of the call):", ""]
    for name, m in models.items():
        run = call(m, 1, args.positions, args.kv)
        run()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.repeat):
                run()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in events)
        top = ", ".join(f"`{e.key}` {e.self_cpu_time_total / args.repeat / 1e3:.1f} ms "
                        f"({100 * e.self_cpu_time_total / total:.0f}%)" for e in events[:6])
        out.append(f"- {name}, {total / args.repeat / 1e3:.1f} ms: {top}")
    return out


def components(models: dict[str, torch.nn.Module], bw: float,
               args: argparse.Namespace) -> list[str]:
    """Where a 1-row call's time goes beyond its weight read, per format: the call, and its block
    linear layers alone on the call's rows (one thread, CPU time, interleaved round-robin), each
    against the floor of the bytes it reads; the rest is attention, norms, rotary embedding, the
    LM head and the host's per-op time."""
    fns, floors = {}, {}
    for name, m in models.items():
        layers = block_products(m)
        inputs = {n: torch.randn(1, args.positions, n, dtype=torch.bfloat16)
                  for n in {lin.in_features for lin in layers}}  # (1, positions, in) each

        def products(layers=layers, inputs=inputs) -> None:
            with torch.no_grad():
                for lin in layers:
                    lin(inputs[lin.in_features])
        fns[name, "call"], fns[name, "products"] = call(m, 1, args.positions, args.kv), products
        floors[name] = (bytes_read(m, 1, args.kv), sum(weight_bytes(lin) for lin in layers))
    secs = timed(fns, 1, args.repeat)
    out = ["", f"Components of a 1 x {args.positions} call after {args.kv} stored positions, one "
           f"thread, CPU time, medians of {args.repeat}: the block linears alone (x the floor of "
           f"their bytes at {bw / 1e9:.1f} GB/s) and the rest of the call:", "",
           "| weights | call, ms | x floor | block linears, ms | x floor | rest, ms | rest / call |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name in models:
        whole, prods = secs[name, "call"], secs[name, "products"]
        call_floor, prod_floor = (b / bw for b in floors[name])
        out.append(f"| {name} | {1e3 * whole:.1f} | {whole / call_floor:.2f} | {1e3 * prods:.1f} "
                   f"| {prods / prod_floor:.2f} | {1e3 * (whole - prods):.1f} | "
                   f"{(whole - prods) / whole:.0%} |")
    return out


def memory_of(folder: Path, scheme: str | None) -> dict:
    """In this fresh process: load `folder` quantized as `scheme`; the weights' bytes, and the
    resident memory after and at its peak while loading, above the process's before."""
    before = _status("VmRSS")
    model = load(folder, scheme)
    return {"weights": weight_bytes(model), "rss": _status("VmRSS") - before,
            "peak": _status("VmHWM") - before}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(key + ":")).split()[1]) * 1024


def memory_table(folder: Path) -> list[str]:
    out = ["| weights | bytes | resident after loading | peak while loading | peak / bytes |",
           "|---|---:|---:|---:|---:|"]
    for name, scheme in FORMATS.items():
        m = json.loads(subprocess.run([sys.executable, __file__, "--memory-of", str(folder),
                                       str(scheme)], check=True, capture_output=True,
                                      text=True).stdout)
        out.append(f"| {name} | {mib(m['weights'])} | {mib(m['rss'])} | {mib(m['peak'])} | "
                   f"{m['peak'] / m['weights']:.2f} |")
    return out


def decode_tps(models: dict[str, torch.nn.Module], threads: int, gen_length: int,
               repeat: int) -> dict[tuple[str, str], float]:
    torch.set_num_threads(threads)
    prompt = list(range(3, 19))
    block = next(iter(models.values())).config.block_size or gen_length
    params = {spec: DecodeParams.parse(spec, gen_length=gen_length, block_length=block)
              for spec in ("static-1", "threshold")}
    fns = {(name, spec): (lambda m=m, p=p: decode(m, p, [prompt]))
           for spec, p in params.items() for name, m in models.items()}
    secs = timed(fns, threads, repeat)
    return {k: gen_length / s for k, s in secs.items()}


class Lines(list):
    """The report's lines, each also printed (flushed) as it comes: a long run shows progress."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)

    def __iadd__(self, lines):
        for line in lines:
            self.append(line)
        return self


def report(folder: Path, args: argparse.Namespace) -> str:
    models = {name: load(folder, scheme) for name, scheme in FORMATS.items()}
    threads = [int(t) for t in args.threads.split(",")]
    bw = {t: bandwidth(t) for t in threads}
    lines = Lines()
    lines += [f"Read bandwidth (float32 sum over {BANDWIDTH_BYTES >> 20} MiB): "
              + ", ".join(f"{t} thread{'s' * (t > 1)} {bw[t] / 1e9:.1f} GB/s" for t in threads),
              "", "| rows x positions, K/V | threads | weights | bytes read | floor, ms | ms per "
              "call | x floor | x bfloat16 |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for rows, positions, label, engine in call_shapes(args):
        width = {n: engine_positions(m, rows, positions) if engine else positions
                 for n, m in models.items()}
        if engine:
            label += " (" + ", ".join(f"{n} {rows * w}" for n, w in width.items()) + " rows)"
        for t in threads:
            secs = timed({n: call(m, rows, width[n], args.kv) for n, m in models.items()},
                         t, args.repeat)
            for name, m in models.items():
                nbytes = bytes_read(m, rows, args.kv)
                floor = nbytes / bw[t]
                lines.append(f"| {label}, {args.kv} | {t} | {name} | "
                             f"{mib(nbytes)} | {1e3 * floor:.1f} | {1e3 * secs[name]:.1f} | "
                             f"{secs[name] / floor:.2f} | {secs[name] / secs['bfloat16']:.2f} |")
    if args.components:
        lines += components(models, bw[1] if 1 in bw else bandwidth(1), args)
    if args.profile:
        lines += profile(models, args)
    if args.gen_length:
        lines += ["", f"Decode, one 16-token prompt, gen_length {args.gen_length}, tokens/s:", "",
                  "| threads | weights | `static-1` | `threshold` |", "|---:|---|---:|---:|"]
        for t in threads:
            tps = decode_tps(models, t, args.gen_length, max(3, args.repeat // 2))
            lines += [f"| {t} | {n} | {tps[n, 'static-1']:.1f} | {tps[n, 'threshold']:.1f} |"
                      for n in models]
    if args.memory:
        lines += ["", "Memory, each format loaded in a fresh process from the bfloat16 folder:", "",
                  *memory_table(folder)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="a model folder")
    src.add_argument("--shape", choices=list(SHAPES), help="a random-weight SDAR shape")
    ap.add_argument("--rows", default="1,8", help="rows per call (default 1,8)")
    ap.add_argument("--positions", type=int, default=4, help="positions per row (default 4)")
    ap.add_argument("--kv", type=int, default=64, help="stored K/V positions (default 64)")
    ap.add_argument("--threads", default="1,2", help="thread counts, side by side (default 1,2)")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--gen-length", type=int, default=32, help="decode tokens/s (0: skip)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile a 1-row call per format (torch.profiler, by op)")
    ap.add_argument("--components", action="store_true",
                    help="also time a 1-row call's block linears alone against the whole call")
    ap.add_argument("--no-memory", dest="memory", action="store_false",
                    help="skip the load-memory table")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    ap.add_argument("--memory-of", nargs=2, metavar=("FOLDER", "SCHEME"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_of:
        folder, scheme = args.memory_of
        print(json.dumps(memory_of(Path(folder), None if scheme == "None" else scheme)))
        return
    if args.model is None and args.shape is None:
        ap.error("give --model DIR or --shape NAME")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or random_folder(args.shape, Path(tmp))
        body = report(folder, args)
    what = args.model or f"random-weight {args.shape} ({json.dumps(SHAPES[args.shape])})"
    parts = [f"# Memory-bound calls: {what}",
             f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
             f"{os.getloadavg()[0]:.1f} at the end; one thread: CPU time, more: wall time; medians.",
             body,
             f"Command: `python scripts/bench/memory_floor.py {' '.join(sys.argv[1:])}`; "
             f"{time.perf_counter() - started:.0f} s."]
    print(parts[-1])
    if args.out is not None:
        args.out.write_text("\n\n".join(parts) + "\n")

if __name__ == "__main__":
    main()
