"""Grammar libraries side by side: compile time and next-token mask time of outlines-core,
xgrammar and llguidance on the embedded model's tokenizer (2,048 tokens) and on a synthetic
128k-token vocabulary, plus unmask's own constraint (outlines-core's automaton, dense) on a
canvas of holes. One thread, CPU clock, medians. Writes benchmarks/bench/grammar-libraries.md.

    python scripts/bench/grammar_libraries.py [--out benchmarks/bench/grammar-libraries.md]

No 128k-vocabulary tokenizer can be downloaded here, so the large vocabulary is made: the
embedded tokenizer's tokens, then identifiers and punctuation runs from Python's standard
library sources (with and without a leading space) up to 128,000 tokens, a plausible BPE-like
mix of short and long tokens. It measures how costs grow with the vocabulary, not any one
published tokenizer.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"]}
STEPS = {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string"}},
                                          "answer": {"type": "integer"}},
         "required": ["steps", "answer"]}
SCHEMAS = {"answer": ANSWER, "steps+answer": STEPS, "any object": {"type": "object"}}
EOS = 1
OPENING = b'{"'  # the masks are measured after this opening


def clock(fn, n: int = 30) -> float:
    """Median CPU seconds of fn() over n calls."""
    times = []
    for _ in range(n):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times)


def vocabularies() -> dict[str, list[bytes]]:
    from unmask.api import DEFAULT_MODEL, load_tokenizer
    from unmask.decoding.grammar import token_bytes

    tok = load_tokenizer(DEFAULT_MODEL)
    small = token_bytes(tok)
    base = [small.get(i, b"") for i in range(len(tok))]
    seen = set(base)
    big = list(base)
    words = re.compile(rb"[A-Za-z_]{2,16}|[^\sA-Za-z0-9_]{2,4}|\d{1,3}")
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        for w in words.findall(path.read_bytes()):
            for t in (w, b" " + w):
                if t not in seen:
                    seen.add(t)
                    big.append(t)
        if len(big) >= 128_000:
            break
    return {"embedded (2,048)": base, f"synthetic ({len(big[:128_000]):,})": big[:128_000]}


def outlines_core(vocab: list[bytes], schema: dict) -> tuple[float, float]:
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    pattern = build_regex_from_schema(json.dumps(schema), "")
    v = Vocabulary(EOS, {b: [i] for i, b in enumerate(vocab) if b and i != EOS})
    t = time.process_time()
    index = Index(pattern, v)
    build = time.process_time() - t
    state = index.get_initial_state()
    for ch in OPENING:  # single-byte tokens of the opening
        state = index.get_next_state(state, vocab.index(bytes([ch])))
    return build, clock(lambda: index.get_allowed_tokens(state))


def xgrammar(vocab: list[bytes], schema: dict) -> tuple[float, float]:
    import xgrammar as xg

    info = xg.TokenizerInfo(vocab, xg.VocabType.RAW, stop_token_ids=[EOS])
    t = time.process_time()
    compiled = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps(schema), any_whitespace=False)
    build = time.process_time() - t
    m = xg.GrammarMatcher(compiled)
    for ch in OPENING:
        assert m.accept_token(vocab.index(bytes([ch])))
    mask = xg.allocate_token_bitmask(1, len(vocab))
    return build, clock(lambda: m.fill_next_token_bitmask(mask))


def llguidance(vocab: list[bytes], schema: dict) -> tuple[float, float]:
    import llguidance as llg
    import llguidance.numpy as lnp

    class Tok:
        eos_token_id, bos_token_id, tokens, special_token_ids = EOS, None, vocab, [EOS]

        def __call__(self, s):  # encoding is not measured: one byte a token
            return [vocab.index(bytes([b])) for b in s]

    t = time.process_time()
    tok = llg.LLTokenizer(llg.TokenizerWrapper(Tok()))
    grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                     defaults={"whitespace_flexible": False})
    m = llg.LLMatcher(tok, grammar)
    build = time.process_time() - t
    assert not m.is_error(), m.get_error()
    for ch in OPENING:
        m.consume_token(vocab.index(bytes([ch])))
    mask = lnp.allocate_token_bitmask(1, len(vocab))
    return build, clock(lambda: lnp.fill_next_token_bitmask(m, mask, 0))


def unmask_constraint(vocab: list[bytes], schema: dict) -> tuple[float, float]:
    """unmask's constraint: the dense automaton's build, then one step's masks of a block of
    32 holes on a 64-slot canvas holding the opening."""
    from unmask.decoding.grammar import Constraint, ResponseFormat, TokenAutomaton

    fmt = ResponseFormat.json_schema(schema)
    tokens = {i: b for i, b in enumerate(vocab) if b and i != EOS}
    t = time.process_time()
    a = TokenAutomaton.build(fmt.pattern, tokens, len(vocab), EOS)
    build = time.process_time() - t
    mask_id = 2
    c = Constraint(fmt, a, 64, mask_id)
    gen = np.full(64, mask_id)
    gen[: len(OPENING)] = [vocab.index(bytes([ch])) for ch in OPENING]
    slots = np.arange(len(OPENING), len(OPENING) + 32)

    def step() -> None:
        a.forget()  # a cold step: no hole vector nor move kept from the last
        c.allowed(gen, slots, len(vocab))

    return build, clock(step, n=5)


LIBRARIES = {"outlines-core": outlines_core, "xgrammar": xgrammar, "llguidance": llguidance,
             "unmask (outlines-core automaton, 32 holes)": unmask_constraint}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/bench/grammar-libraries.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for vname, vocab in vocabularies().items():
        for sname, schema in SCHEMAS.items():
            for lname, fn in LIBRARIES.items():
                if lname.startswith("unmask") and sname == "any object" and len(vocab) > 4096:
                    rows.append((vname, sname, lname, "not run (dense: states x vocab)", ""))
                    continue
                try:
                    build, mask = fn(vocab, schema)
                    rows.append((vname, sname, lname, f"{build * 1e3:,.1f}", f"{mask * 1e6:,.0f}"))
                except Exception as e:  # noqa: BLE001 - a library's failure is a result here
                    rows.append((vname, sname, lname, f"failed: {type(e).__name__}: {e}"[:80], ""))
                print(*rows[-1], sep=" | ", file=sys.stderr)
    lines = ["# Grammar libraries: compile and mask time",
             "",
             "Produced by `python scripts/bench/grammar_libraries.py` (one thread, CPU clock, medians;",
             "a shared 2-core machine). Compile: the schema to the library's token-level",
             "structure for the vocabulary (ms). Mask: the allowed-token set of one position",
             "after the opening `{\"` (us); for unmask's constraint, the masks of a block of 32",
             "holes on a 64-slot canvas in one step, from the forward and backward state sets.",
             "Compact JSON (no optional whitespace) everywhere.",
             "",
             "| vocabulary | schema | library | compile (ms) | mask (us) |",
             "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
