"""What tokenizing a chat costs `LLM.encode_messages`, with the piece cache (unmask.tokens,
`LLM.chat_tokens`) and without it (the whole rendered text through the tokenizer, as before),
side by side in one process: the shipped SDAR model's tokenizer, chat template included.

    PYTHONPATH=TREE .venv/bin/python scripts/probe/chat_tokens.py [--calls 200] [--rounds 3]

Workloads: "shared" (the ~1,500-character system prompt of
benchmarks/data/shared-system-prompt.txt + a short question, a different one every call),
"nothing" (a different question alone every call: no piece but the template's seen before).
Cached "first" is the first call on an emptied piece cache (the system prompt a miss; the
tokenizer's own word cache warm, as the uncached sides' is), over `--calls` // 10 of them;
every other cached row runs on one cache, warmed by one untimed call. Times are medians of
`--calls` calls; the rounds alternate which side runs first, the printed value is the median
over rounds.

The interpreter lock: a thread spinning a Python loop (an engine thread's stand-in) while the
calls run back to back for 0.5 s; "spinner share" is its loop rate against its rate alone,
"lock ms / call" the time it lost, per call (the comparable number: two threads that both hold
the lock share it ~50/50 by its 5 ms switch interval, however short each call). tokenizers'
batch call (which transformers' `encode` uses) releases the lock while Rust runs; its single
`encode` holds it: both are shown for the whole text.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

from unmask.api import LLM
from unmask.tokens import ChatTokens, PieceCache

SYSTEM = Path(__file__).resolve().parents[2] / "benchmarks/data/shared-system-prompt.txt"


def chats(n: int, system: str | None, offset: int = 0) -> list[list[dict]]:
    head = [] if system is None else [{"role": "system", "content": system}]
    return [[*head, {"role": "user", "content": f"What is {i} times {i + 7}? Think step by "
                     f"step."}] for i in range(offset, offset + n)]


def median_ms(call: Callable[[list[dict]], object], inputs: list[list[dict]]) -> float:
    times = []
    for m in inputs:
        t = time.perf_counter()
        call(m)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def lock_cost(call: Callable[[list[dict]], object], chat: Callable[[int], list[dict]],
              seconds: float = 0.5) -> tuple[float, float]:
    """(spinner's share of its solo rate, ms of it lost per call) while chat(0), chat(1), ...
    are encoded for `seconds`: many times the lock's 5 ms switch interval, which a few calls'
    total would not be."""
    spins, done = [0], [False]

    def spin() -> None:
        while not done[0]:
            spins[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)
    s0 = spins[0]
    time.sleep(0.2)  # the spinner alone: its solo rate
    rate = (spins[0] - s0) / 0.2
    s0, t, n = spins[0], time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        call(chat(n))
        n += 1
    wall, got = time.perf_counter() - t, spins[0] - s0
    done[0] = True
    th.join()
    return got / rate / wall, (wall - got / rate) / n * 1e3


Rows = dict[tuple[str, str, str], list[float]]


def one_round(llm: LLM, sides: dict[str, Callable[[list[dict]], object]], system: str,
              calls: int, r: int, rows: Rows) -> None:
    """Round r's numbers, appended to rows[(chat, side, "ms" | "share" | "lock")]."""
    for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
        for load, sys_text in (("shared", system), ("nothing", None)):
            llm.chat_tokens = ChatTokens(llm.tokenizer)
            sides[side](chats(1, sys_text, offset=10**6)[0])  # warm: the shared piece kept
            ms = median_ms(sides[side], chats(calls, sys_text, offset=r * calls))
            share, lost = lock_cost(sides[side],
                                    lambda i, s=sys_text: chats(1, s, offset=10**5 + i)[0])
            for k, v in (("ms", ms), ("share", share), ("lock", lost)):
                rows.setdefault((load, side, k), []).append(v)
    firsts = []
    for m in chats(max(1, calls // 10), system, offset=r * calls):
        llm.chat_tokens.cache = PieceCache()  # the tokenizer's own word cache stays warm
        firsts.append(median_ms(llm.encode_messages, [m]))
    rows.setdefault(("shared", "cached, first call", "ms"), []).append(statistics.median(firsts))


def table(rows: Rows, sides: list[str]) -> list[str]:
    out = ["| chat | encode_messages | ms / call | spinner share | lock ms / call |",
           "|:---|:---|---:|---:|---:|"]
    for load in ("shared", "nothing"):
        for side in ("cached, first call", *sides):
            if (load, side, "ms") not in rows:
                continue
            med = {k: statistics.median(v) for (lo, si, k), v in rows.items()
                   if (lo, si) == (load, side)}
            share = f"{med['share']:.0%}" if "share" in med else ""
            lock = f"{med['lock']:.3f}" if "lock" in med else ""
            out.append(f"| {load} | {side} | {med['ms']:.3f} | {share} | {lock} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    llm = LLM("unmask-sdar", device="cpu", prefix_cache=False)
    tok, backend = llm.tokenizer, llm.tokenizer.backend_tokenizer
    system = SYSTEM.read_text().strip()
    sides: dict[str, Callable[[list[dict]], object]] = {
        "uncached (transformers encode)":
            lambda m: tok.encode(llm.render_chat(m), add_special_tokens=False),
        "uncached (tokenizers encode, lock held)":
            lambda m: backend.encode(llm.render_chat(m), add_special_tokens=False).ids,
        "cached": llm.encode_messages,
    }
    rows: Rows = {}
    for r in range(a.rounds):
        one_round(llm, sides, system, a.calls, r, rows)
    shared = chats(1, system)[0]
    print(f"shared chat: {len(llm.render_chat(shared))} characters, "
          f"{len(llm.encode_messages(shared))} tokens; render_chat alone "
          f"{median_ms(llm.render_chat, chats(a.calls, system)):.3f} ms\n")
    print("\n".join(table(rows, list(sides))))


if __name__ == "__main__":
    main()
