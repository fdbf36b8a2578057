"""The runs of scripts/ab/prefix_ttft.sh, side by side: each bench-serve run's TTFT p50 per server
(before/after x store off/on) at each concurrency, the ratios, their medians over the runs, and
whether every request's text is the same on the four servers. At the highest concurrency also
the first wave's TTFT p50 alone (the requests a round sends together, before any finishes) and
the later requests' (sent as earlier ones finish): the p50 over all of them lies where the two
groups meet.

    .venv/bin/python scripts/ab/prefix_ttft_runs.py OUT1 OUT2 ...   # the OUT folders of prefix_ttft.sh
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections.abc import Callable
from pathlib import Path

SERVERS = ("before-off", "before-on", "after-off", "after-on")


def runs(outs: list[Path]) -> list[dict]:
    """Every bench-serve run of the folders: {"load": "a -> b", "cells": {(server, conc): cell}}."""
    found = []
    for out in outs:
        loads = re.findall(r"run (\d) (start|end):.*load average: ([\d.]+)",
                           (out / "load.txt").read_text())
        for f in sorted(out.glob("ab*.json")):
            n = f.stem.removeprefix("ab")
            at = {kind: x for i, kind, x in loads if i == n}
            data = json.loads(f.read_text())
            found.append({"load": f"{at.get('start', '?')} -> {at.get('end', '?')}",
                          "cells": {(c["server"], c["concurrency"]): c for c in data["cells"]}})
    return found


def p50(cell: dict) -> float:
    return cell["ttft_p50"]


def first_wave_p50(cell: dict) -> float:
    """The TTFT p50 of the requests each round sends at once (index < concurrency)."""
    return _p50_of(cell, first=True)


def later_p50(cell: dict) -> float:
    """The TTFT p50 of the requests each round sends one at a time as earlier ones finish
    (index >= concurrency): they join a running batch."""
    return _p50_of(cell, first=False)


def _p50_of(cell: dict, first: bool) -> float:
    return statistics.median(r["ttft"] for r in cell["requests"]
                             if (r["index"] < cell["concurrency"]) == first
                             and r["ttft"] is not None)


def table(found: list[dict], conc: int, stat: Callable[[dict], float] = p50) -> str:
    head = ["run", "load (1 min)", *[f"{s} s" for s in SERVERS], "before off / on",
            "after off / on", "on after / before", "off after / before"]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|" + "---:|" * (len(head) - 2)]
    cols: list[list[float]] = [[] for _ in range(len(SERVERS) + 4)]
    for i, run in enumerate(found, 1):
        t = [stat(run["cells"][(s, conc)]) for s in SERVERS]
        row = [*t, t[0] / t[1], t[2] / t[3], t[3] / t[1], t[2] / t[0]]
        for col, x in zip(cols, row, strict=True):
            col.append(x)
        lines.append(f"| {i} | {run['load']} | " + " | ".join(_fmt(row)) + " |")
    lines.append("| median | | " + " | ".join(_fmt([statistics.median(c) for c in cols])) + " |")
    return "\n".join(lines)


def _fmt(row: list[float]) -> list[str]:
    return [f"{x:.3f}" for x in row[:len(SERVERS)]] + [f"{x:.2f}x" for x in row[len(SERVERS):]]


def tokens_per_s(found: list[dict], conc: int) -> str:
    """Each server's tokens/s at `conc`, the median over the runs, and on / off per tree."""
    med = {s: statistics.median(run["cells"][(s, conc)]["tokens_per_s"] for run in found)
           for s in SERVERS}
    each = ", ".join(f"{s} {med[s]:.1f}" for s in SERVERS)
    return (f"Tokens/s at concurrency {conc}, medians over the runs: {each}; on / off "
            f"{med['before-on'] / med['before-off']:.2f}x before, "
            f"{med['after-on'] / med['after-off']:.2f}x after.")


def same_texts(found: list[dict]) -> str:
    """How many (run, concurrency, request) have the same text on all four servers."""
    same = total = 0
    for run in found:
        for conc in sorted({c for _, c in run["cells"]}):
            texts = [{r["index"]: r.get("text") for r in run["cells"][(s, conc)]["requests"]}
                     for s in SERVERS]
            for i in texts[0]:
                total += 1
                same += len({t.get(i) for t in texts}) == 1
    return f"{same} of {total} requests have the same text on the four servers"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", type=Path)
    found = runs(p.parse_args().outs)
    concs = sorted({c for run in found for _, c in run["cells"]}, reverse=True)
    for conc in concs:
        print(f"TTFT p50 at concurrency {conc}, per run:\n\n{table(found, conc)}\n")
    print(f"TTFT p50 of the first wave at concurrency {concs[0]} (the {concs[0]} requests a round "
          f"sends at once), per run:\n\n{table(found, concs[0], first_wave_p50)}\n")
    print(f"TTFT p50 of the later requests at concurrency {concs[0]} (sent one at a time as "
          f"earlier ones finish: they join a running batch), per run:\n\n"
          f"{table(found, concs[0], later_p50)}\n")
    print(tokens_per_s(found, concs[0]) + "\n")
    print(same_texts(found) + ".")


if __name__ == "__main__":
    main()
