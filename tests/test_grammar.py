"""Structured output (unmask.decoding.grammar, docs/decoders.md § Structured output): every
output of a constrained request is a word of its language, for every decoder, cache and suffix
policy, bidirectional and block-causal; FreeDave stays token-identical to its rule under a
constraint; a constrained row is batch-invariant beside unconstrained and differently
constrained rows. The models are tiny peaky random ones over a made-up vocabulary whose tokens
spell a small JSON-like language (single characters and a few multi-character tokens).
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from helpers import assert_batch_invariant, peaky_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unmask.decoding import grammar
from unmask.decoding.grammar import (
    Automata,
    Constraint,
    GrammarError,
    ResponseFormat,
    TokenAutomaton,
    as_format,
    check_decoder,
)
from unmask.decoding.params import DecodeParams
from unmask.engine import decode

VOCAB, MASK, EOS = 64, 63, 1
CHARS = '{}":,ab0123456789tfrueals[]xyz -'
MULTI = ['{"', '":', ',"', 'true', 'false', '12', '00', '"}', '"a', '"b']
# token id -> bytes: ids 2.. spell CHARS then MULTI; the rest (and 0) spell nothing the
# language uses ("#").
TOKENS = {i: b"#" for i in range(VOCAB) if i not in (MASK, EOS)}
for _i, _s in enumerate(list(CHARS) + MULTI):
    TOKENS[2 + _i] = _s.encode()
PATTERN = r'\{"a":(0|[1-9][0-9]*),"b":(true|false)\}'
LISTS = r'\[(0|[1-9][0-9]?)(,(0|[1-9][0-9]?))*\]'  # no fixed length: much to choose
N_EXAMPLES = int(os.environ.get("UNMASK_EXAMPLES", "20"))
PROPERTY = settings(max_examples=N_EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DECODERS = ["static-1", "static,steps=12", "threshold,threshold=0.5", "freedave,draft_steps=4",
            "freedave++,draft_steps=4,threshold=0.5", "entropy_bounded,eb_threshold=2",
            "factor", "threshold,threshold=0.5,cache=dual", "threshold,threshold=0.5,suffix=window",
            "fast", "balanced", "static-1,temperature=1,seed=5"]


def automaton(pattern: str = PATTERN) -> TokenAutomaton:
    return TokenAutomaton.build(pattern, TOKENS, VOCAB, EOS, encode=encode)


def encode(text: str) -> list[int]:
    """Greedy longest-match over the made-up vocabulary (the scaffold's tokenizer)."""
    by = {v.decode(): k for k, v in TOKENS.items() if v != b"#"}
    out, i = [], 0
    while i < len(text):
        piece = max((p for p in by if text.startswith(p, i)), key=len)
        out.append(by[piece])
        i += len(piece)
    return out


def constraint(budget: int, pattern: str = PATTERN, mode: str = "complete",
               prior: float = 0.0) -> Constraint:
    return Constraint(ResponseFormat.regex(pattern, mode, prior), automaton(pattern), budget, MASK)


def text(token_ids: list[int]) -> str:
    cut = token_ids.index(EOS) if EOS in token_ids else len(token_ids)
    return b"".join(TOKENS[t] for t in token_ids[:cut]).decode()


def run(kind: str, spec: str, prompts: list[list[int]], cons: list, gen: int = 24,
        block: int = 4, seed: int = 0):
    params = DecodeParams.parse(spec, gen_length=gen, block_length=block)
    model = peaky_model(kind, seed, 4.0, VOCAB, MASK, EOS)
    return decode(model, params, prompts, mask_id=MASK, eos_id=EOS, constraints=cons)


prompt_lists = st.lists(st.lists(st.integers(2, 62), min_size=1, max_size=6), min_size=1,
                        max_size=3)


# --- the guarantee -------------------------------------------------------------------------------
@PROPERTY
@given(kind=st.sampled_from(["llada", "Dream", "sdar"]), spec=st.sampled_from(DECODERS),
       prompts=prompt_lists, seed=st.integers(0, 3), pattern=st.sampled_from([PATTERN, LISTS]),
       mode=st.sampled_from(["complete", "prefix"]), prior=st.sampled_from([0.0, 2.0]))
def test_every_output_is_a_word_of_the_language(kind: str, spec: str, prompts: list[list[int]],
                                                 seed: int, pattern: str, mode: str,
                                                 prior: float) -> None:
    if mode == "prefix" and "freedave" in spec or spec in ("fast", "exact"):
        mode = "complete"  # the baseline runs with the plain rules (check_decoder)
    if kind == "sdar" and ("cache" in spec or "suffix" in spec or spec in ("balanced", "fast")):
        spec = "threshold,threshold=0.5,cache=block"  # a block-causal model's own cache
    cons = [constraint(20, pattern, mode, prior) for _ in prompts]
    for r in run(kind, spec, prompts, cons, seed=seed):
        # "length" only where the word fills the budget exactly (no room for its EOS)
        assert r.finish_reason == "eos" or EOS not in r.token_ids[:20]
        assert re.fullmatch(pattern, text(r.token_ids[:20])), text(r.token_ids)


def test_the_unconstrained_model_does_not_write_the_language() -> None:
    """What the guarantee is worth: the same models, unconstrained, never write a word of it."""
    for kind in ("llada", "Dream", "sdar"):
        for r in run(kind, "threshold,threshold=0.5", [[5, 6, 7], [9, 10]], [None, None]):
            assert not re.fullmatch(PATTERN, text(r.token_ids))


def test_length_when_no_word_fits() -> None:
    """A budget too short for any word: the output is a prefix of one, finish reason length."""
    [r] = run("llada", "threshold,threshold=0.5", [[5, 6, 7]], [constraint(4)], gen=8)
    assert r.finish_reason == "length"
    assert EOS not in r.token_ids[:4]
    assert '{"a":0,"b":true}'.startswith(text(r.token_ids[:4])[:2])


def test_allowed_is_exactly_what_keeps_the_canvas_completable() -> None:
    """The mask at a hole, against brute force: a token is allowed iff the canvas with it at
    the hole can still be completed."""
    c = constraint(12)
    rng = np.random.default_rng(0)
    for _ in range(20):
        gen = np.full(12, MASK)
        for i in rng.choice(12, 3, replace=False):  # a few committed tokens, maybe infeasible
            gen[i] = rng.choice([2 + CHARS.index(ch) for ch in '{}":,ab01t'] + [EOS])
        if not c.feasible(gen):
            continue
        holes = np.flatnonzero(gen == MASK)
        allowed = c.allowed(gen, holes, VOCAB)
        for k, i in enumerate(holes):
            for t in range(VOCAB):
                trial = gen.copy()
                trial[i] = t
                assert allowed[k, t] == (t != MASK and c.feasible(trial)), (gen, i, t)


def test_weights_are_the_mask_without_the_length_prior() -> None:
    """Weight 0 on every allowed token, -inf on the others, when the prior is off."""
    c = constraint(12)
    gen = c.initial.copy()
    holes = np.flatnonzero(gen == MASK)
    w = c.weights(gen, holes, VOCAB)
    allowed = c.allowed(gen, holes, VOCAB)
    assert (w[allowed] == 0).all() and (w[~allowed] == -np.inf).all()


def test_the_length_prior_weighs_how_far_a_token_pushes_the_shortest_word() -> None:
    """With the prior, a digit far past the shortest word's end loses the prior's weight for
    every slot it pushes that end right; EOS pushes nothing; the allowed set is unchanged."""
    prior = 2.0
    c = constraint(24, prior=prior)
    gen = c.initial.copy()  # '{"a":' then holes: the shortest word is '{"a":0,"b":true}'
    shortest = len(encode('{"a":0,"b":true}'))
    assert c._word_start(gen) == len(encode('{"a":'))
    holes = np.flatnonzero(gen == MASK)
    w = c.weights(gen, holes, VOCAB)
    assert ((w > -np.inf) == c.allowed(gen, holes, VOCAB)).all()
    digit = 2 + CHARS.index("7")
    far = int(np.flatnonzero(holes == 14)[0])
    # '7' at slot 14 leaves the word ',"b":true}' to finish after it
    push = 14 + 1 + len(encode(',"b":true}')) - shortest
    assert push > 1
    assert w[far, digit] == pytest.approx(-prior * push)
    assert w[far, EOS] == 0 and w[far].max() == 0
    first = int(np.flatnonzero(holes == len(encode('{"a":')))[0])
    assert w[first, digit] == 0  # where a value must start, a digit pushes nothing


def test_the_length_prior_closes_a_value_the_model_would_run_on() -> None:
    """The trained LLaDA never saw JSON: asked for {"answer": <integer>}, its constrained
    distribution puts digits where its prose has them, and without the prior the integer runs
    on for dozens of digits; with it, the word closes short and in fewer model calls."""
    from dataclasses import replace

    from unmask import LLM

    llm = LLM("unmask-llada")
    fmt = ResponseFormat.json_schema({"type": "object", "properties": {
        "answer": {"type": "integer"}}, "required": ["answer"]})
    prompt = ["A shop has 60 apples and gets 9 more. How many apples does it have?"]
    [on] = llm.generate(prompt, "threshold,threshold=0.9", gen_length=64, response_format=fmt)
    [off] = llm.generate(prompt, "threshold,threshold=0.9", gen_length=64,
                         response_format=replace(fmt, length_penalty=0.0))
    assert fmt.accepts(on.text) and fmt.accepts(off.text)
    assert on.useful <= 16 < off.useful, (on.text, off.text)
    assert on.nfe < off.nfe


def test_scaffold_is_the_fixed_opening() -> None:
    c = constraint(20)
    assert text(c.initial[c.initial != MASK].tolist()) == '{"a":'
    assert (c.initial[len(encode('{"a":')):] == MASK).all()


def test_settle_writes_what_the_commits_fixed() -> None:
    """After a commit that leaves one way on, the fixed text is written in the tokenizer's own
    tokens (`,"b":` after the integer 0, which no digit may follow), and a hole whose one
    allowed token is not EOS is written (the closing brace before a committed EOS); a hole
    that may only be EOS is left to the rule, and the baseline writes nothing."""
    c = constraint(20)
    gen = c.initial.copy()
    at = len(encode('{"a":'))
    gen[at] = encode("0")[0]
    got = c.settle(gen)
    fixed = encode(',"b":')
    assert got[at + 1 : at + 1 + len(fixed)].tolist() == fixed
    assert (got[at + 1 + len(fixed) :] == MASK).all()  # true or false: a choice
    word = encode('{"a":0,"b":true')
    gen = np.full(20, MASK)
    gen[: len(word)] = word
    gen[len(word) + 1] = EOS  # the hole before it can only be the closing brace
    got = c.settle(gen)
    assert text(got.tolist()) == '{"a":0,"b":true}'
    assert (got[len(word) + 2 :] == MASK).all()  # EOS alone: not written
    assert (constraint(20, mode="prefix").settle(gen) == gen).all()


@pytest.mark.parametrize("kind", ["llada", "sdar"])
def test_settled_tokens_are_written_at_their_step(kind: str) -> None:
    """What settling writes is committed at the step that wrote it, as the rule's commits are
    (the caches' recency reads it): only the scaffold and early exit's EOS fill have none."""
    import torch

    from unmask.engine.decoder import Decoder
    from unmask.engine.request import Request

    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    params = DecodeParams.parse("threshold,threshold=0.5", gen_length=20, block_length=4)
    dec = Decoder(model, params, MASK, EOS)
    settled = 0  # tokens written by no decision of the rule
    for prompt in ([5, 6, 7], [9, 10], [3]):
        b = dec.new_batch()
        c = constraint(20)
        b.extend([Request(prompt, params, block_size=4 if kind == "sdar" else None,
                          constraint=c)])
        while not b.rows.done.all():
            before, decided = b.x.copy(), int(b.rows.decided[0])
            with torch.no_grad():
                dec.step(b)
            written = (before == MASK) & (b.x != MASK)
            written[0, b.P : b.P + 20] &= c.initial == MASK  # the scaffold: before any step
            if b.rows.done[0]:  # early exit's EOS fill is no commit
                written &= b.x != EOS
            assert (b.commit_step[written] == b.rows.step[0] - 1).all()
            settled += int(written.sum()) - (int(b.rows.decided[0]) - decided)
        assert c.format.accepts(text(b.x[0, b.P : b.P + 20].tolist()))
    assert settled > 0


def test_restrict_keeps_the_commit_order_prefix_that_stays_completable() -> None:
    """Two holes each allowed alone, not together: only the better ranked one commits."""
    c = constraint(7, r"ab|ba")
    gen = np.full(7, MASK)
    a = 2 + CHARS.index("a")
    token = np.full(7, MASK)
    token[0], token[1] = a, a  # "aa" is no word
    sel = np.zeros(7, dtype=bool)
    sel[:2] = True
    rank = np.array([1, 0, 2, 3, 4, 5, 6])
    kept = c.restrict(gen, sel, token, rank)
    assert kept.tolist() == [False, True] + [False] * 5


# --- lossless stays lossless, batching ---------------------------------------------------------
@PROPERTY
@given(kind=st.sampled_from(["llada", "Dream", "sdar"]), prompts=prompt_lists,
       seed=st.integers(0, 3), k=st.integers(2, 8), pair=st.sampled_from(
           [("freedave", "static-1"), ("freedave++", "threshold")]),
       pattern=st.sampled_from([PATTERN, LISTS]), prior=st.sampled_from([0.0, 2.0]))
def test_freedave_is_exact_under_a_constraint(kind: str, prompts: list[list[int]], seed: int,
                                              k: int, pair: tuple[str, str], pattern: str,
                                              prior: float) -> None:
    drafts, rule = pair
    extra = ",threshold=0.5" if rule == "threshold" else ""
    cons = [constraint(20, pattern, prior=prior) for _ in prompts]
    got = run(kind, f"{drafts},draft_steps={k}{extra}", prompts, cons, seed=seed)
    want = run(kind, rule + extra, prompts, cons, seed=seed)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(g.nfe <= w.nfe for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("kind", ["llada", "sdar"])
@pytest.mark.parametrize("spec", ["threshold,threshold=0.5", "freedave++,threshold=0.5"])
def test_constrained_row_is_batch_invariant(kind: str, spec: str) -> None:
    """A constrained request alone == beside unconstrained and differently constrained rows,
    joining late, one of them aborted."""
    model = peaky_model(kind, 1, 4.0, VOCAB, MASK, EOS)
    mine, theirs = constraint(16, prior=2.0), constraint(16, LISTS)

    def make(gen: int, seed: int) -> DecodeParams:
        return DecodeParams.parse(spec, gen_length=gen, block_length=4, seed=seed)

    import unmask.engine.engine as engine_mod

    add = engine_mod.Engine.add_request

    def add_constrained(self, prompt, params, *a, **kw):  # the target is the constrained one
        if list(prompt) == [5, 6, 7, 8]:
            kw["constraint"] = mine
        elif list(prompt) == [9, 10]:
            kw["constraint"] = theirs
        return add(self, prompt, params, *a, **kw)

    engine_mod.Engine.add_request = add_constrained
    try:
        assert_batch_invariant(model, make, [5, 6, 7, 8], [([9, 10], 16), ([3, 4, 5], 24)],
                               join_at=2, abort_at=3, mask=MASK, eos=EOS)
    finally:
        engine_mod.Engine.add_request = add


# --- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "says"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
     "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "hostname"}}}}},
     "unsupported JSON schema feature: Format hostname"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": False,
                                             "schema": {"type": "object"}}}, "strict: false"),
    ({"type": "xml"}, "type must be text, json_object or json_schema"),
    ({"type": "json_schema"}, "needs an object with a 'schema'"),
])
def test_bad_response_formats_are_one_line(value: dict, says: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(says)) as e:
        as_format(value)
    assert "\n" not in str(e.value)


def test_bad_regex_and_decoders_are_refused() -> None:
    with pytest.raises(GrammarError, match="invalid regular expression"):
        ResponseFormat.regex("a(b")
    with pytest.raises(GrammarError, match="length_penalty must be a number >= 0"):
        ResponseFormat.regex("ab", length_penalty=-1)
    with pytest.raises(GrammarError, match="drop suppress_eos"):
        check_decoder(constraint(8), DecodeParams.parse("static-1,suppress_eos=true", gen_length=8,
                                                         block_length=8))
    with pytest.raises(GrammarError, match="plain rules"):
        check_decoder(constraint(8, mode="prefix"),
                      DecodeParams.parse("freedave", gen_length=8, block_length=8))
    with pytest.raises(GrammarError, match="exceeds gen_length"):
        check_decoder(constraint(16), DecodeParams.parse("static-1", gen_length=8, block_length=8))


# --- limits: what one format, and the formats an LLM keeps, may cost ----------------------------
@pytest.mark.parametrize(("pattern", "positions"), [
    ("ab", 2), ("a{0,500}", 500), ("(ab|cd){3}", 12), ("x{5}y*", 6), ("(?:a[bc]){2,}", 4),
])
def test_pattern_positions_write_counted_repetitions_out(pattern: str, positions: int) -> None:
    assert grammar.pattern_positions(pattern) == positions


def test_a_format_too_large_is_refused_before_anything_is_built(monkeypatch) -> None:
    import outlines_core

    def no_index(*a, **kw):
        raise AssertionError("outlines-core was asked to build an index")

    monkeypatch.setattr(outlines_core, "Index", no_index)
    with pytest.raises(GrammarError, match="the response format is too large: its regular "
                       "expression has 4,000 positions") as e:
        automaton("(ab|cd){1000}")
    assert "\n" not in str(e.value)


def test_a_format_with_too_many_states_is_refused(monkeypatch) -> None:
    # "a" then up to 40 more: 42 outlines-core states + END and DEAD
    monkeypatch.setattr(grammar, "MAX_STATES", 40)
    with pytest.raises(GrammarError, match="its automaton has 4[0-9] states"):
        automaton('"a{1,40}"')
    assert automaton('"a{1,8}"').n_states < 40
    monkeypatch.setattr(grammar, "MAX_STATES", 4096)
    monkeypatch.setattr(grammar, "MAX_AUTOMATON_BYTES", 1000)  # the dense arrays' bytes
    with pytest.raises(GrammarError, match="MiB over a 64-token vocabulary"):
        automaton('"a{1,40}"')


def test_kept_automata_stay_under_their_budget_least_recent_dropped_first() -> None:
    built = []

    def make(pattern: str):
        def build() -> TokenAutomaton:
            built.append(pattern)
            return automaton(pattern)
        return build

    one = automaton("ab").nbytes
    kept = Automata(budget=2 * one + one // 2)  # room for two
    first = kept.get(("ab", "regex"), make("ab"))
    kept.get(("ba", "regex"), make("ba"))
    assert kept.get(("ab", "regex"), make("ab")) is first  # kept, and now the most recent
    kept.get(("aa", "regex"), make("aa"))  # drops "ba", the least recent
    assert len(kept) == 2 and kept.nbytes <= kept.budget
    kept.get(("ab", "regex"), make("ab"))
    kept.get(("ba", "regex"), make("ba"))
    assert built == ["ab", "ba", "aa", "ba"]
    # one larger than the whole budget is built for its request and not kept
    tiny = Automata(budget=one // 2)
    tiny.get(("ab", "regex"), make("ab"))
    assert len(tiny) == 0 and built[-1] == "ab"


def test_text_and_absent_formats_are_none() -> None:
    assert as_format(None) is None and as_format({"type": "text"}) is None


# --- the doors on the embedded model (its byte-level tokenizer) --------------------------------
def test_llm_generate_and_the_cli(capsys) -> None:
    from pydantic import BaseModel

    from unmask import LLM
    from unmask.cli import main

    class Answer(BaseModel):
        answer: int

    [g] = LLM().generate(["What is 2 + 3?"], "threshold", gen_length=32, response_format=Answer)
    assert g.finish_reason in ("eos", "length") and Answer.model_validate_json(g.text)
    assert main(["generate", "Is 7 prime?", "--regex", "(yes|no)", "--gen-length", "32",
                 "--decoder", "threshold"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert main(["generate", "hi", "--regex", "a(b"]) == 2
    assert main(["generate", "hi", "--json-schema", "/no/such/schema.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "invalid regular expression" in err[0] and "readable file" in err[1]


def test_length_penalty_on_the_cli_and_llm_generate(capsys) -> None:
    """--length-penalty and LLM.generate(length_penalty=...) set the format's prior weight (a
    heavy one closes the integer at its first digit); a negative or NaN weight, or one with
    no format, is one line and exit 2."""
    from unmask import LLM
    from unmask.cli import main

    schema = json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}},
                         "required": ["answer"]})
    prompt, spec = "What is 47 + 38?", "threshold,threshold=0.9"
    llm = LLM()
    texts = {w: llm.generate([prompt], spec, gen_length=32, length_penalty=w,
                             response_format=ResponseFormat.json_schema(schema))[0].text
             for w in (0.0, 100.0)}
    assert re.fullmatch(r'\{"answer":-?[0-9]\}', texts[100.0]) and texts[0.0] != texts[100.0]
    for w in (0.0, 100.0):
        assert main(["generate", prompt, "--json-schema", schema, "--length-penalty", str(w),
                     "--gen-length", "32", "--decoder", spec]) == 0
        assert capsys.readouterr().out.strip() == texts[w]
    for bad in (["--json-schema", schema, "--length-penalty", "-1"],
                ["--regex", "a+", "--length-penalty", "nan"], ["--length-penalty", "1"]):
        assert main(["generate", "hi", *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all("length_penalty" in line for line in err), err
    with pytest.raises(GrammarError, match="give a JSON schema"):
        llm.generate([prompt], spec, gen_length=32, length_penalty=1.0)


def test_a_commit_writes_the_key_it_fixes_in_the_same_step() -> None:
    """unmask-sdar asked for {"steps": [string], "answer": <integer>} closes the list, and
    `,"answer":` is written in the same step in the tokenizer's own tokens, decided by no
    forward (TPF does not count it); the model once spent five forwards choosing among the
    key's tokenizations."""
    from unmask import LLM
    from unmask.tasks.math import make_split

    llm = LLM("unmask-sdar")
    fmt = ResponseFormat.json_schema({"type": "object", "properties": {
        "steps": {"type": "array", "items": {"type": "string"}}, "answer": {"type": "integer"}},
        "required": ["steps", "answer"]})
    prompt = [p for p in make_split("heldout", 16) if p.answer.lstrip("-").isdigit()][2].prompt
    events: list = []
    [g] = llm.generate([prompt], "threshold,threshold=0.9", gen_length=64, response_format=fmt,
                       on_event=events.append)
    assert fmt.accepts(g.text) and g.text.startswith('{"steps":[]')
    ids = g.token_ids
    close = ids.index(llm.tokenizer.encode("]", add_special_tokens=False)[0])
    step = next(i for i, e in enumerate(events) if close in e.positions)
    key = llm.tokenizer.encode(',"answer":', add_special_tokens=False)
    assert ids[close + 1 : close + 1 + len(key)] == key
    assert set(range(close + 1, close + 1 + len(key))) <= set(events[step].positions)
    decided = events[step].decided - (events[step - 1].decided if step else 0)
    assert decided <= len(events[step].positions) - len(key)


def test_the_moves_remembered_between_canvases_change_nothing() -> None:
    """A constraint whose automaton remembers the moves between state sets (its memo bounded
    to a few, so it is cleared again and again) answers as one on a fresh automaton on every
    canvas of a random walk of commits and retractions (the last slot committed included)."""
    rng = np.random.default_rng(1)
    kept = constraint(10)
    kept.a.sets._moves_max = 5
    gen = np.full(10, MASK)
    for _ in range(200):
        i = int(rng.integers(10))
        gen[i] = MASK if rng.random() < 0.3 else rng.choice([2 + CHARS.index(ch) for ch in
                                                              '{}":,ab01t'] + [EOS])
        fresh = constraint(10)
        assert kept.feasible(gen) == fresh.feasible(gen)
        holes = np.flatnonzero(gen == MASK)
        if holes.size and fresh.feasible(gen):
            assert (kept.allowed(gen, holes, VOCAB) == fresh.allowed(gen, holes, VOCAB)).all()
    assert len(kept.a.sets._moves) <= 5  # the memo stays within its bound


def test_trace_shows_the_scaffold(tmp_path) -> None:
    """`unmask trace` with a constraint: the layout names the constrained slots and the
    scaffold, which the first step commits."""
    from unmask.cli import main

    out = tmp_path / "t.json"
    assert main(["trace", "What is 2 + 3?", "--decoder", "threshold", "--gen-length", "32",
                 "--regex", "ok: [0-9]+", "--out", str(tmp_path / "t.png"),
                 "--json", str(out)]) == 0
    events = json.loads(out.read_text())["events"]
    layout = events[0]
    assert layout["constrained"] == 32 and layout["scaffold"] == [0, 1, 2]  # "ok", ":", " "
    first = next(e for e in events if e["event"] == "step")
    assert set(layout["scaffold"]) <= set(first["positions"])
    assert re.fullmatch("ok: [0-9]+", next(e for e in events if e["event"] == "done")["text"])
    # the PNG marks the constrained slots (a bar under each) as the live page does
    from PIL import Image

    from unmask.trace import CONSTRAINED
    pixels = np.asarray(Image.open(tmp_path / "t.png").convert("RGB")).reshape(-1, 3)
    assert (pixels == CONSTRAINED).all(-1).sum() > 32 * 10
