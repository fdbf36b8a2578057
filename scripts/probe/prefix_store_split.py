"""Where the prefix store's time goes on traffic that shares nothing: the workloads of
scripts/ab/prefix_cost.py (threshold, concurrency 16; the cells whose cost was largest) decoded
with the store off and on, side by side in rotated order, one torch thread, CPU time, no
profiler. For the store-on runs the store's own time is split by stage: `restore` (a joining
request's keys looked up), offer's bookkeeping (finished blocks found, keys hashed), the copy of
their K/V into the pool (`_Pool.write`) and the pool's growth, with the page faults each
caused (first touch of new memory; `ru_minflt`). "on, warm pool" runs with a store whose pool
was filled once and then emptied, so its copies land in memory touched before.

    PYTHONPATH=TREE .venv/bin/python scripts/probe/prefix_store_split.py [--rounds 7] [--n 16]

Prints one markdown row per workload and mode: medians over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine import prefix_store as ps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ab"))
from prefix_cost import load, unshared_prompts  # noqa: E402  (the A/B's workloads, one definition)

MODES = ("off", "on", "on, warm pool")
STAGES = ("restore", "offer", "write", "grow")  # offer includes write and grow


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@contextlib.contextmanager
def timed(spent: dict[str, list[float]]) -> Iterator[None]:
    """While inside, the store's stages add [CPU s, page faults] to spent[stage]."""
    originals = {"restore": (ps.PrefixStore, "restore"), "offer": (ps.PrefixStore, "offer"),
                 "write": (ps._Pool, "write"), "grow": (ps._Pool, "grow")}

    def wrap(stage: str, fn: Callable) -> Callable:
        def inner(*a, **kw):
            t, f = time.process_time(), faults()
            try:
                return fn(*a, **kw)
            finally:
                spent[stage][0] += time.process_time() - t
                spent[stage][1] += faults() - f
        return inner

    saved = {s: getattr(cls, name) for s, (cls, name) in originals.items()}
    for s, (cls, name) in originals.items():
        setattr(cls, name, wrap(s, saved[s]))
    try:
        yield
    finally:
        for s, (cls, name) in originals.items():
            setattr(cls, name, saved[s])


def emptied(store: ps.PrefixStore) -> ps.PrefixStore:
    """The store with its blocks dropped but its pool kept, every entry free."""
    for name in ("_entry", "_chains", "_ghosts", "_prompts"):  # those the tree's store has
        if hasattr(store, name):
            getattr(store, name).clear()
    store._wanted = 0
    if store._pool is not None:
        store._free = list(range(store._pool.entries - 1, -1, -1))
    return store


def run(llm, prompts: list[list[int]], params: DecodeParams, conc: int,
        store: ps.PrefixStore | None) -> tuple[float, int]:
    """CPU seconds and page faults of the timed requests (after the untimed one)."""
    eng = Engine(llm.model, SchedulerConfig(max_running=conc), prefix=store)
    *timed_prompts, prime = prompts
    eng.add_request(prime, params)
    eng.run()
    for p in timed_prompts:
        eng.add_request(p, params)
    t, f = time.process_time(), faults()
    eng.run()
    return time.process_time() - t, faults() - f


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--n", type=int, default=16)
    args = p.parse_args()
    llm, _ = load()
    bs = llm.config.block_size
    workloads = unshared_prompts(llm, args.n)
    print("| workload | mode | CPU ms | on / off | page faults | restore ms | offer ms | "
          "of it: copy ms (faults) | grow ms |")
    print("|:---|:---|---:|---:|---:|---:|---:|---:|---:|")
    for work, prompts in workloads.items():
        params = DecodeParams.parse("threshold", gen_length=32, block_length=bs)
        warm = ps.PrefixStore(bs, 1 << 30)
        run(llm, prompts, params, 16, warm)  # fills its pool once
        got: dict[str, list] = defaultdict(list)
        modes = list(MODES)
        for _ in range(args.rounds):
            for mode in modes:
                store = {"off": None, "on": ps.PrefixStore(bs, 1 << 30),
                         "on, warm pool": emptied(warm)}[mode]
                spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
                with timed(spent):
                    cpu, flt = run(llm, prompts, params, 16, store)
                got[mode].append((cpu, flt, {s: tuple(spent[s]) for s in STAGES}))
            modes = modes[1:] + modes[:1]
        med = statistics.median
        off = [g[0] for g in got["off"]]
        for mode in MODES:
            rows = got[mode]
            ratio = med([r[0] / o for r, o in zip(rows, off, strict=True)])
            stage = {s: med([r[2][s][0] for r in rows]) * 1e3 for s in STAGES}
            write_faults = med([r[2]["write"][1] for r in rows])
            print(f"| {work} threshold c=16 | {mode} | {med([r[0] for r in rows]) * 1e3:.0f} | "
                  f"{ratio:.3f} | {med([r[1] for r in rows]):.0f} | {stage['restore']:.1f} | "
                  f"{stage['offer']:.1f} | {stage['write']:.1f} ({write_faults:.0f}) | "
                  f"{stage['grow']:.2f} |")


if __name__ == "__main__":
    main()
