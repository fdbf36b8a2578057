"""Engine throughput without HTTP, and where a step's time goes (BENCHMARKS.md, "Host overhead").

    python scripts/bench/engine_throughput.py [--n 32] [--gen-length 256] [--decoder fast ...]
        [--concurrency 1,4,16] [--rounds 3] [--profile 1,16 --profile-gen-length 64]
        [--model unmask-llada]

Throughput: the --n held-out math prompts are all submitted to one `Engine` at once with
`max_running` = each concurrency (what `LLM.generate(..., batch_size=N)` does), for each
decoder; cells run in rounds, in an order rotated by one per round, and pool their rounds.
useful tokens/s = useful tokens (up to the first EOS), summed / wall seconds of the runs.
--clock cpu: this thread's CPU seconds in place of wall seconds (tokens per CPU-second). With
one torch thread the whole decode runs on this thread, so time other processes take from the
machine does not count: the clock for A/B comparisons on a shared machine (the "wall s" and
"ms" columns then hold CPU seconds).

Step split: `model.forward` is wrapped with a timer, so each engine step's wall time splits into
model compute (inside `model.forward`: embeddings, layers, LM head) and host overhead (the rest:
drafting, scheduling, masks, verification, K/V store writes, step events), per step.

--profile B,...: the same split on the short canvas (--profile-gen-length) at batch B, plus the
top functions of a cProfile of those runs by own time.

--kernels: one more decode of every cell with the matrix products (F.linear and the LM head's
matmul) and attention timed through a TorchFunctionMode: their seconds, the products' GFLOP/s,
and how much of the model's time they take. Work these kernels do is the same at every
concurrency (batch invariance), so their rate says whether a batch could do it faster.

--max-steps K: the throughput table on the first --n prompts that the first decoder finishes in
at most K steps (a workload without a tail of long requests).

--batching-gain B: the model alone, with no engine and no padding: one call of B identical rows
against one call of one row, at the shapes of `fast`'s calls (a refresh; a cached step; a late
cached step), in this thread's CPU time, side by side in rounds (medians). B x t(1) / t(B) is
the most any scheduler can gain from batching those calls. Prints markdown on stdout.
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
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from unmask.api import LLM, useful_length
from unmask.bench.tasks import load_task
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine import decode as decode_all
from unmask.kv import Frame, KVStore

# The clock every timing here reads (--clock): wall seconds, or this thread's CPU seconds.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


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
    step_tokens: list[int] = field(default_factory=list)  # positions that call forwarded

    def add(self, other: Run) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


class ForwardTimer:
    """Wraps model.forward (an instance attribute, so nn.Module.__call__ picks it up)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.seconds, self.calls = model, 0.0, 0
        inner: Callable[..., Any] = model.forward

        def timed(*a: Any, **kw: Any) -> Any:
            t = clock()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds += clock() - t
                self.calls += 1
        model.forward = timed  # type: ignore[method-assign]


class KernelTimer(TorchFunctionMode):
    """Seconds inside the matrix products (F.linear; the LM head's 2-D matmul) and attention of
    every torch call it sees, and the products' floating-point operations."""

    PRODUCTS = (F.linear, torch.matmul, torch.Tensor.__matmul__)

    def __init__(self) -> None:
        super().__init__()
        self.product_s = self.attention_s = 0.0
        self.flops = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        product, attention = func in self.PRODUCTS, func is F.scaled_dot_product_attention
        if not (product or attention):
            return func(*args, **kwargs)
        t = clock()
        out = func(*args, **kwargs)
        dt = clock() - t
        if attention:
            self.attention_s += dt
        else:
            a, w = args[0], args[1]
            # linear: x (..., in) by weight (out, in); matmul: (..., n, k) by (k, m)
            self.flops += 2 * a.numel() * (w.shape[0] if func is F.linear else w.shape[-1])
            self.product_s += dt
        return out


def decode(llm: LLM, timer: ForwardTimer, ids: list[list[int]], params: DecodeParams,
           concurrency: int) -> Run:
    engine = Engine(llm.model, SchedulerConfig(max_running=concurrency, max_queue=len(ids)))
    f0 = timer.seconds
    t0 = clock()
    reqs = [engine.add_request(p, params) for p in ids]
    step_s, step_fw, step_rows, step_tokens = [], [], [], []
    with torch.no_grad():
        while engine.has_unfinished:
            t, f = clock(), timer.seconds
            tok = engine.token_forwards
            events = engine.step()
            step_tokens.append(engine.token_forwards - tok)
            step_s.append(clock() - t)
            step_fw.append(timer.seconds - f)
            step_rows.append(sum(ev.forwarded for ev in events))
    wall = clock() - t0
    eos = llm.config.eos_token_id
    return Run(wall, sum(useful_length(r.token_ids, eos) for r in reqs), len(step_s),
               engine.model_calls, timer.seconds - f0, len(reqs), step_s, step_fw, step_rows,
               step_tokens)


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
          concs: list[int], gen_length: int, rounds: int, kernels: bool = False) -> str:
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
    if kernels:
        lines += ["", KERNEL_HEADER]
        for d, c in cells:
            with KernelTimer() as k:
                decode(llm, timer, prompts, params[d], c)
            model_s = runs[(d, c)].forward_s / rounds  # a round's, from the timed rounds
            lines.append(f"| `{d}` | {c} | {model_s:.3f} | {k.product_s:.3f} | "
                         f"{k.flops / k.product_s / 1e9:.0f} | {k.attention_s:.3f} | "
                         f"{(k.product_s + k.attention_s) / model_s:.0%} |")
    return "\n".join(lines)


KERNEL_HEADER = (
    "Kernels (--kernels): one more round of each cell with the matrix products and attention "
    "timed (KernelTimer); model s: a round's time inside model.forward in the timed rounds "
    "above.\n\n"
    "| decoder | concurrency | model s | products s | products GFLOP/s | attention s | "
    "products + attention, share of model |\n|:---|---:|---:|---:|---:|---:|---:|")


FIT_HEADER = (
    "What limits batching: every step of every cell fitted as step seconds = h + m [the step "
    "called the model] + p x rows + q x tokens (least squares; rows: requests in that call, "
    "tokens: positions it forwarded). Every concurrency does the same row and token work (the "
    "tokens do not depend on the batch): batching can only share h and m. So the speedup of any "
    "concurrency over c = 1 is at most c = 1's time over that work: the bound column. "
    "fixed share: the part of c = 1's time that batching can share. A cost the fit finds "
    "negative is set to 0 and the rest refitted. model-only bound: c = 1's wall time over the "
    "largest concurrency's time inside model.forward alone, measured, no fit: the most that "
    "concurrency could reach over c = 1 if every step's host time were zero.\n\n"
    "| decoder | h ms/step | m ms/call | p ms/row | q us/token | fixed share of c=1 | "
    "predicted x (largest c) | measured x | bound x | model-only bound x |\n"
    "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _nonnegative_fit(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a cost is never negative): a regressor that
    comes out negative is dropped (its cost 0) and the rest refitted. Where two regressors move
    together (threshold's rows and tokens), this is what keeps the split meaningful."""
    keep = np.ones(design.shape[1], dtype=bool)
    while True:
        coef = np.zeros(design.shape[1])
        coef[keep] = np.linalg.lstsq(design[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        keep[np.argmin(coef)] = False


def fit(decoder: str, runs: list[Run]) -> str:
    """The fixed-plus-per-row cost model of a decoder's steps (FIT_HEADER)."""
    rows = np.array([n for r in runs for n in r.step_rows], dtype=np.float64)
    toks = np.array([n for r in runs for n in r.step_tokens], dtype=np.float64)
    secs = np.array([t for r in runs for t in r.step_s])
    design = np.stack([np.ones_like(rows), (rows > 0).astype(np.float64), rows, toks], 1)
    h, m, p, q = _nonnegative_fit(design, secs)

    def parts(r: Run) -> tuple[float, float]:  # (fixed, per-row/token) predicted seconds
        calls = sum(n > 0 for n in r.step_rows)
        return r.steps * h + calls * m, sum(r.step_rows) * p + sum(r.step_tokens) * q

    (f1, w1), (fc, wc) = parts(runs[0]), parts(runs[-1])
    measured = runs[0].wall / runs[-1].wall
    return (f"| `{decoder}` | {1000 * h:.2f} | {1000 * m:.2f} | {1000 * p:.2f} | {1e6 * q:.1f} | "
            f"{f1 / (f1 + w1):.0%} | {(f1 + w1) / (fc + wc):.2f}x | {measured:.2f}x | "
            f"{(f1 + w1) / w1:.2f}x | {runs[0].wall / runs[-1].forward_s:.2f}x |")


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


# (forwarded tokens, stored keys read, scored positions) per row: `fast`'s calls at gen_length 256
# (prompt ~20): a refresh forwards the prompt, the block and the kept suffix; cached steps forward
# the block's masked slots and read the rest.
GAIN_SHAPES = {"refresh": (90, 0, 30), "cached step": (32, 90, 30), "late cached step": (6, 130, 6)}


def batching_gain(llm: LLM, batch: int, rounds: int = 30) -> str:
    """Per shape, `rounds` rounds of one call of `batch` rows and `batch` calls of one row, side
    by side; the gain is the median over rounds of (time of the one-row calls) / (time of the
    batched call)."""
    model, c = llm.model, llm.model.config
    store = KVStore.empty(c.n_layers, batch, c.n_kv_heads, 256, c.head_dim,
                          next(model.parameters()).dtype, torch.device("cpu"))
    store.kv.normal_()

    def call(b: int, t: int, k: int, n: int) -> Callable[[], float]:
        ids = torch.randint(3, c.vocab_size, (b, t))
        pos = (torch.arange(t) + k).repeat(b, 1)
        rows, past = np.arange(b), np.tile(np.arange(k), (b, 1))
        at = (torch.arange(b).repeat_interleave(n), torch.arange(n).repeat(b))

        def run() -> float:  # thread CPU seconds of one call
            frame = Frame(key_mask=torch.ones(b, t, dtype=torch.bool),
                          past=store.gather(rows, past) if k else None,
                          past_mask=torch.ones(b, k, dtype=torch.bool) if k else None)
            t0 = time.thread_time()
            model(ids, pos, frame=frame, logits_at=at)
            return time.thread_time() - t0
        return run

    lines = [f"| call (per row: tokens, stored keys, scored) | 1 row ms | {batch} rows ms | "
             f"{batch} rows / 1 row | batching gain |", "|:---|---:|---:|---:|---:|"]
    with torch.no_grad():
        for name, (t, k, n) in GAIN_SHAPES.items():
            one, many = call(1, t, k, n), call(batch, t, k, n)
            for _ in range(3):  # warm-up
                one(), many()
            ones, manys = [], []
            for _ in range(rounds):
                ones.append(sum(one() for _ in range(batch)) / batch)
                manys.append(many())
            gain = statistics.median(batch * a / m for a, m in zip(ones, manys, strict=True))
            o, m = statistics.median(ones), statistics.median(manys)
            lines.append(f"| {name} ({t}, {k}, {n}) | {1000 * o:.2f} | {1000 * m:.2f} | "
                         f"{m / o:.1f}x | {gain:.2f}x |")
    return "\n".join(lines)


def short_prompts(llm: LLM, decoder: str, n: int, gen_length: int, max_steps: int) -> list[list[int]]:
    """The first n held-out math prompts (of 4n) that `decoder` finishes in at most max_steps
    steps: a workload without a tail of long requests."""
    pool = [llm.encode_prompt(e.prompt) for e in load_task("math", 4 * n).examples]
    params = DecodeParams.parse(decoder, gen_length=gen_length)
    reqs = decode_all(llm.model, params, pool, max_running=16)
    short = [p for p, r in zip(pool, reqs, strict=True) if r.steps <= max_steps][:n]
    if len(short) < n:
        raise SystemExit(f"only {len(short)} of {len(pool)} prompts take <= {max_steps} steps")
    return short


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
    p.add_argument("--batching-gain", type=int, default=0, metavar="B")
    p.add_argument("--kernels", action="store_true",
                   help="time the matrix products and attention of each cell (one more round)")
    p.add_argument("--max-steps", type=int, default=0, metavar="K",
                   help="only prompts the first decoder finishes in <= K steps (no long tail)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall seconds, or this thread's CPU seconds (A/B on a shared machine)")
    p.add_argument("--model", default="unmask-llada", help="unmask-sdar: block-4 decoding")
    args = p.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    decoders = args.decoder or ["fast", "threshold"]
    llm = LLM(args.model)
    timer = ForwardTimer(llm.model)
    if args.max_steps:
        prompts = short_prompts(llm, decoders[0], args.n, args.gen_length, args.max_steps)
    else:
        prompts = [llm.encode_prompt(e.prompt) for e in load_task("math", args.n).examples]
    if not args.skip_table:
        print(f"Engine throughput: {args.n} held-out math prompts, gen_length {args.gen_length}, "
              f"all submitted at once, max_running = concurrency; rounds: {args.rounds}, pooled.\n")
        print(table(llm, timer, prompts, decoders, [int(c) for c in args.concurrency.split(",")],
                    args.gen_length, args.rounds, args.kernels))
        print()
    if args.batching_gain:
        print(f"The model alone, one call of {args.batching_gain} identical rows vs one row "
              "(no padding, no engine), thread CPU time:\n")
        print(batching_gain(llm, args.batching_gain))
        print()
    if args.profile:
        print(f"Step split on a short canvas: held-out math prompts + gen_length "
              f"{args.profile_gen_length}; median of {args.profile_repeats} decodes.\n")
        print(profile(llm, timer, prompts, decoders, [int(b) for b in args.profile.split(",")],
                      args.profile_gen_length, args.profile_repeats, args.top))


if __name__ == "__main__":
    main()
