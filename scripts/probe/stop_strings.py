"""What the server's stop strings cost a step (`TextStream.update`, run on the event loop for
each streaming request): a canvas committed 32 tokens a step, with stop strings that never
match, of 9,000 characters, against the text of 9,000 one-character tokens.

    .venv/bin/python scripts/probe/stop_strings.py [--chars 9000] [--stops 4]

Prints the median and largest ms a step of each case (BENCHMARKS.md, "Stop strings").
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

from unmask.engine.request import StepEvent
from unmask.server.output import TextStream

SPELL = ["", "a", "b", "c"]  # token ids 1-3 spell one character each; 0 is EOS


class CharLLM:
    """What TextStream reads of an LLM, for a vocabulary of single characters."""

    config = SimpleNamespace(eos_token_id=0)
    tokenizer = SimpleNamespace(encode=lambda text, **kw: list(text))

    def detokenize(self, ids: list[int]) -> str:
        return "".join(SPELL[i] for i in ids)


def run(canvas: list[int], stops: list[str], per_step: int = 32) -> list[float]:
    """Seconds of each step's update, committing the canvas left to right."""
    text, n, out = TextStream(CharLLM(), len(canvas), stops), len(canvas), []
    for start in range(0, n, per_step):
        end = min(n, start + per_step)
        ev = StepEvent("r", start, list(range(start, end)), canvas[start:end], [], True, False,
                       (0, n), end, 0, 0, 0)
        t = time.perf_counter()
        text.update(ev)
        out.append(time.perf_counter() - t)
        if text.stop_hit:
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chars", type=int, default=9000)
    p.add_argument("--stops", type=int, default=4)
    args = p.parse_args()
    rnd = random.Random(1)
    canvas = [rnd.choice([1, 2, 3]) for _ in range(args.chars)]
    cases = {
        f"{args.stops} random stops of {args.chars} characters":
            ["".join(rnd.choice("abc") for _ in range(args.chars)) for _ in range(args.stops)],
        f"{args.stops} stops 'a' x {args.chars - 1} + 'd'": ["a" * (args.chars - 1) + "d"] * args.stops,
        "no stop": [],
    }
    print("| case | steps | median ms a step | largest ms |\n|:---|---:|---:|---:|")
    for name, stops in cases.items():
        times = sorted(run(canvas, stops))
        print(f"| {name} | {len(times)} | {times[len(times) // 2] * 1e3:.3f} | "
              f"{times[-1] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
