"""The runner's fewest rows per kind of product (unmask/engine/product_rows.py) against 16 for
every product, side by side in one process: decode tokens/s per CPU-second of one thread, for
each weight format of a random-weight SDAR shape (scripts/bench/memory_floor.py's), the two
minimums in alternation, medians (BENCHMARKS.md, "Memory-bound calls").

    .venv/bin/python scripts/ab/product_rows.py [--shape sdar-170m] [--gen-length 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from memory_floor import FORMATS, SHAPES, load, random_folder  # noqa: E402

from unmask.decoding.params import DecodeParams  # noqa: E402
from unmask.engine import decode  # noqa: E402
from unmask.engine import runner as runner_mod  # noqa: E402
from unmask.engine.product_rows import DEFAULT_MIN_ROWS, ProductRows, product_rows  # noqa: E402

SPECS = ("static-1", "threshold")
# the minimum each call runs with: the per-kind one, or 16 for every product (before)
MINIMUMS = {"per kind": product_rows,
            "16": lambda model: ProductRows(DEFAULT_MIN_ROWS, DEFAULT_MIN_ROWS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="sdar-170m")
    ap.add_argument("--gen-length", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = random_folder(args.shape, Path(tmp))
        models = {name: load(folder, scheme) for name, scheme in FORMATS.items()}
    prompt = list(range(3, 19))
    block = next(iter(models.values())).config.block_size
    params = {s: DecodeParams.parse(s, gen_length=args.gen_length, block_length=block)
              for s in SPECS}
    times: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.repeat + 1):  # the first round warms up, and is dropped
        for name, model in models.items():
            for spec, p in params.items():
                for minimum, rows in MINIMUMS.items():
                    runner_mod.product_rows = rows
                    t = time.process_time()
                    decode(model, p, [prompt])
                    times.setdefault((name, spec, minimum), []).append(time.process_time() - t)
    runner_mod.product_rows = product_rows
    lines = [f"# The runner's fewest rows per kind of product against 16: random-weight "
             f"{args.shape}, decode tokens/s per CPU-second, one thread",
             f"torch {torch.__version__}; one 16-token prompt, gen_length {args.gen_length}, "
             f"blocks of {block}; medians of {args.repeat} rounds, minimums in alternation; "
             f"load average {os.getloadavg()[0]:.1f} at the end.", "",
             "| weights | rows, per kind | decoder | tokens/s, 16 rows | tokens/s, per kind | "
             "per kind / 16 |", "|---|---:|---|---:|---:|---:|"]
    for name, model in models.items():
        for spec in SPECS:
            tps = {m: args.gen_length / statistics.median(times[name, spec, m][1:])
                   for m in MINIMUMS}
            lines.append(f"| {name} | {product_rows(model).blocks} | `{spec}` | {tps['16']:.1f} | "
                         f"{tps['per kind']:.1f} | {tps['per kind'] / tps['16']:.2f} |")
    lines += ["", f"Command: `python scripts/ab/product_rows.py {' '.join(sys.argv[1:])}`; "
              f"{time.perf_counter() - started:.0f} s."]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
