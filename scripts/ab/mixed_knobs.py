"""Mixed sampling traffic through the engine, an earlier commit against this tree, side by side
(BENCHMARKS.md, "Mixed per-request knobs").

    .venv/bin/python scripts/ab/mixed_knobs.py REV [--rounds 3] [--n 32] [--concurrency 16]
        [--gen-length 128] [--json FILE]

The traffic: --n held-out math prompts, all submitted at once to one `Engine` with
max_running = --concurrency, request i with the i % 4-th of four values of one knob: the
temperatures 0.6 / 0.7 / 0.8 / 0.9 on the default decoder (`balanced`), or the thresholds
0.8 / 0.9 / 0.95 / 0.99 on `threshold`. What a chat server sees when clients set their own
temperature. Per cell: engine steps, model calls, model calls per step, useful tokens/s
(useful tokens up to the first EOS, summed / wall seconds), and whether every request's tokens
are those of the other tree. The trees alternate within each round (one torch thread each);
the table gives medians and the range of the after / before ratios.

REV is checked out into a temporary git worktree (scripts/ab/worktree.py); `--worker` runs one
tree's cells (the tree on PYTHONPATH) and prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

TRAFFIC = {  # name -> (decoder, knob, its four values)
    "temperature": ("balanced", "temperature", (0.6, 0.7, 0.8, 0.9)),
    "threshold": ("threshold", "threshold", (0.8, 0.9, 0.95, 0.99)),
}


def worker(n: int, concurrency: int, gen_length: int) -> None:
    import torch

    from unmask import LLM
    from unmask.bench.tasks import load_task
    from unmask.decoding.params import DecodeParams
    from unmask.engine import Engine, SchedulerConfig

    torch.set_num_threads(1)
    llm = LLM()
    eos = llm.config.eos_token_id
    prompts = [llm.encode_prompt(e.prompt) for e in load_task("math", n).examples]
    out = {}
    for name, (decoder, knob, values) in TRAFFIC.items():
        params = [DecodeParams.parse(decoder, gen_length=gen_length, seed=i,
                                     **{knob: values[i % len(values)]}) for i in range(n)]
        engine = Engine(llm.model, SchedulerConfig(max_running=concurrency))
        t0 = time.perf_counter()
        reqs = [engine.add_request(ids, q) for ids, q in zip(prompts, params, strict=True)]
        steps = 0
        while engine.has_unfinished:
            engine.step()
            steps += 1
        wall = time.perf_counter() - t0
        useful = sum(r.token_ids.index(eos) if eos in r.token_ids else len(r.token_ids)
                     for r in reqs)
        out[name] = dict(steps=steps, model_calls=engine.model_calls, wall=wall,
                         useful=useful, tokens=[r.token_ids for r in reqs])
    print(json.dumps(out))


def main() -> None:
    from worktree import ROOT, checkout, python_in

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", nargs="?")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--gen-length", type=int, default=128)
    p.add_argument("--json", help="also write every round's numbers to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = ["--n", str(args.n), "--concurrency", str(args.concurrency),
             "--gen-length", str(args.gen_length)]
    if args.worker:
        worker(args.n, args.concurrency, args.gen_length)
        return
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with checkout(args.rev) as old:
        for rnd in range(args.rounds):
            for name, tree in (("before", old), ("after", ROOT)):
                print(f"round {rnd + 1}/{args.rounds}: {name}", file=sys.stderr)
                text = python_in(tree, [str(ROOT / "scripts/ab/mixed_knobs.py"), "--worker", *shape])
                runs[name].append(json.loads(text))
    if args.json:
        Path(args.json).write_text(json.dumps({"rev": args.rev, "args": vars(args), "runs": {
            k: [{c: {f: v for f, v in cell.items() if f != "tokens"} for c, cell in r.items()}
                for r in rs] for k, rs in runs.items()}}, indent=1) + "\n")
    med = statistics.median
    print(f"Before: `{args.rev}`; after: this tree. {args.n} requests, concurrency "
          f"{args.concurrency}, gen_length {args.gen_length}, {args.rounds} rounds, medians.\n")
    print("| traffic | decoder | steps before | after | model calls before | after | calls/step "
          "before | after | useful tok/s before | after | after / before | same tokens |")
    print("|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---|")
    for name, (decoder, knob, values) in TRAFFIC.items():
        b = [r[name] for r in runs["before"]]
        a = [r[name] for r in runs["after"]]
        tps_b = [c["useful"] / c["wall"] for c in b]
        tps_a = [c["useful"] / c["wall"] for c in a]
        ratios = [y / x for x, y in zip(tps_b, tps_a, strict=True)]
        same = all(x["tokens"] == y["tokens"] for x, y in zip(b, a, strict=True))
        print(f"| {knob} {' / '.join(map(str, values))} | `{decoder}` | {b[0]['steps']} | "
              f"{a[0]['steps']} | {b[0]['model_calls']} | {a[0]['model_calls']} | "
              f"{b[0]['model_calls'] / b[0]['steps']:.2f} | {a[0]['model_calls'] / a[0]['steps']:.2f} | "
              f"{med(tps_b):.1f} | {med(tps_a):.1f} | {med(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
