"""Count and time the torch ops of one small model call, attributed to our source lines.

A block of 4 positions against stored K/V, batch 1, on a random-weight SDAR shape
(`scripts/bench/memory_floor.py`'s shapes), one thread: torch.profiler with record_shapes and
stacks, its top-level ops (those no other op called) grouped by op name and by the line of
unmask/ that issued them, with their self + children CPU time per call. Two frames: the one the
engine's exact block cache builds for a decode step (`Frame.spans`, one span over every key, as
`memory_floor.py` now frames its calls), and a block-causal mask frame (as it framed them before).

    python scripts/probe/call_ops.py --shape sdar-170m --format bfloat16 \
        --out benchmarks/probe/call-ops-sdar-170m.md
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scripts.bench.memory_floor import FORMATS, SHAPES, call, load, random_folder  # noqa: E402
from unmask.kv import Frame, PastKV  # noqa: E402

ROOT = "unmask/"


def mask_call(model: torch.nn.Module, positions: int, kv: int):
    """One forward of 1 x `positions` tokens after `kv` stored positions through the frame
    `memory_floor.py` timed before it framed calls as the engine does: a block-causal mask over
    the stored and forwarded keys, which attention then runs with (a slower kernel path than the
    engine's maskless span)."""
    c = model.config
    ids = torch.randint(3, c.vocab_size, (1, positions))
    pos = torch.arange(kv, kv + positions)[None]
    shape = (1, kv, c.n_kv_heads, c.head_dim)
    past = PastKV([torch.randn(shape, dtype=torch.bfloat16) for _ in range(c.n_layers)],
                  [torch.randn(shape, dtype=torch.bfloat16) for _ in range(c.n_layers)])
    block = c.block_size or positions
    blocks, past_blocks = pos // block, torch.arange(kv)[None] // block

    def run() -> object:
        frame = Frame(past=past, past_mask=torch.ones(1, kv, dtype=torch.bool), blocks=blocks,
                      past_blocks=past_blocks)
        with torch.no_grad():
            return model(ids, pos, frame, logits_at=None)
    return run


def top_level(e) -> bool:
    """A torch op (aten::, mkldnn::) that no other op called."""
    if "::" not in e.name:
        return False
    p = e.cpu_parent
    while p is not None:
        if "::" in p.name:
            return False
        p = p.cpu_parent
    return True


def our_line(e) -> str:
    """The innermost line of unmask/ among the Python frames above an op ("file.py(line): function")."""
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(ROOT):
            return p.name
        p = p.cpu_parent
    return "(outside unmask/)"


Rows = list[tuple[str, int, float]]  # (op or line, ops per call, ms per call)


def attribute(run, repeat: int) -> tuple[int, float, Rows, Rows]:
    """(ops per call, ms per call, by op [(name, count, ms)], by line [(line, count, ms)]): the
    top-level ops of `repeat` calls, CPU time of each op and what it called."""
    run()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        for _ in range(repeat):
            run()
    by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    by_line: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    n, total = 0, 0.0
    for e in prof.events():
        if not top_level(e):
            continue
        n += 1
        total += e.cpu_time_total
        for table, key in ((by_op, e.name), (by_line, our_line(e))):
            table[key][0] += 1
            table[key][1] += e.cpu_time_total
    rows = lambda t: sorted(((k, int(c) // repeat, us / repeat / 1e3) for k, (c, us) in t.items()),  # noqa: E731
                            key=lambda r: -r[1])
    return n // repeat, total / repeat / 1e3, rows(by_op), rows(by_line)


def table(title: str, rows: list[tuple[str, int, float]], top: int) -> list[str]:
    out = ["", title, "", "| | ops per call | ms per call |", "|---|---:|---:|"]
    out += [f"| `{k}` | {c} | {ms:.2f} |" for k, c, ms in rows[:top]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="sdar-170m", choices=sorted(SHAPES))
    ap.add_argument("--format", default="bfloat16", choices=sorted(FORMATS))
    ap.add_argument("--positions", type=int, default=4)
    ap.add_argument("--kv", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = load(random_folder(args.shape, Path(tmp)), FORMATS[args.format])
    lines = [f"# Ops of one {args.positions}-position call after {args.kv} stored positions: "
             f"random-weight {args.shape}, {args.format}", "",
             f"torch {torch.__version__}, one thread, load average {os.getloadavg()[0]:.1f}; "
             f"torch.profiler's top-level torch ops (aten::, mkldnn::; no op above them), CPU "
             f"time with what they called, per call (profiled calls are slower than plain ones)."]
    frames = {"the engine's frame (`memory_floor.py`'s call: one span, no mask)":
              call(model, 1, args.positions, args.kv),
              "a block-causal mask frame (what `memory_floor.py` timed before)":
              mask_call(model, args.positions, args.kv)}
    for name, run in frames.items():
        n, ms, by_op, by_line = attribute(run, args.repeat)
        lines += ["", f"## {name}: {n} ops, {ms:.1f} ms per call"]
        lines += table("By op:", by_op, args.top)
        lines += table("By the line of unmask/ that issued them:", by_line, args.top)
    lines += ["", "Command: `python scripts/probe/call_ops.py " + " ".join(sys.argv[1:]) + "`"]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
