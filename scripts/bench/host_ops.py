"""Where an engine step's time goes outside the model (BENCHMARKS.md, "Host overhead"), by
engine function, and how many torch calls it makes there (each one a kernel launch on a GPU).

    .venv/bin/python scripts/bench/host_ops.py [--decoder fast] [--batch 1] [--n 16] [--gen-length 64]
        [--repeats 5] [--model unmask-llada]

The --n held-out math prompts are decoded --batch at a time on one thread, --repeats times.
Each listed function is wrapped with a timer of this thread's CPU time (inclusive; time the
thread spends descheduled while another process runs is not counted; ~1 us per call of its
own); `model.forward` is timed apart, so host = engine step - model forward. The run with the
least host time per step is reported (the machine is shared: other processes only add time).
Columns are ms per engine step. The decode state is host numpy (unmask/engine/batch.py), so
the torch calls left outside the model are the scoring of the logits, the K/V store's gather
and write, and the copies of a call's inputs to the device; they are counted through a
TorchFunctionMode in one extra run, and the device-to-host reads a step would make on a GPU
(`unmask.syncs.SyncCounter`) in another. --model unmask-sdar measures block-4 calls of the
shipped SDAR model.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from unmask.api import LLM
from unmask.bench.tasks import load_task
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine import decoder as decoder_mod
from unmask.engine import engine as engine_mod
from unmask.engine import runner as runner_mod
from unmask.kv import KVStore

try:
    from unmask.syncs import SyncCounter
except ImportError:  # an older engine (scripts/ab/engine.py measures one): no count of reads
    SyncCounter = None

# (owner, attribute, label): the engine's step, from the outside in
TIMED = [
    (engine_mod.Engine, "step", "Engine.step"),
    (engine_mod.Engine, "_events", "  Engine._events (step events)"),
    (decoder_mod.Decoder, "step", "  Decoder.step"),
    (decoder_mod.Decoder, "_draft", "    _draft (rule step + FreeDave drafts)"),
    (decoder_mod.Decoder, "_forward", "    _forward (cache and suffix plans)"),
    (runner_mod.Runner, "forward", "      Runner.forward (inputs, scores back)"),
    (runner_mod.Runner, "_call", "        Runner._call (K/V gather, model)"),
    (runner_mod, "score", "        score (softmax, entropy, argmax)"),
    (decoder_mod.Decoder, "_verify", "    _verify (FreeDave's chain)"),
    (decoder_mod.Decoder, "_accept", "    _accept (commit-then-forward decoders)"),
    (decoder_mod.Decoder, "_take_predictions", "    _take_predictions (scores, K/V taken)"),
    (KVStore, "write", "      KVStore.write (K/V into the store)"),
]


class Timers:
    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:  # an older engine without this piece: its row reads 0
            return

        @functools.wraps(inner)
        def timed(*a: Any, **k: Any) -> Any:
            t = time.thread_time()
            try:
                return inner(*a, **k)
            finally:
                self.seconds[label] += time.thread_time() - t
        setattr(owner, name, timed)


class CallCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.paused = 0
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if not self.paused and not getattr(func, "__name__", "").startswith("__get"):  # .shape etc.
            self.calls += 1
        return func(*args, **(kwargs or {}))


class PyCalls:
    """A sys.setprofile hook counting the function calls of a step outside the model: Python
    calls and calls into C (numpy's and torch's included), not made by this script's timers.
    A count of operations: unlike time, free of the machine's noise."""

    def __init__(self, counter: CallCounter) -> None:
        self.counter, self.calls = counter, 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if (event in ("call", "c_call") and not self.counter.paused
                and frame.f_code.co_filename != __file__):
            self.calls += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decoder", default="fast")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="unmask-llada")
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model)
    timers, counter = Timers(), CallCounter()
    inner = llm.model.forward

    def forward(*a: Any, **k: Any) -> Any:
        counter.paused += 1
        t = time.thread_time()
        try:
            return inner(*a, **k)
        finally:
            timers.seconds["model.forward"] += time.thread_time() - t
            counter.paused -= 1

    llm.model.forward = forward  # type: ignore[method-assign]
    for owner, name, label in TIMED:
        timers.wrap(owner, name, label)
    params = DecodeParams.parse(args.decoder, gen_length=args.gen_length)
    prompts = [llm.encode_prompt(e.prompt) for e in load_task("math", args.n).examples]

    def run() -> int:
        steps = 0
        for i in range(0, len(prompts), args.batch):
            engine = Engine(llm.model, SchedulerConfig(max_running=args.batch))
            for ids in prompts[i : i + args.batch]:
                engine.add_request(ids, params)
            while engine.has_unfinished:
                engine.step()
                steps += 1
        return steps

    run()  # warm-up
    def host_of(ms: dict[str, float]) -> float:
        return ms["Engine.step"] - ms["model.forward"]

    best: dict[str, float] | None = None
    for _ in range(args.repeats):
        timers.seconds.clear()
        steps = run()
        ms = {k: 1000 * v / steps for k, v in timers.seconds.items()}
        if best is None or host_of(ms) < host_of(best):
            best = ms
    with counter:
        steps = run()
    reads = "not counted"
    if SyncCounter is not None:
        with SyncCounter(cpu_is_device=True).counting() as syncs:
            run()
        reads = f"{syncs.total / steps:.2f}"
    py_calls = PyCalls(counter)
    sys.setprofile(py_calls)
    try:
        run()
    finally:
        sys.setprofile(None)
    assert best is not None
    host = host_of(best)
    print(f"`{args.decoder}`, batch {args.batch}, {args.n} prompts, gen_length {args.gen_length}: "
          f"{steps} steps; host = Engine.step - model.forward = **{host:.3f} ms a step** "
          f"({host / args.batch:.3f} ms a row); {counter.calls / steps:.0f} torch calls and "
          f"{py_calls.calls / steps:.0f} function calls (Python and C) a step outside the model "
          f"(least host time of {args.repeats} runs); {reads} device-to-host "
          f"reads a step ({args.model})\n")
    print("| function (inclusive) | ms per step |\n|:---|---:|")
    for _, _, label in TIMED:
        print(f"| {label.strip()} | {best.get(label, 0.0):.3f} |")
    print(f"| model.forward | {best['model.forward']:.3f} |")


if __name__ == "__main__":
    main()
