"""One small model call's op count and time beyond its matrix products, this tree against an
earlier commit, with the same measuring code (BENCHMARKS.md, "Memory-bound calls").

A random-weight SDAR shape (`scripts/bench/memory_floor.py`'s), a block of 4 positions after 64
stored ones at batch 1, framed as the engine frames a decode step (`memory_floor.py`'s `call`),
one thread, CPU time. Each side runs in its own process with its tree's unmask first on the path
(scripts/ab/worktree.py), the side that runs first rotating every round; per format: torch ops
a call issues (top-level ops of one profiled call), the call's median ms, its block linears'
median ms alone, and so the rest. Medians over rounds.

    .venv/bin/python scripts/ab/call_ops.py --before REV [--rounds 3] [--repeat 9] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORMATS = ("bfloat16", "int4")


def floor_script():
    """This tree's memory_floor.py, whichever tree's unmask is on the path (by file, so an
    earlier commit's copy of the script is never the one imported)."""
    spec = importlib.util.spec_from_file_location("memory_floor",
                                                  ROOT / "scripts" / "bench" / "memory_floor.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ops_per_call(run) -> int:
    """Torch ops (aten::, mkldnn::, ...) one call issues that no other op called."""
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    n = 0
    for e in prof.events():
        p = e.cpu_parent
        while p is not None and "::" not in p.name:
            p = p.cpu_parent
        n += "::" in e.name and p is None
    return n


def child(folder: Path, repeat: int) -> dict:
    import torch

    mf = floor_script()
    torch.set_num_threads(1)
    fns, out = {}, {}
    for name in FORMATS:
        model = mf.load(folder, mf.FORMATS[name])
        layers = mf.block_products(model)
        inputs = {n: torch.randn(1, 4, n, dtype=torch.bfloat16)
                  for n in {lin.in_features for lin in layers}}  # (1, 4, in) each

        def products(layers=layers, inputs=inputs) -> None:
            with torch.no_grad():
                for lin in layers:
                    lin(inputs[lin.in_features])
        fns[name, "call"], fns[name, "products"] = mf.call(model, 1, 4, 64), products
        out[name] = {"ops": ops_per_call(fns[name, "call"]), "bytes": mf.bytes_read(model, 1, 64)}
    secs = mf.timed(fns, 1, repeat)
    for name in FORMATS:
        out[name].update(call=secs[name, "call"], products=secs[name, "products"])
    return out


def write(runs: dict[str, list[dict]], bw: float, args: argparse.Namespace, load: float) -> str:
    med = {side: {f: {k: statistics.median(r[f][k] for r in rs) for k in rs[0][f]}
                  for f in FORMATS} for side, rs in runs.items()}
    lines = [f"# One block-4 call's ops and the time beyond its products: this tree against "
             f"{args.before}", "",
             f"Random-weight sdar-170m, 1 x 4 positions after 64 stored, framed as the engine's "
             f"decode step, one thread, CPU time; each side in its own process, {args.rounds} "
             f"rounds (order rotating) of medians of {args.repeat}, each cell the median of its "
             f"rounds; floor at {bw / 1e9:.1f} GB/s (one thread); load average {load:.1f} at the start.", "",
             "| weights | tree | ops per call | call, ms | x floor | linears, ms | rest, ms | "
             "call / bfloat16's |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for f in FORMATS:
        for side in ("before", "after"):
            m = med[side][f]
            floor = m["bytes"] / bw
            lines.append(f"| {f} | {side} | {m['ops']:.0f} | {1e3 * m['call']:.1f} | "
                         f"{m['call'] / floor:.2f} | {1e3 * m['products']:.1f} | "
                         f"{1e3 * (m['call'] - m['products']):.1f} | "
                         f"{m['call'] / med[side]['bfloat16']['call']:.2f} |")
    ratio = {f: [a[f]["call"] / b[f]["call"] for a, b in zip(runs["after"], runs["before"],
                                                              strict=True)] for f in FORMATS}
    lines += ["", "after / before, call time per round: " + "; ".join(
        f"{f} {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})" for f, r in ratio.items()),
        "", "Command: `python scripts/ab/call_ops.py " + " ".join(sys.argv[1:]) + "`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the earlier commit (required)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.repeat)))
        return
    if not args.before:
        ap.error("--before REV is required")
    sys.path.insert(0, str(ROOT / "scripts" / "ab"))
    from worktree import checkout, python_in

    load = os.getloadavg()[0]
    mf = floor_script()
    bw = mf.bandwidth(1)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp, checkout(args.before) as old:
        folder = mf.random_folder("sdar-170m", Path(tmp))
        trees = {"before": old, "after": ROOT}
        for r in range(args.rounds):
            for side in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
                got = python_in(trees[side], [__file__, "--child", str(folder),
                                              "--repeat", str(args.repeat)])
                runs[side].append(json.loads(got.strip().splitlines()[-1]))
                print(side, "round", r, file=sys.stderr)
    text = write(runs, bw, args, load)
    print(text)
    if args.out:  # benchmarks/ab/, say
        args.out.write_text(text)


if __name__ == "__main__":
    main()
