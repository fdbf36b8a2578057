"""Decoders on synthetic logits: a fake model whose logits are a deterministic function of the
canvas lets every step be checked against a plain re-implementation of docs/design.md
§ Reference decoders."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from itertools import pairwise

import numpy as np
import pytest
import torch
from helpers import tiny_model
from torch import Tensor, nn

from unmask.config import ModelConfig
from unmask.decoding.params import METHODS, DecodeParams, SpecError
from unmask.decoding.rules import rank, static_count
from unmask.engine import decode as engine_decode
from unmask.kv import Frame

V, MASK, EOS = 32, 2, 1
LogitFn = Callable[[Tensor, Tensor], Tensor]  # (ids (T,), positions (T,)) -> logits (T, V)


def hashed_logits(seed: int = 0, table_size: int = 997) -> LogitFn:
    """Logits looked up from a random table by a hash of (position, the committed canvas).

    Rows have random sharpness, so confidences spread over (0, 1) and some pass 0.9; any
    difference in what was committed earlier changes every later prediction.
    """
    g = torch.Generator().manual_seed(seed)
    sharp = torch.exp(torch.empty(table_size, 1).uniform_(-1.0, 2.5, generator=g))
    table = torch.randn(table_size, V, generator=g) * sharp
    table[:, MASK] = -30.0

    def fn(ids: Tensor, pos: Tensor) -> Tensor:
        known = ids != MASK
        state = int(((ids * (pos + 1) * 7919) * known).sum()) + 31 * int((~known).sum())
        return table[(pos * 1_000_003 + state) % table_size]

    return fn


def constant_logits(row: Tensor) -> LogitFn:
    return lambda ids, pos: row.expand(len(ids), V).clone()


class FakeModel(nn.Module):
    """The model interface the decoder uses, with logits from `fn`; records every call."""

    logit_shift = 0

    def __init__(self, fn: LogitFn) -> None:
        super().__init__()
        self.config = ModelConfig(d_model=8, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=8,
                                  vocab_size=V, embedding_size=V, mask_token_id=MASK,
                                  eos_token_id=EOS)
        self.dummy = nn.Parameter(torch.zeros(1))
        self.fn = fn
        self.calls: list[tuple[Tensor, Tensor, Tensor]] = []

    def embed(self, input_ids: Tensor) -> Tensor:
        return torch.zeros(*input_ids.shape, self.config.d_model)

    def forward(self, input_ids: Tensor, position_ids: Tensor, frame=None, embeds=None,
                logits_at: tuple[Tensor, Tensor] | None = None) -> Tensor:
        if frame is not None and frame.packed:  # (1, N) real tokens: back to padded rows
            ok = frame.key_mask
            out = self.forward(frame.rows(input_ids), frame.rows(position_ids), Frame(key_mask=ok))
            return out[ok][None] if logits_at is None else out[ok][None][logits_at]
        ok = frame.key_mask if frame is not None and frame.key_mask is not None else \
            torch.ones_like(input_ids, dtype=torch.bool)
        self.calls.append((input_ids.clone(), position_ids.clone(), ok.clone()))
        out = torch.zeros(*input_ids.shape, V)
        for r in range(input_ids.shape[0]):
            k = ok[r]
            out[r, k] = self.fn(input_ids[r, k], position_ids[r, k])
        return out if logits_at is None else out[logits_at]


def decode(fn: LogitFn, spec: str, prompts: list[list[int]], gen_length: int = 16,
           block_length: int = 8) -> tuple[list[list[int]], FakeModel, list]:
    model = FakeModel(fn)
    params = DecodeParams.parse(spec, gen_length=gen_length, block_length=block_length)
    results = engine_decode(model, params, prompts, mask_id=MASK, eos_id=EOS)
    return [r.token_ids for r in results], model, results


def canvases(model: FakeModel, prompt: list[int], final: list[int]) -> list[list[int]]:
    """The canvas each forward saw (a single row, its real tokens: a call pads them to a
    canonical count), then the final canvas."""
    out = []
    for ids, pos, ok in model.calls:
        assert ids.shape[0] == 1
        ids, pos = ids[0][ok[0]], pos[0][ok[0]]
        assert pos.tolist() == list(range(ids.shape[0]))
        out.append(ids.tolist())
    return out + [prompt + final]


def reference(fn: LogitFn, prompt: list[int], method: str, gen_length: int, block_length: int,
              steps: int | None = None, tau: float = 0.9,
              remasking: str = "low_confidence") -> tuple[list[int], list[list[int]]]:
    """docs/design.md § Reference decoders, written plainly: LLaDA's static schedule / threshold
    at temperature 0, ties to the lowest position and the lowest token id, the mask token never
    predicted but its share kept in the softmax the scores come from (§ Vocabulary)."""
    p, x = len(prompt), prompt + [MASK] * gen_length
    seen = []
    n_blocks = gen_length // block_length
    for b in range(n_blocks):
        lo, hi = p + b * block_length, p + (b + 1) * block_length
        s = (steps or gen_length) // n_blocks
        m = block_length
        schedule = [m // s + (1 if i < m % s else 0) for i in range(s)]
        step = 0
        while MASK in x[lo:hi]:
            seen.append(list(x))
            t = torch.tensor(x)
            logits = fn(t, torch.arange(len(x))).float().clone()
            prob = torch.softmax(logits, -1)
            chosen = logits.clone()
            chosen[:, MASK] = float("-inf")
            tok = [int(row.tolist().index(max(row.tolist()))) for row in chosen]  # first max
            if remasking == "topk_margin":  # Dream's rules (docs/design.md § Reference decoders)
                top2 = prob.topk(2, -1).values
                conf = (top2[:, 0] - top2[:, 1]).tolist()
            elif remasking == "entropy":
                conf = (prob * torch.log_softmax(logits, -1).clamp_min(-1e30)).sum(-1).tolist()
            else:
                conf = prob.gather(-1, torch.tensor(tok)[:, None]).squeeze(-1).tolist()
            cand = [i for i in range(lo, hi) if x[i] == MASK]
            order = sorted(cand, key=lambda i: (-conf[i], i))
            if method == "static":
                k = schedule[step]
            elif method == "static-1":
                k = 1
            elif method == "factor":  # the n best commit when the n-th is >= 1 - f/(n+1)
                k = max([1] + [n for n in range(1, len(order) + 1)
                               if all(conf[order[j - 1]] >= 1 - tau / (j + 1)
                                      for j in range(1, n + 1))])
            else:
                k = max(1, sum(conf[i] >= tau for i in cand))
            for i in order[:k]:
                x[i] = tok[i]
            step += 1
    return x[p:], seen + [list(x)]


PROMPT = [7, 8, 9, 10, 11]


# --- every step against the reference ------------------------------------------------------------
@pytest.mark.parametrize("spec, method, steps, gen, block", [
    ("static-1", "static-1", None, 16, 8),
    ("static,steps=6", "static", 6, 16, 8),
    ("static,steps=9", "static", 9, 24, 8),
    ("static,steps=4", "static", 4, 10, 10),
    ("static,steps=16", "static", 16, 16, 4),
    ("threshold", "threshold", None, 16, 8),
    ("threshold,threshold=0.5", "threshold", None, 16, 16),
    ("factor", "factor", None, 16, 8),
    ("factor,factor=0.5", "factor", None, 16, 16),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_steps_match_reference(spec: str, method: str, steps: int | None, gen: int, block: int,
                               seed: int) -> None:
    fn = hashed_logits(seed)
    tau = 0.5 if "0.5" in spec else 1.0 if method == "factor" else 0.9  # threshold or factor
    out, model, res = decode(fn, spec, [PROMPT], gen, block)
    want, want_canvases = reference(fn, PROMPT, method, gen, block, steps, tau)
    assert canvases(model, PROMPT, out[0]) == want_canvases
    assert out[0] == want
    assert res[0].nfe == len(want_canvases) - 1 == len(model.calls)
    assert res[0].token_forwards == res[0].nfe * (len(PROMPT) + gen)


@pytest.mark.parametrize("remasking", ["maskgit_plus", "topk_margin", "entropy"])
@pytest.mark.parametrize("seed", [0, 1])
def test_confidence_rules_match_reference(remasking: str, seed: int) -> None:
    fn = hashed_logits(seed)
    out, model, _ = decode(fn, f"static,steps=8,remasking={remasking}", [PROMPT], 16, 8)
    want, want_canvases = reference(fn, PROMPT, "static", 16, 8, 8, remasking=remasking)
    assert canvases(model, PROMPT, out[0]) == want_canvases


def test_confidence_rules_differ() -> None:
    """The rules really rank differently on these logits (so the test above can tell them apart)."""
    fn = hashed_logits(0)
    outs = {r: reference(fn, PROMPT, "static-1", 16, 8, remasking=r)[1]
            for r in ("low_confidence", "topk_margin", "entropy")}
    assert len({str(v) for v in outs.values()}) == 3


@pytest.mark.parametrize("spec", ["static-1", "static,steps=6", "threshold"])
def test_only_masked_positions_of_current_block_commit(spec: str) -> None:
    block = 4
    out, model, _ = decode(hashed_logits(3), spec, [PROMPT], 12, block)
    seen = canvases(model, PROMPT, out[0])
    p = len(PROMPT)
    for before, after in pairwise(seen):
        changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
        assert changed, "a step committed nothing"
        first_mask = next(i for i in range(p, len(before)) if before[i] == MASK)
        lo = p + (first_mask - p) // block * block
        for i in changed:
            assert before[i] == MASK, f"slot {i} was already committed"
            assert lo <= i < lo + block, f"slot {i} is outside the current block [{lo}, {lo + block})"
            assert after[i] != MASK
    assert MASK not in seen[-1]


@pytest.mark.parametrize("gen, block, steps, per_block", [
    (16, 8, 6, [3, 3, 2]),
    (10, 10, 4, [3, 3, 2, 2]),
    (24, 8, 9, [3, 3, 2]),
    (16, 8, 16, [1] * 8),
    (16, 16, 1, [16]),
])
def test_static_commit_counts_follow_llada_schedule(gen: int, block: int, steps: int,
                                                    per_block: list[int]) -> None:
    out, model, res = decode(hashed_logits(5), f"static,steps={steps}", [PROMPT], gen, block)
    seen = canvases(model, PROMPT, out[0])
    counts = [sum(a == MASK and b != MASK for a, b in zip(x, y, strict=True)) for x, y in pairwise(seen)]
    assert counts == per_block * (gen // block)
    assert res[0].nfe == steps


def test_static_count_function() -> None:
    m = np.array([8, 8, 8, 7])
    got = [static_count(m, 3, np.full(4, i)).tolist() for i in range(3)]
    assert got == [[3, 3, 3, 3], [3, 3, 3, 2], [2, 2, 2, 2]]


@pytest.mark.parametrize("spec, method, steps", [("static-1", "static-1", None),
                                                  ("static,steps=8", "static", 8),
                                                  ("threshold,threshold=0.1", "threshold", None)])
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_tiny_model_matches_reference(model_type: str, spec: str, method: str,
                                      steps: int | None) -> None:
    """A real (random) model through the engine equals the plain reference on full-canvas
    forwards; for Dream the reference shifts the logits right by one (docs/design.md
    § Reference decoders)."""
    model = tiny_model(model_type, vocab_size=V)
    assert model.config.mask_token_id == MASK

    def fn(ids: Tensor, pos: Tensor) -> Tensor:
        with torch.no_grad():
            logits = model(ids[None], pos[None],
                           frame=Frame(key_mask=torch.ones(1, len(ids), dtype=torch.bool)))[0]
        return torch.cat([logits[:1], logits[:-1]]) if model_type == "Dream" else logits

    gen, block = 16, 8
    got = engine_decode(model, DecodeParams.parse(spec, gen_length=gen, block_length=block),
                        [PROMPT], mask_id=MASK, eos_id=EOS)[0]
    want, seen = reference(fn, PROMPT, method, gen, block, steps, tau=0.1)
    assert got.token_ids == want
    assert got.nfe == len(seen) - 1
    if method == "threshold":
        assert got.nfe < gen  # several tokens per step at tau 0.1


# --- ties (docs/design.md § Exactness and ties) ---------------------------------------------------
def _tied_row() -> Tensor:
    row = torch.zeros(V)
    row[[12, 5, 9]] = 3.0  # three tokens share the max
    return row


@pytest.mark.parametrize("spec, per_step", [("static-1", 1), ("static,steps=4", 2), ("threshold", 1),
                                            ("threshold,steps=4", 2)])  # (its floor: 2 a step)
def test_ties_lowest_position_and_lowest_token(spec: str, per_step: int) -> None:
    out, model, _ = decode(constant_logits(_tied_row()), spec, [PROMPT], 8, 4)
    assert out[0] == [5] * 8  # lowest token id among equal logits
    seen = canvases(model, PROMPT, out[0])
    p = len(PROMPT)
    for n, x in enumerate(seen):  # equal confidences: left to right, per_step at a time
        committed = [i - p for i in range(p, len(x)) if x[i] != MASK]
        assert committed == list(range(n * per_step)), (n, committed)


def test_tie_with_mask_token_never_commits_mask() -> None:
    row = torch.zeros(V)
    row[[MASK, 6]] = 4.0
    out, _, _ = decode(constant_logits(row), "static-1", [PROMPT], 8, 4)
    assert out[0] == [6] * 8


def test_suppress_eos() -> None:
    row = torch.zeros(V)
    row[EOS], row[9] = 5.0, 4.0
    assert decode(constant_logits(row), "static-1", [PROMPT], 8, 4)[0][0] == [EOS] * 8
    assert decode(constant_logits(row), "static-1,suppress_eos=true", [PROMPT], 8, 4)[0][0] == [9] * 8


def test_rank_ties_lowest_position() -> None:
    conf = np.array([[0.5, 0.9, 0.5, 0.9, 0.1]], dtype=np.float32)
    assert rank(conf).tolist() == [[2, 0, 3, 1, 4]]


# --- threshold -----------------------------------------------------------------------------------
@pytest.mark.parametrize("tau", [0.9, 0.6, 0.99])
def test_threshold_commits_exactly_confident_or_one(tau: float) -> None:
    fn = hashed_logits(11)
    gen, block = 24, 8
    out, model, _ = decode(fn, f"threshold,threshold={tau}", [PROMPT], gen, block)
    seen = canvases(model, PROMPT, out[0])
    p = len(PROMPT)
    n_fallback = n_multi = 0
    for before, after in pairwise(seen):
        logits = fn(torch.tensor(before), torch.arange(len(before)))
        chosen = logits.clone()
        chosen[:, MASK] = float("-inf")
        conf = torch.softmax(logits, -1).gather(-1, chosen.argmax(-1)[:, None]).squeeze(-1)
        first_mask = next(i for i in range(p, len(before)) if before[i] == MASK)
        lo = p + (first_mask - p) // block * block
        cand = [i for i in range(lo, lo + block) if before[i] == MASK]
        committed = {i for i in range(len(before)) if before[i] != after[i]}
        confident = {i for i in cand if conf[i] >= tau}
        if confident:
            assert committed == confident
            n_multi += len(confident) > 1
        else:
            best = max(cand, key=lambda i: (float(conf[i]), -i))
            assert committed == {best}
            n_fallback += 1
    assert n_fallback > 0 and (n_multi > 0 or tau == 0.99)  # both branches were exercised


# --- factor --------------------------------------------------------------------------------------
def test_factor_bar_rises_with_the_count() -> None:
    """Sorted 0.95, 0.8, 0.7, 0.6: f = 1 takes two (0.8 >= 1 - 1/3, 0.7 < 1 - 1/4); f = 0.5 one
    (0.8 < 1 - 0.5/3); a non-candidate never counts; a row of none commits none."""
    from unmask.decoding.methods import Factor

    knobs = np.array([1.0, 0.5, 1.0, 1.0], dtype=[("factor", "float32")])
    conf = np.tile(np.array([0.95, 0.6, 0.8, 0.7], dtype=np.float32), (4, 1))
    cand = np.ones((4, 4), dtype=bool)
    cand[2, 0] = False  # without 0.95: 0.8, 0.7, 0.6 -> 0.8 >= 1/2, 0.7 >= 2/3, 0.6 < 3/4
    cand[3] = False
    assert Factor().count(conf, cand, None, knobs).tolist() == [2, 1, 2, 0]


def test_factor_commits_several_and_one() -> None:
    """On these logits the factor rule both commits several positions in a step and falls back
    to one (so the reference test above sees both branches)."""
    fn = hashed_logits(0)
    _, seen = reference(fn, PROMPT, "factor", 16, 8, tau=1.0)
    p = len(PROMPT)
    added = [sum(a != b for a, b in zip(x[p:], y[p:], strict=True)) for x, y in pairwise(seen)]
    assert max(added) > 1 and min(added) == 1


# --- temperature ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["static-1", "threshold"])
def test_temperature_seeded(method: str) -> None:
    fn = hashed_logits(2)
    spec = f"{method},temperature=1.0,seed=%d"
    first = decode(fn, spec % 7, [PROMPT], 16, 8)[0]
    assert decode(fn, spec % 7, [PROMPT], 16, 8)[0] == first
    others = [decode(fn, spec % s, [PROMPT], 16, 8)[0] for s in (1, 2, 3)]
    assert any(o != first for o in others)
    greedy = decode(fn, method, [PROMPT], 16, 8)[0]
    assert first != greedy or any(o != greedy for o in others)


# --- batching and lossless methods ---------------------------------------------------------------
PROMPTS = [[7, 8, 9], [20, 21, 22, 23, 24, 25, 26], [13], [30, 4, 6, 3, 8]]


@pytest.mark.parametrize("spec", ["static-1", "static,steps=8", "threshold", "threshold,temperature=0.7",
                                  "freedave", "freedave++"])
def test_batch_equals_alone(spec: str) -> None:
    fn = hashed_logits(4)
    together = decode(fn, spec, PROMPTS, 16, 8)[0]
    alone = [decode(fn, spec, [p], 16, 8)[0][0] for p in PROMPTS]
    assert together == alone


@pytest.mark.parametrize("lossless, reference_spec", [("freedave", "static-1"),
                                                      ("freedave++", "threshold"),
                                                      ("exact", "static-1")])
@pytest.mark.parametrize("seed", [0, 6])
def test_freedave_token_identical(lossless: str, reference_spec: str, seed: int) -> None:
    fn = hashed_logits(seed)
    got, _, res = decode(fn, lossless, PROMPTS, 16, 8)
    want, _, ref = decode(fn, reference_spec, PROMPTS, 16, 8)
    assert got == want
    assert all(r.nfe <= q.nfe for r, q in zip(res, ref, strict=True))


# --- spec grammar errors -------------------------------------------------------------------------
def test_parse_valid() -> None:
    p = DecodeParams.parse(" static , steps=4 , temperature=0.5,seed=3", gen_length=16, block_length=8)
    assert (p.method, p.steps, p.temperature, p.seed, p.gen_length, p.block_length) == \
        ("static", 4, 0.5, 3, 16, 8)
    assert DecodeParams.parse("threshold,threshold=0.75").threshold == 0.75
    # keys in the spec win over keyword overrides
    assert DecodeParams.parse("static-1,gen_length=32", gen_length=16).gen_length == 32


@pytest.mark.parametrize("spec, kw, must_contain", [
    ("nope", {}, ["'nope'", "static-1", "threshold", "freedave"]),
    ("static-1,foo=1", {}, ["'foo'", "steps", "temperature", "threshold"]),
    ("static-1,steps", {}, ["key=value"]),
    ("static-1,=3", {}, ["key=value"]),
    ("static-1", {"gen_length": 20, "block_length": 8}, ["20", "multiple", "8"]),
    ("static,steps=3", {"gen_length": 16, "block_length": 8}, ["steps", "3", "16", "2"]),
    ("static,steps=32", {"gen_length": 16, "block_length": 8}, ["steps", "32", "16"]),
    # threshold's floor: the same schedule, the same ranges; FreeDave++ has no floor
    ("threshold,steps=3", {"gen_length": 16, "block_length": 8}, ["steps", "3", "16", "2"]),
    ("threshold,steps=0", {"gen_length": 16, "block_length": 8}, ["steps", "0", "1..16"]),
    ("freedave++,steps=4", {}, ["steps", "static / threshold only", "freedave++"]),
    ("entropy_bounded,steps=4", {}, ["steps", "static / threshold only"]),
    ("static-1,temperature=-1", {}, ["temperature", ">= 0", "-1"]),
    ("static-1,temperature=abc", {}, ["temperature", "abc"]),
    ("threshold,threshold=1.5", {}, ["threshold", "1.5", "1"]),
    ("static-1,gen_length=0", {}, ["gen_length", "positive"]),
    ("static-1,cache=lru", {}, ["none", "prefix", "dual", "entropy"]),
    ("", {}, ["NAME"]),
])
def test_parse_errors(spec: str, kw: dict, must_contain: list[str]) -> None:
    with pytest.raises(SpecError) as e:
        DecodeParams.parse(spec, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    for s in must_contain:
        assert s in msg, (s, msg)


def test_every_method_parses() -> None:
    for m in METHODS:
        assert DecodeParams.parse(m).method == m


def test_grammar_names_are_the_registries() -> None:
    """The spec grammar's name lists are exactly the registries' keys (written out in params.py
    so that the CLI's help does not import torch)."""
    from unmask import caching, suffix
    from unmask.decoding import methods, params

    assert params.METHODS == tuple(methods.METHODS)
    assert params.CACHES == tuple(caching.POLICIES)
    assert params.SUFFIXES == tuple(suffix.POLICIES)
    assert params.MIDDLE_RULES == tuple(suffix.MIDDLE_RULES)
    assert set(params.REFERENCE_METHOD) <= set(params.METHODS)


def test_candidates_rank_before_non_candidates_whatever_their_score() -> None:
    """A candidate scored -inf (or NaN) still ranks after the other candidates and before every
    non-candidate: with a -inf fill it tied with the slots before the block and lost to them by
    position, so a step whose scores were all -inf committed nothing."""
    from unmask.decoding.rules import candidate_ranks, select_top

    conf = np.array([[0.9, -np.inf, -np.inf, 0.5, np.nan, 0.7]], dtype=np.float32)
    cand = np.array([[False, True, True, True, True, False]])
    ranks = candidate_ranks(conf, cand)
    assert ranks[0, 3] == 0 and {ranks[0, 1], ranks[0, 2]} == {1, 2}
    assert ranks[0, cand[0]].max() < ranks[0, ~cand[0]].min()
    assert select_top(np.full((1, 6), -np.inf, dtype=np.float32), cand, np.array([2])).tolist() == \
        [[False, True, True, False, False, False]]


def test_canvas_for_is_exact_for_any_int() -> None:
    """Whole blocks for n tokens in integers: a float division overflowed at a 400-digit
    max_tokens (a server 500) and rounded past 2**53."""
    p = DecodeParams.parse("threshold", gen_length=64, block_length=32)
    assert [p.canvas_for(n) for n in (1, 32, 33, 64)] == [32, 32, 64, 64]
    huge = 10**400 + 1
    assert p.canvas_for(huge) == (10**400 // 32 + 1) * 32
    assert p.canvas_for(2**60 + 1) == 2**60 + 32


# --- keys the decoder does not read --------------------------------------------------------------
# key -> a value other than the default; the decoder spec of a base that does not read it
UNREAD = {
    "steps": (4, "static-1"), "threshold": (0.01, "static-1"), "draft_steps": (2, "threshold"),
    "draft_conf": (0.5, "static-1"), "entropy_tau": (0.0, "threshold,cache=dual"),
    "recent_k": (8, "threshold,cache=prefix"), "refresh_on_block": (True, "threshold"),
    "block_recompute": ("masked", "threshold"), "suffix_local": (8, "threshold,cache=dual"),
    "suffix_middle": (0, "threshold,suffix=window"), "suffix_tail": (0, "threshold"),
    "suffix_rule": ("grid", "threshold,suffix=window"), "inject": (0.5, "threshold,cache=dual"),
    "eb_threshold": (1.0, "threshold"), "factor": (0.5, "threshold"),
    "sub_block_length": (4, "threshold,cache=dual"),
}


def test_unread_table_covers_applies_to() -> None:
    from unmask.decoding.params import APPLIES_TO

    assert set(UNREAD) == set(APPLIES_TO)


@pytest.mark.parametrize("key", sorted(UNREAD))
def test_a_key_the_decoder_does_not_read_is_refused(key: str) -> None:
    """`static-1,threshold=0.5` used to decode as static-1 without a word."""
    value, base = UNREAD[key]
    with pytest.raises(SpecError) as e:
        DecodeParams.parse(f"{base},{key}={value}", gen_length=16, block_length=8)
    assert key in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecError, match=key):  # a keyword override is the user's too
        DecodeParams.parse(base, gen_length=16, block_length=8, **{key: value})


@pytest.mark.parametrize("key", sorted(k for k in UNREAD if k != "steps"))
def test_refused_keys_are_really_unread(key: str) -> None:
    """The table is true: on a decoder that the refusal names, the key changes nothing (built
    directly, past the parser's check), so refusing it hides no behaviour."""
    value, base = UNREAD[key]
    model = tiny_model()
    p = DecodeParams.parse(base, gen_length=32, block_length=8)
    q = dataclasses.replace(p, **{key: value})
    prompts = [[5, 6, 7, 8], [9, 10]]
    a, b = (engine_decode(model, x, prompts, mask_id=MASK, eos_id=EOS) for x in (p, q))
    assert [(r.token_ids, r.nfe, r.token_forwards) for r in a] == \
        [(r.token_ids, r.nfe, r.token_forwards) for r in b]


def test_keys_that_apply_parse() -> None:
    for spec in ["static,steps=4", "threshold,threshold=0.5", "freedave,draft_steps=2",
                 "freedave++,draft_conf=0.5", "threshold,cache=entropy,entropy_tau=1,recent_k=2,"
                 "refresh_on_block=true", "threshold,cache=prefix,block_recompute=masked",
                 "threshold,suffix=window,suffix_local=8,inject=0.5",
                 "threshold,suffix=structured,suffix_middle=4,suffix_tail=2,suffix_rule=grid",
                 "fast,cache=none", "fast,suffix=full"]:  # a preset's own keys stay its own
        DecodeParams.parse(spec, gen_length=16, block_length=8)


def test_numpy_numbers_are_taken_as_python_ones() -> None:
    """A length computed with numpy used to be refused ("gen_length must be an int, got
    np.int64(32)"); it is taken, as a Python int, so that specs and JSON reports stay plain."""
    p = DecodeParams.parse("threshold", gen_length=np.int64(32), threshold=np.float32(0.5))
    assert (p.gen_length, p.threshold) == (32, 0.5)
    assert type(p.gen_length) is int and type(p.threshold) is float
    q = DecodeParams(block_length=np.int32(8), gen_length=np.int64(16), temperature=np.int64(1))
    assert type(q.temperature) is float and q.spec == "static-1,temperature=1.0"
    with pytest.raises(SpecError, match="gen_length must be an int"):
        DecodeParams(gen_length=np.float64(32))
