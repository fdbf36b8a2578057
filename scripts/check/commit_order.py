"""Step-by-step commit order of unmask against the reference formula (BENCHMARKS.md, "Commit
order"): the share of steps that commit exactly the reference's positions, before and after.

    .venv/bin/python scripts/check/commit_order.py [--n 96] [--gen-length 256] [--before REV]

For each of the --n held-out math prompts on the shipped model, decoded alone: the reference
loop (LLaDA's generate.py for static-1: softmax over the full vocabulary in the logits' dtype,
the argmax's probability, top-1 of the block's masked positions; Fast-dLLM's get_transfer_index
for threshold: the same in float64, the top-1 plus every other position >= threshold) runs as
plain torch over model(canvas), and the engine decodes the same prompt; a step counts as
identical when both commit the same positions. With --before, the same engine side runs with
REV's tree (scripts/ab/worktree.py) and both columns print side by side, with the engine's scoring
time per step (the `score` call, host) of each tree. Prints markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ab"))  # worktree
DECODERS = {"static-1": None, "threshold": 0.9}  # the spec, and Fast-dLLM's threshold


def reference(model: torch.nn.Module, prompt: list[int], mask: int, gen: int, block: int,
              threshold: float | None) -> list[list[int]]:
    """The positions (offsets into the generated region) each step of the reference commits."""
    x = torch.tensor([prompt + [mask] * gen])
    p = len(prompt)
    pos = torch.arange(x.shape[1])[None]
    steps = []
    for b in range(gen // block):
        start, end = p + b * block, p + (b + 1) * block
        while bool((x[0, start:end] == mask).any()):
            logits = model(x, pos)[0]  # (S, V)
            x0 = logits.argmax(-1)
            probs = torch.softmax(logits if threshold is None else logits.double(), dim=-1)
            conf = probs.gather(-1, x0[:, None]).squeeze(-1)
            outside = torch.ones_like(conf, dtype=torch.bool)
            outside[start:end] = False
            conf = conf.masked_fill(outside | (x[0] != mask), float("-inf"))
            n = 1 if threshold is None else int((x[0, start:end] == mask).sum())
            top = torch.topk(conf, n).indices
            chosen = [int(top[0])] + [int(i) for i in top[1:] if conf[i] >= threshold]
            x[0, chosen] = x0[chosen]
            steps.append(sorted(i - p for i in chosen))
    return steps


def engine_side(n: int, gen: int, block: int) -> dict:
    """Per decoder: each prompt's engine steps, and the seconds of each `score` call."""
    import unmask.engine.runner as runner
    from unmask import LLM
    from unmask.bench.tasks import load_task
    from unmask.decoding.params import DecodeParams
    from unmask.engine import decode

    times: list[float] = []
    real = runner.score

    def timed(*a, **k):
        t = time.perf_counter()
        out = real(*a, **k)
        times.append(time.perf_counter() - t)
        return out

    runner.score = timed
    llm = LLM()
    out = {}
    for spec in DECODERS:
        params = DecodeParams.parse(spec, gen_length=gen, block_length=block)
        times.clear()
        steps = []
        for e in load_task("math", n).examples:
            got: list[list[int]] = []
            decode(llm.model, params, [llm.encode_prompt(e.prompt)],
                   on_event=lambda ev, got=got: ev.positions and got.append(sorted(ev.positions)))
            steps.append(got)
        out[spec] = {"steps": steps, "score_s": times[:]}
    return out


def identical(ref: list[list[list[int]]], got: list[list[list[int]]]) -> tuple[int, int, int]:
    """(identical steps, steps, prompts with every step identical)."""
    same = total = whole = 0
    for a, b in zip(ref, got, strict=True):
        n = sum(x == y for x, y in zip(a, b, strict=False))
        same, total, whole = same + n, total + max(len(a), len(b)), whole + (n == len(a) == len(b))
    return same, total, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--gen-length", type=int, default=256)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--before")
    ap.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.engine_only:
        print(json.dumps(engine_side(a.n, a.gen_length, a.block_length)))
        return
    sides = {"after": engine_side(a.n, a.gen_length, a.block_length)}
    if a.before:
        from worktree import checkout, python_in
        with checkout(a.before) as tree:
            args = [__file__, "--engine-only", "--n", str(a.n), "--gen-length", str(a.gen_length),
                    "--block-length", str(a.block_length)]
            sides = {"before": json.loads(python_in(tree, args)), **sides}
    from unmask import LLM
    from unmask.bench.tasks import load_task
    llm = LLM()
    prompts = [llm.encode_prompt(e.prompt) for e in load_task("math", a.n).examples]
    mask = llm.config.mask_token_id
    print(f"{a.n} held-out math prompts, gen_length {a.gen_length}, block_length "
          f"{a.block_length}, shipped model (float32), each decoded alone.\n")
    print("| decoder | tree | steps identical | share | prompts all identical | "
          "score ms/step (median) |\n|:---|:---|---:|---:|---:|---:|")
    for spec, th in DECODERS.items():
        with torch.no_grad():
            ref = [reference(llm.model, p, mask, a.gen_length, a.block_length, th) for p in prompts]
        for name, side in sides.items():
            same, total, whole = identical(ref, side[spec]["steps"])
            ms = 1e3 * statistics.median(side[spec]["score_s"])
            print(f"| `{spec}` | {name} | {same} / {total} | {same / total:.4%} | "
                  f"{whole} / {len(prompts)} | {ms:.3f} |", flush=True)


if __name__ == "__main__":
    main()
