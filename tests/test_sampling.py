"""Dream's sampling knobs in the spec grammar: top_p, top_k, alg_temp; exactness kept."""

from __future__ import annotations

import pytest
import torch
from helpers import EOS, MASK, PROMPTS, VOCAB, peaky_model

from unmask.decoding.params import DecodeParams, SpecError
from unmask.decoding.scoring import _nucleus, score
from unmask.engine import decode


def run(spec: str, kind: str = "llada") -> list[list[int]]:
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    params = DecodeParams.parse(spec, gen_length=32, block_length=8)
    return [r.token_ids for r in decode(model, params, PROMPTS, mask_id=MASK, eos_id=EOS)]


def test_nucleus_keeps_the_smallest_set_over_top_p() -> None:
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert _nucleus(p, 0.7, 0).tolist() == [[True, True, False, False]]
    assert _nucleus(p, 0.5, 0).tolist() == [[True, False, False, False]]
    assert _nucleus(p, 1.0, 3).tolist() == [[True, True, True, False]]
    assert _nucleus(p, 0.01, 0).tolist() == [[True, False, False, False]]  # the likeliest stays


def test_top_k_1_is_greedy() -> None:
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(0))
    u = torch.rand(6, 21, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    greedy = score(logits, "low_confidence", 0.0, None, [])
    sampled = score(logits, "low_confidence", 5.0, u, [], top_k=1)
    assert torch.equal(greedy.token, sampled.token)
    free = score(logits, "low_confidence", 5.0, u, [])
    assert not torch.equal(greedy.token, free.token)  # the filter is what made it greedy


@pytest.mark.parametrize("kind", ["llada", "Dream"])
def test_knobs_change_the_output_and_freedave_stays_exact(kind: str) -> None:
    base = run("static-1,temperature=1.0,seed=3", kind)
    for knobs in ("top_p=0.5", "top_k=2", "alg_temp=0.5", "top_p=0.9,top_k=5,alg_temp=0.3"):
        ref = run(f"static-1,temperature=1.0,seed=3,{knobs}", kind)
        assert ref != base, knobs
        assert run(f"freedave,draft_steps=4,temperature=1.0,seed=3,{knobs}", kind) == ref, knobs
    greedy_alg = run("static-1,alg_temp=0.5", kind)
    assert greedy_alg != run("static-1", kind)
    assert run("freedave,draft_steps=3,alg_temp=0.5", kind) == greedy_alg


@pytest.mark.parametrize("spec,match", [
    ("static-1,top_p=0.5", "temperature"), ("static-1,top_k=3", "temperature"),
    ("static-1,temperature=1,top_p=0", "top_p"), ("static-1,temperature=1,top_k=-1", "top_k"),
    ("threshold,alg_temp=0.5", "alg_temp"), ("freedave++,alg_temp=0.5", "alg_temp"),
    ("static-1,alg_temp=nan", "alg_temp"), ("static-1,alg_temp=inf", "alg_temp"),
    # threshold and draft_conf compare probabilities; these ranking scores are not ones
    ("threshold,remasking=entropy", "remasking=entropy"), ("balanced,remasking=entropy", "entropy"),
    ("freedave,alg_temp=0.5,draft_conf=0.5", "draft_conf"),
    ("freedave,remasking=entropy,draft_conf=0.1", "draft_conf"),
    ("fast,threshold=0.5,threshold=0.9", "set twice"), ("static-1,seed=1,seed=1", "set twice"),
])
def test_knobs_are_validated(spec: str, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        DecodeParams.parse(spec)


@pytest.mark.parametrize("spec", ["static-1,alg_temp=1e-300", "freedave,alg_temp=1e-300",
                                  "static,steps=8,alg_temp=1e-45"])
def test_a_tiny_alg_temp_ranks_by_confidence(spec: str) -> None:
    """alg_temp -> 0 is ranking by confidence alone: it must not overflow the score to -inf for
    every position (the step then committed nothing, an error)."""
    u = torch.rand(5, 21, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    tiny = score(logits, "low_confidence", 0.0, u, [], alg_temp=1e-300)
    assert torch.isfinite(tiny.conf).all()
    assert torch.equal(tiny.conf, score(logits, "low_confidence", 0.0, None, []).conf.log())
    model = peaky_model("llada", 0, 4.0, VOCAB, MASK, EOS)
    params = DecodeParams.parse(spec, gen_length=32, block_length=8)
    out = decode(model, params, PROMPTS, mask_id=MASK, eos_id=EOS)
    assert [r.finish_reason for r in out] != ["error"] * len(out)
    assert all(r.finish_reason in ("eos", "length") for r in out)


@pytest.mark.parametrize("temperature", [1e3, 1e6, 1e300])
def test_a_huge_temperature_samples_near_uniformly(temperature: float) -> None:
    """(-log U) ** T underflowed to 0, exp(l) / 0 was inf for most tokens, and argmax took the
    first inf: every position got one of the lowest ids. The score's log keeps the ranking."""
    g = torch.Generator().manual_seed(0)
    n, v = 256, 64
    logits = torch.randn(n, v, generator=g)
    u = torch.rand(n, v + 1, generator=g, dtype=torch.float64)
    tok = score(logits, "low_confidence", temperature, u, [MASK]).token
    assert MASK not in tok.tolist()
    assert len(set(tok.tolist())) > v // 2 and tok.float().mean() > v / 4  # not the lowest ids
    # the log form picks what the reference formula picks wherever that formula is finite
    t = 1.5
    ref = (logits.double().exp() / (-torch.log(u[:, :v])) ** t)
    ref[:, MASK] = -1.0
    assert torch.equal(score(logits, "low_confidence", t, u, [MASK]).token, ref.argmax(-1))


def test_per_position_knobs_score_each_position_as_alone() -> None:
    """Knobs given per position (a batch's rows, as a strided field of its knobs) score each
    position exactly as that position's values given alone: tokens and scores, bit for bit,
    across greedy, exact-power (0.5, 2), plain and huge temperatures, top_p / top_k and
    alg_temp."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    cases = [(0.0, 1.0, 0, 0.0), (0.5, 1.0, 0, 0.0), (2.0, 0.9, 0, 0.3), (0.8, 1.0, 3, 0.0),
             (1e300, 1.0, 0, 0.0), (0.8, 0.5, 2, 0.5), (0.0, 1.0, 0, 0.7)]
    n, v = len(cases), 20
    logits = torch.randn(n, v, generator=g)
    u = torch.rand(n, v + 1, dtype=torch.float64, generator=g)
    rows = np.array(cases, dtype=[("temperature", "f8"), ("top_p", "f4"), ("top_k", "i8"),
                                  ("alg_temp", "f8")])
    sampling = np.flatnonzero(rows["temperature"] > 0)
    for at in (np.arange(n), sampling):  # some positions greedy; every position sampling
        r = rows[at]
        together = score(logits[at], "low_confidence", r["temperature"], u[at], [MASK],
                         r["top_p"], r["top_k"], r["alg_temp"])
        for j, i in enumerate(at.tolist()):
            t, top_p, top_k, alg_temp = cases[i]
            alone = score(logits[i : i + 1], "low_confidence", t, u[i : i + 1], [MASK], top_p,
                          top_k, alg_temp)
            assert together.token[j] == alone.token[0], cases[i]
            assert torch.equal(together.conf[j : j + 1], alone.conf), cases[i]
