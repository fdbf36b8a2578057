"""Engine throughput without HTTP, and where a step's time goes (issue #14).

    python scripts/engine_throughput.py [--n 32] [--gen-length 256] [--decoder fast ...]
        [--concurrency 1,4,16] [--rounds 3] [--profile 1,16 --profile-gen-length 64]

Throughput: the --n held-out math prompts are all submitted to one `Engine` at once with
`max_running` = each concurrency (what `LLM.generate(..., batch_size=N)` does), for each
decoder; cells run in rounds, in an order rotated by one per round, and pool their rounds.
useful tokens/s = useful tokens (up to the first EOS), summed / wall seconds of the runs.

Step split: `model.forward` is wrapped with a timer, so each engine step's wall time splits into
model compute (inside `model.forward`: embeddings, layers, LM head) and host overhead (the rest:
drafting, scheduling, masks, verification, K/V store writes, step events), per step.

--profile B,...: the same split on the short canvas (--profile-gen-length) at batch B, plus the
top functions of a cProfile of those runs by own time. Prints markdown on stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from unmask.api import LLM, useful_length
from unmask.bench.tasks import load_task
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig


@dataclass
class Run:
    wall: float = 0.0
    useful: int = 0
    steps: int = 0
    model_calls: int = 0
    forward_s: float = 0.0
    requests: int = 0
    step_s: list[float] = field(default_factory=list)  # each step's wall seconds
    step_forward_s: list[float] = field(default_factory=list)  # of which inside model.forward
    step_rows: list[int] = field(default_factory=list)  # rows that took part in a model call

    def add(self, other: Run) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


class ForwardTimer:
    """Wraps model.forward (an instance attribute, so nn.Module.__call__ picks it up)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.seconds, self.calls = model, 0.0, 0
        inner: Callable[..., Any] = model.forward

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1
        model.forward = timed  # type: ignore[method-assign]


def decode(llm: LLM, timer: ForwardTimer, ids: list[list[int]], params: DecodeParams,
           concurrency: int) -> Run:
    engine = Engine(llm.model, SchedulerConfig(max_running=concurrency, max_queue=len(ids)))
    f0 = timer.seconds
    t0 = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in ids]
    step_s, step_fw, step_rows = [], [], []
    with torch.no_grad():
        while engine.has_unfinished:
            t, f = time.perf_counter(), timer.seconds
            events = engine.step()
            step_s.append(time.perf_counter() - t)
            step_fw.append(timer.seconds - f)
            step_rows.append(sum(ev.forwarded for ev in events))
    wall = time.perf_counter() - t0
    eos = llm.config.eos_token_id
    return Run(wall, sum(useful_length(r.token_ids, eos) for r in reqs), len(step_s),
               engine.model_calls, timer.seconds - f0, len(reqs), step_s, step_fw, step_rows)


def row(decoder: str, conc: int, r: Run, base: Run | None) -> str:
    tps = r.useful / r.wall
    x = f"{tps / (base.useful / base.wall):.2f}x" if base else "1.00x"
    ms_step = 1000 * r.wall / r.steps
    ms_fwd = 1000 * r.forward_s / r.steps
    return (f"| `{decoder}` | {conc} | {r.requests} | {r.useful} | {r.wall:.2f} | {tps:.0f} | {x} | "
            f"{r.steps} | {r.model_calls} | {r.useful / r.model_calls:.1f} | {ms_step:.2f} | "
            f"{ms_fwd:.2f} | {ms_step - ms_fwd:.2f} | {100 * r.forward_s / r.wall:.0f}% |")


HEADER = ("| decoder | concurrency | requests | useful tokens | wall s | tokens/s | x vs c=1 | "
          "steps | model calls | tokens/call | ms/step | model ms/step | host ms/step | "
          "model share |\n|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table(llm: LLM, timer: ForwardTimer, prompts: list[list[int]], decoders: list[str],
          concs: list[int], gen_length: int, rounds: int) -> str:
    cells = [(d, c) for d in decoders for c in concs]
    params = {d: DecodeParams.parse(d, gen_length=gen_length) for d in decoders}
    for d in decoders:  # warm-up: allocator, first-call paths
        decode(llm, timer, prompts[:2], params[d], 2)
    runs = {cell: Run() for cell in cells}
    for rnd in range(rounds):
        shift = rnd % len(cells)
        for d, c in cells[shift:] + cells[:shift]:
            runs[(d, c)].add(decode(llm, timer, prompts, params[d], c))
    lines = [HEADER]
    for d, c in cells:
        lines.append(row(d, c, runs[(d, c)], runs[(d, concs[0])] if c != concs[0] else None))
    lines += ["", FIT_HEADER] + [fit(d, [runs[(d, c)] for c in concs]) for d in decoders]
    return "\n".join(lines)


FIT_HEADER = (
    "What limits batching: every step of every cell fitted as step seconds = f + p x rows "
    "(least squares; rows: requests in the step's model call). Concurrency c takes S_c steps "
    "for the same R row-steps (the tokens do not depend on the batch), so its speedup over "
    "c = 1 is (S_1 f + R p) / (S_c f + R p), and 2x needs f / p >= R / (S_1 - 2 S_c).\n\n"
    "| decoder | f ms/step | p ms/row | f/p | S_1 | S_c (largest c) | R | predicted x | "
    "f/p for 2x |\n|:---|---:|---:|---:|---:|---:|---:|---:|---:|")


def fit(decoder: str, runs: list[Run]) -> str:
    """The fixed-plus-per-row cost model of a decoder's steps (FIT_HEADER)."""
    rows = np.array([n for r in runs for n in r.step_rows], dtype=np.float64)
    secs = np.array([t for r in runs for t in r.step_s])
    (f, p), *_ = np.linalg.lstsq(np.stack([np.ones_like(rows), rows], 1), secs, rcond=None)
    first, last = runs[0], runs[-1]
    s1, sc, r = first.steps, last.steps, sum(first.step_rows)
    predicted = (s1 * f + r * p) / (sc * f + r * p)
    need = f"{r / (s1 - 2 * sc):.2f}" if s1 > 2 * sc else "unreachable"
    return (f"| `{decoder}` | {1000 * f:.2f} | {1000 * p:.2f} | {f / p:.2f} | {s1} | {sc} | {r} | "
            f"{predicted:.2f}x | {need} |")


def profile(llm: LLM, timer: ForwardTimer, prompts: list[list[int]], decoders: list[str],
            batches: list[int], gen_length: int, repeats: int, top: int) -> str:
    out = []
    for d in decoders:
        params = DecodeParams.parse(d, gen_length=gen_length)
        for b in batches:
            ids = prompts[:b]
            decode(llm, timer, ids, params, b)  # warm-up
            r = Run()
            for _ in range(repeats):
                r.add(decode(llm, timer, ids, params, b))
            # Medians over every step of every decode: robust to another process's bursts.
            step = [1000 * t for t in r.step_s]
            host = [1000 * (t - f) for t, f in zip(r.step_s, r.step_forward_s, strict=True)]
            model = [1000 * f for f in r.step_forward_s]
            lengths = [len(p) for p in ids]
            out.append(f"| `{d}` | {b} | {statistics.mean(lengths):.0f} | {r.steps / repeats:.1f} | "
                       f"{statistics.median(step):.2f} | {statistics.median(model):.2f} | "
                       f"{statistics.median(host):.2f} | {statistics.median(host) / b:.3f} | "
                       f"{statistics.mean(host):.2f} |")
    head = ("| decoder | batch | prompt tokens (mean) | steps/decode | ms/step | model ms/step | "
            "host ms/step | host ms/step/row | host ms/step (mean) |\n"
            "|:---|---:|---:|---:|---:|---:|---:|---:|---:|")
    text = [head, *out, ""]
    for d in decoders:
        params = DecodeParams.parse(d, gen_length=gen_length)
        for b in batches:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(repeats):
                decode(llm, timer, prompts[:b], params, b)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
            body = s.getvalue()
            body = body[body.find("   ncalls"):]
            text += [f"cProfile, `{d}`, batch {b}, {repeats} decodes, top {top} by own time:", "",
                     "```", body.rstrip(), "```", ""]
    return "\n".join(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--decoder", action="append", default=None)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", default="", help="batches for the step split on a short canvas")
    p.add_argument("--profile-gen-length", type=int, default=64)
    p.add_argument("--profile-repeats", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--skip-table", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    decoders = args.decoder or ["fast", "threshold"]
    llm = LLM()
    timer = ForwardTimer(llm.model)
    prompts = [llm.encode_prompt(e.prompt) for e in load_task("math", args.n).examples]
    if not args.skip_table:
        print(f"Engine throughput: {args.n} held-out math prompts, gen_length {args.gen_length}, "
              f"all submitted at once, max_running = concurrency; rounds: {args.rounds}, pooled.\n")
        print(table(llm, timer, prompts, decoders, [int(c) for c in args.concurrency.split(",")],
                    args.gen_length, args.rounds))
        print()
    if args.profile:
        print(f"Step split on a short canvas: held-out math prompts + gen_length "
              f"{args.profile_gen_length}; median of {args.profile_repeats} decodes.\n")
        print(profile(llm, timer, prompts, decoders, [int(b) for b in args.profile.split(",")],
                      args.profile_gen_length, args.profile_repeats, args.top))


if __name__ == "__main__":
    main()
