"""The engine of an earlier commit against this tree's, side by side (BENCHMARKS.md, "Host
overhead"): throughput at concurrency 1, 4 and 16 (scripts/bench/engine_throughput.py) and host time
per step (scripts/bench/host_ops.py), the two trees in alternation for --rounds rounds, one torch
thread each; markdown tables of the medians on stdout.

    .venv/bin/python scripts/ab/engine.py REV [--rounds 5] [--raw FILE] [--decoder SPEC ...]
        [--clock cpu] [--model unmask-sdar] [--concurrency 1,4,16] [--n 32]

--decoder (repeatable) sets the decoders (default: fast, threshold), whose host time per step
is measured at batch 1 and 16; --model the model both trees decode (unmask-sdar: block-4
calls); --concurrency the throughput table's; --n its held-out prompts (host time: 16).
--clock cpu: throughput in tokens per CPU-second of the decoding thread (engine_throughput.py
--clock), which other processes on a shared machine do not move as they move wall seconds; host
time is in CPU time either way.

REV is checked out into a temporary git worktree (removed at the end); its code is imported
through PYTHONPATH, this tree's scripts measure both (host_ops.py times functions by name, so
an older engine must have them). Ratios are taken within a round, then their median: the
machine's drift between rounds hits both trees alike. Each after / before cell also gives the
range of its rounds' ratios: on a shared machine a median inside that range's noise is no claim.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
from pathlib import Path

from worktree import ROOT, checkout, python_in

DECODERS = ["fast", "threshold"]
CONCURRENCY = [1, 4, 16]


def host_runs(decoders: list[str]) -> list[tuple[str, int]]:
    return [(d, b) for d in decoders for b in (1, 16)]


THROUGHPUT_ROW = re.compile(r"^\| `([^`]+)` \| (\d+) \| \d+ \| \d+ \| [\d.]+ \| (\d+) \|")
HOST_LINE = re.compile(r"\*\*([\d.]+) ms a step\*\*.*?; (\d+) torch calls and (\d+) function calls")


def measure(tree: Path, decoders: list[str], clock: str, model: str,
            concurrency: list[int], n: int) -> tuple[dict, dict]:
    text = python_in(tree, [str(ROOT / "scripts/bench/engine_throughput.py"), "--rounds", "1", "--n", str(n),
                      "--clock", clock, "--concurrency", ",".join(map(str, concurrency)),
                      "--model", model, *[a for d in decoders for a in ("--decoder", d)]])
    tps = {(m[1], int(m[2])): float(m[3]) for m in map(THROUGHPUT_ROW.match, text.splitlines()) if m}
    host = {}
    for d, b in host_runs(decoders):
        line = python_in(tree, [str(ROOT / "scripts/bench/host_ops.py"), "--decoder", d, "--batch", str(b),
                          "--repeats", "3", "--model", model])
        m = HOST_LINE.search(line)
        host[(d, b)] = (float(m[1]), int(m[2]), int(m[3]))
    return tps, host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--raw", help="also write every round's numbers to this file")
    p.add_argument("--decoder", action="append", help="decoders (throughput and host time)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="throughput per wall second, or per CPU-second of the decoding thread")
    p.add_argument("--model", default="unmask-llada")
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    p.add_argument("--n", type=int, default=32, help="throughput prompts")
    args = p.parse_args()
    decoders = args.decoder or DECODERS
    concurrency = [int(c) for c in args.concurrency.split(",")]
    tps: dict = collections.defaultdict(list)
    host: dict = collections.defaultdict(list)
    with checkout(args.rev) as old:
        for rnd in range(args.rounds):
            for name, tree in (("before", old), ("after", ROOT)):
                print(f"round {rnd + 1}/{args.rounds}: {name}", file=sys.stderr)
                t, h = measure(tree, decoders, args.clock, args.model, concurrency, args.n)
                for k, v in t.items():
                    tps[(name, *k)].append(v)
                for k, v in h.items():
                    host[(name, *k)].append(v)
    if args.raw:
        Path(args.raw).write_text("".join(f"{k}: {v}\n" for k, v in [*tps.items(), *host.items()]))
    med = statistics.median
    unit = "tokens/s" if args.clock == "wall" else "tokens/CPU-s"
    print(f"Before: `{args.rev}`; after: this tree. {args.model}, {args.n} prompts; "
          f"{args.rounds} rounds, medians; "
          f"clock: {args.clock}.\n")
    print(f"| decoder | concurrency | {unit} before | after | after / before | x vs c=1 before | after |")
    print("|:---|---:|---:|---:|---:|---:|---:|")
    for d in decoders:
        for c in concurrency:
            b, a = tps[("before", d, c)], tps[("after", d, c)]
            x_b = med([v / w for v, w in zip(b, tps[("before", d, 1)], strict=True)])
            x_a = med([v / w for v, w in zip(a, tps[("after", d, 1)], strict=True)])
            ratios = [y / x for x, y in zip(b, a, strict=True)]
            print(f"| `{d}` | {c} | {med(b):.0f} | {med(a):.0f} | {med(ratios):.2f}x "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | {x_b:.2f}x | {x_a:.2f}x |")
    print("\n| decoder | batch | host ms/step before | after | after / before | torch calls/step "
          "outside the model before | after | function calls/step outside the model before | "
          "after |\n|:---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d, bs in host_runs(decoders):
        b, a = host[("before", d, bs)], host[("after", d, bs)]
        ratios = [y[0] / x[0] for x, y in zip(b, a, strict=True)]
        print(f"| `{d}` | {bs} | {med(v[0] for v in b):.2f} | {med(v[0] for v in a):.2f} | "
              f"{med(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {b[0][1]} | {a[0][1]} | "
              f"{b[0][2]} | {a[0][2]} |")


if __name__ == "__main__":
    main()
