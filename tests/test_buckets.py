"""The bucketed forward (unmask/engine/buckets.py), the call a CUDA graph can hold, on the CPU:

- with buckets of the rows' exact shapes, every model call's logits are today's, bit for bit in
  float32 (padding rows and buffers change nothing), for the dense families; LLaDA2's mixture
  of experts routes the padding rows' tokens too, which changes how many rows each expert's
  products get: there the tokens are today's;
- with power-of-two buckets (padding keys and queries masked out), the tokens, NFE and
  token-forwards are today's, alone and in a batch, and the logits within float rounding;
- a row's bucket depends on its own counts only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK_FAMILIES, peaky_model

from unmask.decoding.params import DecodeParams
from unmask.engine import decode
from unmask.engine import runner as runner_mod
from unmask.engine.buckets import Bucket, Buckets, next_pow2
from unmask.models import llada2

VOCAB, MASK, EOS = 64, 63, 1
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20]]


def decoded(kind: str, spec: str, rule: str | None, monkeypatch, batch: int,
            shapes: str | None = None, bucketed: list[int] | None = None):
    """Each request's outcome and every model call's logits, with the runner's bucket rule
    (without it: the calls as they come, attending in one call per shape as the buckets do, not
    block by block) and attention shapes (None: the cache policy's). bucketed: gets one entry
    per call that went through the buckets."""
    model = peaky_model(kind, 0, 4.0, VOCAB, MASK, EOS)
    seen: list[torch.Tensor] = []
    real_score, real_call = runner_mod.score, Buckets.call

    def spy(logits, *a, **k):
        seen.append(logits.detach().clone())
        return real_score(logits, *a, **k)

    def counted(self, *a, **k):
        if bucketed is not None:
            bucketed.append(1)
        return real_call(self, *a, **k)

    with monkeypatch.context() as mp:
        mp.setattr(runner_mod.Runner, "bucket_rule", rule)
        mp.setattr(runner_mod.Runner, "attention_shapes", shapes)
        mp.setattr(runner_mod.Runner, "block_by_block", False)
        mp.setattr(runner_mod, "score", spy)
        mp.setattr(Buckets, "call", counted)
        params = DecodeParams.parse(spec, gen_length=16, block_length=4)
        reqs = decode(model, params, PROMPTS, mask_id=MASK, eos_id=EOS, max_running=batch)
    return [(r.token_ids, r.nfe, r.token_forwards) for r in reqs], seen


@pytest.mark.parametrize("kind", list(BLOCK_FAMILIES))
@pytest.mark.parametrize("spec", ["threshold,threshold=0.7", "static-1", "freedave++,threshold=0.7"])
@pytest.mark.parametrize("rule", ["exact", "pow2"])
def test_bucketed_calls_give_todays_tokens_and_bits(kind: str, spec: str, rule: str,
                                                    monkeypatch) -> None:
    # today's bits where the buckets are the rows' own shapes and the family is dense
    bitwise = rule == "exact" and kind != "llada2_moe"
    for batch in (1, 4):
        want, want_logits = decoded(kind, spec, None, monkeypatch, batch)
        got, got_logits = decoded(kind, spec, rule, monkeypatch, batch)
        assert got == want
        assert len(got_logits) == len(want_logits)
        for a, b in zip(got_logits, want_logits, strict=True):
            if bitwise:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["llada", "Dream"])
@pytest.mark.parametrize("spec", ["threshold,threshold=0.7", "static-1", "freedave++,threshold=0.7",
                                  "threshold,threshold=0.7,cache=dual", "fast"])
@pytest.mark.parametrize("rule", ["exact", "pow2"])
def test_bidirectional_calls_in_buckets_give_todays_tokens_and_bits(kind: str, spec: str,
                                                                    rule: str, monkeypatch) -> None:
    """A bidirectional canvas (LLaDA, Dream; no cache, or prompt K/V read from the store)
    padded to a bucket: its padding keys are masked out and its padding queries dropped, so
    with the rows' exact shapes the calls give today's bits (at the attention shapes the buckets
    take, each row's own), and with power-of-two buckets today's tokens whatever the cache's
    shapes."""
    for batch in (1, 4):
        want, want_logits = decoded(kind, spec, None, monkeypatch, batch, shapes="exact")
        bucketed: list[int] = []
        got, got_logits = decoded(kind, spec, rule, monkeypatch, batch, shapes="exact",
                                  bucketed=bucketed)
        assert bucketed  # the calls went through the buckets
        assert got == want
        assert len(got_logits) == len(want_logits)
        for a, b in zip(got_logits, want_logits, strict=True):
            if rule == "exact":
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        if rule == "pow2":  # and today's tokens at the cache's own (maybe canonical) shapes
            assert decoded(kind, spec, rule, monkeypatch, batch)[0] == \
                decoded(kind, spec, None, monkeypatch, batch)[0]


def test_a_rows_bucket_is_its_own() -> None:
    buckets = Buckets("pow2", torch.device("cpu"), min_rows=16)
    tokens, keys = np.array([4, 8, 5, 1]), np.array([0, 17, 64, 3])
    t_b, k_b = buckets.buckets(tokens, keys)
    assert t_b.tolist() == [4, 8, 8, 1] and k_b.tolist() == [0, 32, 64, 4]
    for i in range(tokens.size):  # alone, the same bucket
        alone = buckets.buckets(tokens[i : i + 1], keys[i : i + 1])
        assert (alone[0][0], alone[1][0]) == (t_b[i], k_b[i])
    assert next_pow2(np.array([0, 1, 2, 3, 1025])).tolist() == [0, 1, 2, 4, 2048]


def test_bucket_is_validated() -> None:
    with pytest.raises(ValueError, match="rows and tokens"):
        Bucket(0, 4, 0)
    with pytest.raises(ValueError, match="unknown bucket rule"):
        Buckets("round", torch.device("cpu"), 16)


@pytest.mark.parametrize("spec", ["threshold,threshold=0.7", "static-1"])
def test_llada2_in_pow2_buckets_with_its_experts_at_fixed_shapes_gives_todays_tokens(
        spec: str, monkeypatch) -> None:
    """The path a GPU with graphs takes for LLaDA2 (power-of-two buckets, every MoE call at
    fixed shapes: no expert count read), run on the CPU: today's tokens, NFE and
    token-forwards, alone and in a batch."""
    for batch in (1, 4):
        want, _ = decoded("llada2_moe", spec, None, monkeypatch, batch)
        with monkeypatch.context() as mp:
            mp.setattr(llada2, "dispatch", llada2.fixed_dispatch)
            got, _ = decoded("llada2_moe", spec, "pow2", monkeypatch, batch)
        assert got == want
