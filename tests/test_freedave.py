"""FreeDave is lossless: property tests against the decoders it claims to reproduce.

`freedave` must be token-identical to `static-1` and `freedave++` to `threshold` (same threshold),
under the same cache policy, for any prompts, lengths, draft count K and batch size, while never
taking more forwards. All drafts of an iteration go through ONE model call.

The models are tiny random LLaDA / Dream models (vocab 64, mask 63) with their default init scaled
x4, so that predictions are peaky and varied (confidences ~0.2-0.95, not all ties).
"""

from __future__ import annotations

import functools
import math
import os
from collections import Counter

import pytest
import torch
from helpers import peaky_model  # noqa: E402
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unmask.decoding.params import DecodeParams
from unmask.engine import Request as DecodeResult
from unmask.engine import decode as engine_decode
from unmask.engine import runner as runner_mod

VOCAB, MASK, EOS = 64, 63, 1
KINDS = ("llada", "Dream")
# UNMASK_EXAMPLES raises the example count for a long local run (e.g. 500).
N_EXAMPLES = int(os.environ.get("UNMASK_EXAMPLES", "25"))
PROPERTY = settings(max_examples=N_EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def tiny_model(kind: str, seed: int = 0, scale: float = 4.0) -> torch.nn.Module:
    return peaky_model(kind, seed, scale, VOCAB, MASK, EOS)


def decode(model: torch.nn.Module, spec: str, prompts: list[list[int]], gen_length: int,
           block_length: int, eos: int = EOS) -> list[DecodeResult]:
    params = DecodeParams.parse(spec, gen_length=gen_length, block_length=block_length)
    return engine_decode(model, params, prompts, mask_id=MASK, eos_id=eos)


def tokens(results: list[DecodeResult]) -> list[list[int]]:
    return [r.token_ids for r in results]


@functools.cache
def frequent_tokens(kind: str, seed: int) -> tuple[int, ...]:
    """The model's most frequent outputs: used as EOS so that early exit actually triggers."""
    out = decode(tiny_model(kind, seed), "static-1", [[5, 6, 7], [20, 30, 40, 50], [9]], 16, 8)
    return tuple(t for t, _ in Counter(t for r in out for t in r.token_ids).most_common(3))


prompt_lists = st.lists(st.lists(st.integers(2, 62), min_size=1, max_size=7), min_size=1, max_size=3)


@st.composite
def shapes(draw: st.DrawFn) -> dict:
    block = draw(st.sampled_from([2, 4, 8]))
    return dict(kind=draw(st.sampled_from(KINDS)), seed=draw(st.integers(0, 3)),
                prompts=draw(prompt_lists), block_length=block,
                gen_length=block * draw(st.integers(1, 3)), k=draw(st.integers(1, 8)))


# freedave's rule (static-1) reads no threshold, so only freedave++ is given one
THRESHOLD = {"freedave": "", "freedave++": ",threshold=0.5"}


# --- freedave == static-1 ------------------------------------------------------------------------
@PROPERTY
@given(shape=shapes(), temperature=st.sampled_from([0.0, 1.0]),
       remasking=st.sampled_from(["low_confidence", "topk_margin", "entropy", "random"]))
def test_freedave_is_static1(shape: dict, temperature: float, remasking: str) -> None:
    model = tiny_model(shape["kind"], shape["seed"])
    lengths = dict(gen_length=shape["gen_length"], block_length=shape["block_length"])
    opts = f"temperature={temperature},remasking={remasking},seed=3"
    ref = decode(model, f"static-1,{opts}", shape["prompts"], **lengths)
    out = decode(model, f"freedave,draft_steps={shape['k']},{opts}", shape["prompts"], **lengths)
    assert tokens(out) == tokens(ref)
    assert all(MASK not in t for t in tokens(out))
    for o, r in zip(out, ref, strict=True):
        assert r.nfe == shape["gen_length"]  # static-1: one token per forward
        assert o.nfe <= r.nfe
        # each iteration accepts at most K tokens, and every iteration but the last is a forward
        assert o.nfe >= math.ceil(shape["gen_length"] / shape["k"])
        if shape["k"] == 1:
            assert o.nfe == r.nfe


@PROPERTY
@given(shape=shapes(), threshold=st.sampled_from([0.2, 0.3, 0.5, 0.7, 0.9]))
def test_freedave_pp_is_threshold(shape: dict, threshold: float) -> None:
    model = tiny_model(shape["kind"], shape["seed"])
    lengths = dict(gen_length=shape["gen_length"], block_length=shape["block_length"])
    ref = decode(model, f"threshold,threshold={threshold}", shape["prompts"], **lengths)
    out = decode(model, f"freedave++,threshold={threshold},draft_steps={shape['k']}",
                 shape["prompts"], **lengths)
    assert tokens(out) == tokens(ref)
    for o, r in zip(out, ref, strict=True):
        assert o.nfe <= r.nfe


def test_threshold_models_commit_in_parallel() -> None:
    """Guard for the test above: at the thresholds used, threshold decoding does commit several
    tokens per step on these models (otherwise freedave++ == threshold would say little)."""
    model = tiny_model("llada", 0)
    res = decode(model, "threshold,threshold=0.3", [[5, 6, 7, 8, 9]], 32, 8)
    assert res[0].nfe < 32


# --- the same, under a K/V cache (exactness vs the reference under the same policy) ------------
@PROPERTY
@given(shape=shapes(), cache=st.sampled_from(["dual", "prefix"]),
       method=st.sampled_from(["freedave", "freedave++"]),
       threshold=st.sampled_from([0.3, 0.5, 0.9]))
def test_freedave_exact_under_cache_llada(shape: dict, cache: str, method: str,
                                          threshold: float) -> None:
    model = tiny_model("llada", shape["seed"])
    lengths = dict(gen_length=shape["gen_length"], block_length=shape["block_length"])
    ref_method = "static-1" if method == "freedave" else "threshold"
    opts = f"cache={cache}" + (f",threshold={threshold}" if method == "freedave++" else "")
    ref = decode(model, f"{ref_method},{opts}", shape["prompts"], **lengths)
    out = decode(model, f"{method},draft_steps={shape['k']},{opts}", shape["prompts"], **lengths)
    assert tokens(out) == tokens(ref)
    for o, r in zip(out, ref, strict=True):
        assert o.nfe <= r.nfe


@pytest.mark.parametrize("cache,ref,method,prompt,k", [
    ("prefix", "threshold,threshold=0.5", "freedave++,threshold=0.5", [5, 6, 7, 8, 9], 2),
    ("dual", "static-1", "freedave", [20, 30, 40, 50], 4),
])
def test_freedave_exact_under_cache_dream(cache: str, ref: str, method: str, prompt: list[int],
                                          k: int) -> None:
    model = tiny_model("Dream", 0)
    expected = decode(model, f"{ref},cache={cache}", [prompt], 32, 8)
    out = decode(model, f"{method},draft_steps={k},cache={cache}", [prompt], 32, 8)
    assert tokens(out) == tokens(expected)


# --- early exit ---------------------------------------------------------------------------------
def _upto_first_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


@PROPERTY
@given(shape=shapes(), eos_rank=st.integers(0, 2))
def test_freedave_early_exit(shape: dict, eos_rank: int) -> None:
    """With early exit, FreeDave gives static-1's output up to (and including) the first EOS, in
    no more forwards, and every row is finished (no mask left)."""
    model = tiny_model(shape["kind"], shape["seed"])
    eos = frequent_tokens(shape["kind"], shape["seed"])[eos_rank]
    lengths = dict(gen_length=shape["gen_length"], block_length=shape["block_length"], eos=eos)
    ref = decode(model, "static-1,early_exit=true", shape["prompts"], **lengths)
    out = decode(model, f"freedave,early_exit=true,draft_steps={shape['k']}", shape["prompts"],
                 **lengths)
    for o, r in zip(out, ref, strict=True):
        assert MASK not in o.token_ids
        assert _upto_first_eos(o.token_ids, eos) == _upto_first_eos(r.token_ids, eos)
        assert o.nfe <= r.nfe


EARLY_EXIT_CASE = dict(kind="llada", seed=0, eos=50, prompt=[37, 32])  # static-1 stops early


def _early_exit_case(spec: str) -> DecodeResult:
    c = EARLY_EXIT_CASE
    return decode(tiny_model(c["kind"], c["seed"]), spec, [c["prompt"]], 16, 8, eos=c["eos"])[0]


def test_early_exit_triggers() -> None:
    """Guard for the early-exit tests: early exit does stop static-1 early on this case, and
    FreeDave agrees with it up to the first EOS."""
    ref = _early_exit_case("static-1,early_exit=true")
    assert ref.nfe < 16
    for k in (2, 4, 8):
        out = _early_exit_case(f"freedave,early_exit=true,draft_steps={k}")
        eos = EARLY_EXIT_CASE["eos"]
        assert _upto_first_eos(out.token_ids, eos) == _upto_first_eos(ref.token_ids, eos)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_freedave_early_exit_token_identical(k: int) -> None:
    ref = _early_exit_case("static-1,early_exit=true")
    out = _early_exit_case(f"freedave,early_exit=true,draft_steps={k}")
    assert out.token_ids == ref.token_ids


@pytest.mark.parametrize("spec", ["static-1", "threshold,threshold=0.5", "static,steps=8",
                                  "freedave,draft_steps=4", "freedave++,draft_steps=4"])
def test_early_exit_never_forwards_a_finished_canvas(spec: str, monkeypatch) -> None:
    """A canvas committed up to an EOS stops whatever a forward would predict, so none is made
    (it cost a whole block of token-forwards per answer)."""
    c = EARLY_EXIT_CASE
    seen: list[torch.Tensor] = []
    inner = runner_mod.Runner.forward

    def forward(self, plan):
        seen.append(plan.x.copy())
        return inner(self, plan)

    monkeypatch.setattr(runner_mod.Runner, "forward", forward)
    out = _early_exit_case(f"{spec},early_exit=true")
    assert out.nfe < 16 and MASK not in out.token_ids
    p = len(c["prompt"])
    for x in seen:
        for row in x[:, p:].tolist():
            first_mask = row.index(MASK)
            assert c["eos"] not in row[:first_mask]


# --- one batched forward per iteration ----------------------------------------------------------
class CallCounter:
    """Wraps model.forward: records the batch size of every model call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.batches = model, []
        self.inner = model.forward

    def __enter__(self) -> CallCounter:
        def forward(input_ids, *args, **kwargs):
            frame = kwargs.get("frame")  # packed calls: rows are the frame's, not the input's
            self.batches.append(frame.key_mask.shape[0] if frame is not None and frame.packed
                                else input_ids.shape[0])
            return self.inner(input_ids, *args, **kwargs)

        self.model.forward = forward
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model.forward


@PROPERTY
@given(shape=shapes(), method=st.sampled_from(["freedave", "freedave++"]))
def test_drafts_share_one_forward(shape: dict, method: str) -> None:
    model = tiny_model(shape["kind"], shape["seed"])
    k, block = shape["k"], shape["block_length"]
    prompts = shape["prompts"]
    with CallCounter(model) as calls:
        out = decode(model, f"{method},draft_steps={k}" + THRESHOLD[method], prompts,
                     shape["gen_length"], block)
    nfe = [r.nfe for r in out]
    assert len(calls.batches) == max(nfe)  # all rows and drafts share each call
    if len(prompts) == 1:
        assert len(calls.batches) == nfe[0]
    assert calls.batches[0] == len(prompts)  # the first forward: the empty canvases
    assert max(calls.batches) <= k * len(prompts)
    if method == "freedave" and len(calls.batches) > 1:
        # second call: each row's drafts commit 1..min(K, block) tokens of the first block; only a
        # draft that completes the whole canvas needs no forward
        n = min(k, block)
        complete = k >= block and shape["gen_length"] == block
        assert calls.batches[1] == len(prompts) * (n - complete)


@settings(PROPERTY, max_examples=max(N_EXAMPLES * 3 // 5, 1))
@given(shape=shapes(), method=st.sampled_from(["freedave", "freedave++"]),
       cache=st.sampled_from(["none", "dual"]))
def test_batched_equals_one_by_one(shape: dict, method: str, cache: str) -> None:
    kind = shape["kind"]
    model = tiny_model(kind, shape["seed"])
    spec = f"{method},draft_steps={shape['k']},cache={cache}" + THRESHOLD[method]
    lengths = dict(gen_length=shape["gen_length"], block_length=shape["block_length"])
    batched = decode(model, spec, shape["prompts"], **lengths)
    for prompt, b in zip(shape["prompts"], batched, strict=True):
        alone = decode(model, spec, [prompt], **lengths)[0]
        assert alone.token_ids == b.token_ids
        assert alone.nfe == b.nfe


def test_draft_steps_beyond_the_block_cost_nothing_more() -> None:
    """No more drafts than a block's candidates can exist, so a huge draft_steps gives what
    draft_steps = block_length gives (it used to size its arrays by draft_steps: 438 GiB)."""
    m = tiny_model("llada")
    prompts = [[5, 6, 7], [20, 30, 40, 50]]
    ref = decode(m, "static-1", prompts, 16, 8)
    for k in (8, 10**6, 10**24):
        out = decode(m, f"freedave,draft_steps={k}", prompts, 16, 8)
        assert tokens(out) == tokens(ref), k
        assert [r.nfe for r in out] == [r.nfe for r in decode(m, "freedave,draft_steps=8",
                                                               prompts, 16, 8)]


@pytest.mark.parametrize("knob", ["remasking=entropy", "alg_temp=0.5"])
def test_freedave_drafts_whatever_the_ranking_score(knob: str) -> None:
    """draft_conf 0 filters no draft even when the ranking score is not a probability
    (-entropy <= 0; alg_temp's log-scores): FreeDave used to draft nothing there and take
    static-1's forwards."""
    m = tiny_model("llada")
    prompts = [[5, 6, 7], [20, 30, 40, 50]]
    ref = decode(m, f"static-1,{knob}", prompts, 32, 16)
    out = decode(m, f"freedave,draft_steps=8,{knob}", prompts, 32, 16)
    assert tokens(out) == tokens(ref)
    assert sum(r.nfe for r in out) < sum(r.nfe for r in ref)


def test_engine_model_calls_count_forwards_of_drafts_not_accepted() -> None:
    """A step whose accepted draft was already complete still made a model call (for the other
    drafts): the engine's count of calls equals the request's NFE."""
    from unmask.engine import Engine, SchedulerConfig

    m = tiny_model("llada")
    for prompt in ([5, 6, 7], [20, 30, 40, 50], [9], [11, 12]):
        eng = Engine(m, SchedulerConfig(max_running=1), mask_id=MASK, eos_id=EOS)
        req = eng.add_request(prompt, DecodeParams.parse("exact", gen_length=32, block_length=8))
        eng.run()
        assert eng.model_calls == req.nfe, prompt


@pytest.mark.xfail(strict=True, reason=(
    "limitation: under block_recompute=masked FreeDave is not token-identical to its reference. "
    "A committed slot's K/V is recomputed once, then read from the store; when it is recomputed "
    "depends on the path: static-1 recomputes each commit in the next step's context, a draft "
    "accepted k commits at once recomputes them together. So a canvas's logits depend on the "
    "path that reached it, and the chain rule's premise (same canvas -> same logits) fails. "
    "block_recompute=all (the default) recomputes the whole block every step: exact."))
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_freedave_exact_under_block_recompute_masked(cache: str) -> None:
    # seed 1: seed 0's example stopped differing when scores took the mask token's share
    m = tiny_model("llada", 1)
    prompts = [[5, 6, 7], [20, 30, 40, 50], [9], [11, 12, 13]]
    spec = f"cache={cache},block_recompute=masked"
    assert tokens(decode(m, f"exact,{spec}", prompts, 32, 16)) == \
        tokens(decode(m, f"static-1,{spec}", prompts, 32, 16))


def test_a_rows_drafts_are_capped_by_their_logits() -> None:
    """All drafts of a row go through one call, each scoring up to block_length positions over
    the vocabulary: their count is capped by DRAFT_LOGITS (a spec with draft_steps=1024 at
    block_length 1024 was killed for memory), from the spec and model alone."""
    from unmask.engine.decoder import DRAFT_LOGITS, Decoder

    m = tiny_model("llada")
    def drafts(spec: str, block: int) -> int:
        p = DecodeParams.parse(spec, gen_length=block, block_length=block)
        return Decoder(m, p, MASK, EOS).n_drafts

    assert drafts("freedave,draft_steps=4", 8) == 4
    cap = drafts("freedave,draft_steps=100000", 1024)
    assert cap == 1 + DRAFT_LOGITS // (1024 * VOCAB) and cap < 100000
    assert drafts(f"freedave,draft_steps={10**9}", 2 ** 40 // VOCAB) == 2  # always one draft
