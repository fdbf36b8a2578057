"""Count the torch calls an engine step makes outside the model, by the unmask function making
them: a noise-free proxy for host overhead per step (issue #14), which timings on a shared
machine cannot resolve to 10%.

    .venv/bin/python scripts/host_ops.py [--decoder fast] [--batch 1] [--n 8] [--gen-length 64]

Every torch function and Tensor method call (indexing, comparisons and `.shape` reads included)
is counted through a TorchFunctionMode while the engine steps, except inside `model.forward`;
each is charged to the innermost frame in unmask/ that made it. At ~3-10 us of dispatch each on
this CPU, calls per step x that is most of the host time per step.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from unmask.api import LLM
from unmask.bench.tasks import load_task
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig

PACKAGE = str(Path(__file__).resolve().parent.parent / "unmask")


class CallCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.paused = 0
        self.by_site: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if not self.paused:
            frame = sys._getframe(1)
            while frame is not None and not frame.f_code.co_filename.startswith(PACKAGE):
                frame = frame.f_back
            site = "?" if frame is None else (
                f"{Path(frame.f_code.co_filename).relative_to(PACKAGE)}:{frame.f_code.co_name}")
            self.by_site[site] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decoder", default="fast")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM()
    counter = CallCounter()
    inner = llm.model.forward

    def forward(*a: Any, **k: Any) -> Any:  # the model's own calls are not host overhead
        counter.paused += 1
        try:
            return inner(*a, **k)
        finally:
            counter.paused -= 1

    llm.model.forward = forward  # type: ignore[method-assign]
    engine = Engine(llm.model, SchedulerConfig(max_running=args.batch))
    params = DecodeParams.parse(args.decoder, gen_length=args.gen_length)
    for ex in load_task("math", args.n).examples:
        engine.add_request(llm.encode_prompt(ex.prompt), params)
    steps = 0
    with torch.no_grad(), counter:
        while engine.has_unfinished:
            engine.step()
            steps += 1
    total = sum(counter.by_site.values())
    print(f"`{args.decoder}`, batch {args.batch}, {args.n} prompts, gen_length {args.gen_length}: "
          f"{steps} steps, {total / steps:.0f} torch calls per step outside the model\n")
    print("| where | calls per step |\n|:---|---:|")
    for site, n in counter.by_site.most_common(args.top):
        print(f"| `{site}` | {n / steps:.1f} |")


if __name__ == "__main__":
    main()
