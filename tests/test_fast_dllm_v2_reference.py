"""Fast-dLLM v2's own decoding (its generate(): sub-blocks, the threshold inside a sub-block,
a block's first token from the previous block's last logit, the stop inside a block) as the
spec `threshold,threshold=T,sub_block_length=S` (`static-1,sub_block_length=S` for its default
threshold 1), against tests/block_reference.py's plain-torch re-implementation of that loop
(docs/fast-dllm-v2-reference-semantics.md). scripts/check/block_references.py holds the
re-implementation and unmask against the published generate() itself
(benchmarks/check/fast-dllm-v2-reference.md).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from block_reference import fast_dllm_v2
from helpers import assert_batch_invariant, kv_forward, peaky_model, tiny_model_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unmask.cli import main
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, decode
from unmask.engine.layout import SubBlockLayout
from unmask.errors import DecoderMismatch, SpecError

VOCAB, MASK, EOS, BS = 64, 63, 1, 4
# lengths around the block (4): shorter, one short of it, one block (generate() ignores such a
# prompt; the loop prefills it, as ours), a block plus one, two whole blocks (the prefill's
# last logit gives the first token), and longer
PROMPTS = [[20], [5, 6, 7], list(range(3, 7)), [7, 7, 7, 7, 9], list(range(10, 18)),
           list(range(3, 14)), list(range(30, 50)), list(range(40, 63))]


@functools.cache
def fd2(seed: int = 0) -> torch.nn.Module:
    """A peaky tiny random Fast-dLLM v2 (blocks of 4), the mask token's output row zero: the
    reference's argmax may pick the mask token, unmask's never does, so it must never win."""
    model = copy.deepcopy(peaky_model("Fast_dLLM_Qwen", seed, 4.0, VOCAB, MASK, EOS))
    with torch.no_grad():
        model.lm_head.weight[MASK] = 0
    return model


def spec(threshold: float, sub: int) -> str:
    rule = "static-1" if threshold == 1 else f"threshold,threshold={threshold}"
    return f"{rule},sub_block_length={sub}"


def params(text: str, gen: int = 24, cache: str = "block", **kw) -> DecodeParams:
    return DecodeParams.parse(text, gen_length=gen, block_length=BS, cache=cache, **kw)


def reference(model, prompt: list[int], gen: int, threshold: float, sub: int, eos: int,
              block_cache: bool = False):
    """The re-implementation on the same canvas as ours: generate()'s max_new_tokens counts
    whole blocks from the prompt's last whole block, ours gen_length from the prompt's end."""
    p = len(prompt)
    budget = -(-(p + gen) // BS) * BS - p // BS * BS
    return fast_dllm_v2(lambda ids, pos: model(ids, pos), prompt, MASK, budget, BS, sub,
                        threshold, eos, kv_forward(model, BS) if block_cache else None)


def check_against_reference(model, prompts, gen: int, threshold: float, sub: int,
                            eos: int, cache: str = "block") -> int:
    """Tokens equal to the reference loop's up to its stop, and the cost it saves exactly:
    the prefill forward where the prompt's tail opens the first block (fused with that block's
    first step; a prompt of whole blocks is forwarded alone in both, its last logit giving the
    first token), and the last block's store forward (a finished row stores nothing), which a
    row that stops at EOS does not run in either. Returns the rows that stopped mid-block."""
    reqs = decode(model, params(spec(threshold, sub), gen, cache=cache), prompts, mask_id=MASK,
                  eos_id=eos)
    mid_block = 0
    for p, req in zip(prompts, reqs, strict=True):
        ref = reference(model, p, gen, threshold, sub, eos, cache == "sub_block")
        n = min(len(ref.canvas), gen)  # generate() returns up to its stop; we cut at gen
        assert req.token_ids[:n] == ref.canvas[:n], p
        # an EOS on our canvas (the loop's last store forward may predict one past it)
        stopped = eos in ref.canvas[: req.canvas]
        fused = len(p) > BS and len(p) % BS != 0
        assert req.nfe == ref.nfe - fused - (not stopped), p
        assert req.token_forwards == ref.token_forwards - BS * (not stopped), p
        mid_block += stopped and (len(p) + ref.canvas.index(eos) + 1) % BS != 0
    return mid_block


@pytest.mark.parametrize("sub", [1, 2, 4])
@pytest.mark.parametrize("threshold", [1.0, 0.9, 0.5])
def test_tokens_and_cost_against_the_reference_loop(threshold: float, sub: int) -> None:
    check_against_reference(fd2(), PROMPTS, 24, threshold, sub, EOS)


@pytest.mark.parametrize("sub", [1, 2, 4])
@pytest.mark.parametrize("threshold", [1.0, 0.9, 0.5])
def test_the_sub_block_cache_against_the_reference_loop_with_its_block_cache(threshold: float,
                                                                            sub: int) -> None:
    """cache=sub_block is generate()'s use_block_cache (emptied at each block): same tokens, and
    the same cost but for the forwards check_against_reference names."""
    check_against_reference(fd2(), PROMPTS, 24, threshold, sub, EOS, "sub_block")


@pytest.mark.parametrize("sub", [1, 2, 4])
def test_rows_stop_inside_a_block_as_the_reference_does(sub: int) -> None:
    """EOS settles a row inside its block, as generate()'s check does (no forward after it),
    where SDAR's loop waits for the block's end. A token the model often predicts stands for
    EOS here, so that rows stop."""
    assert check_against_reference(fd2(), PROMPTS, 40, 0.5, sub, 21)


def test_a_block_opens_with_its_first_slot_alone_after_a_forward_that_ends_before_it() -> None:
    layout = SubBlockLayout(8, 4)
    masked = np.zeros((3, 24), dtype=bool)
    masked[0, 8:] = True  # a fresh block: its first slot alone
    masked[1, 9:] = True  # the first slot committed: sub-block 0 from its first mask
    masked[2, 13:] = True  # sub-block 1
    start = np.array([8, 8, 8])
    lo, hi = layout.window(masked, start)
    assert lo.tolist() == [8, 9, 13] and hi.tolist() == [9, 12, 16]
    horizon = layout.horizon(start, lo, start + 8, np.full(3, 24))
    assert horizon.tolist() == [8, 16, 16]


def test_the_windows_change_the_tokens() -> None:
    """Sub-blocks are not a no-op: some prompt decodes otherwise with the whole block as the
    window (and the first slot not alone)."""
    model = fd2()
    a = decode(model, params("threshold,threshold=0.5,sub_block_length=2"), PROMPTS, mask_id=MASK,
               eos_id=EOS)
    b = decode(model, params("threshold,threshold=0.5"), PROMPTS, mask_id=MASK, eos_id=EOS)
    assert [r.token_ids for r in a] != [r.token_ids for r in b]


prompt_st = st.lists(st.integers(3, VOCAB - 3), min_size=1, max_size=19)


@pytest.mark.parametrize("cache", ["block", "sub_block"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(["static-1", "threshold,threshold=0.5", "freedave++,draft_steps=3,"
                               "threshold=0.5"]),
       sub=st.sampled_from([1, 2, 4]), temperature=st.sampled_from([0.0, 0.8]), target=prompt_st,
       others=st.lists(st.tuples(prompt_st, st.sampled_from([8, 16, 24])), min_size=1, max_size=3),
       join_at=st.integers(0, 6), abort_at=st.integers(1, 8))
def test_batch_invariance_with_sub_blocks(cache, method, sub, temperature, target, others,
                                          join_at, abort_at) -> None:
    """Alone == in a batch == joining at step k beside rows at other blocks and sub-blocks,
    one of them aborted, a request of another decoder beside; under cache=sub_block the kept
    K/V of a row's block is its own too, whoever shares the call (canonical attention shapes:
    it reads stale keys)."""
    text = f"{method},temperature={temperature},sub_block_length={sub}"
    assert_batch_invariant(fd2(), lambda gen, seed: params(text, gen, cache, seed=seed), target,
                           others, join_at, abort_at, MASK, EOS)


def test_freedave_is_exact_with_sub_blocks() -> None:
    model = fd2()
    for sub in (2, 4):
        got = decode(model, params(f"freedave++,draft_steps=4,threshold=0.5,sub_block_length={sub}"),
                     PROMPTS, mask_id=MASK, eos_id=EOS)
        want = decode(model, params(f"threshold,threshold=0.5,sub_block_length={sub}"), PROMPTS,
                      mask_id=MASK, eos_id=EOS)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]


# --- bad input ---------------------------------------------------------------------------------
def test_a_sub_block_that_does_not_divide_the_block_is_refused() -> None:
    with pytest.raises(SpecError, match=r"^sub_block_length \(3\) must divide block_length \(4\)$") as e:
        params("threshold,sub_block_length=3")
    assert e.value.key == "sub_block_length"


def test_sub_blocks_mean_nothing_without_the_block_cache() -> None:
    """A spec that leaves the cache to the model parses (a block-causal model takes the block
    cache), and the key is refused by name once a bidirectional model is known; a spec that sets
    its cache is refused at parse time."""
    spec = DecodeParams.parse("threshold,sub_block_length=4", gen_length=32, block_length=8)
    eng = Engine(peaky_model("llada", 0, 4.0, VOCAB, MASK, EOS), mask_id=MASK, eos_id=EOS)
    with pytest.raises(DecoderMismatch, match="^sub_block_length applies to block-causal models "
                                              "\\(config block_size\\) only") as e:
        eng.add_request([5], spec)
    assert e.value.key == "sub_block_length"
    with pytest.raises(SpecError, match="^sub_block_length is read by cache block / sub_block only"):
        DecodeParams.parse("threshold,cache=none,sub_block_length=4", gen_length=32, block_length=8)


def test_the_sub_block_cache_needs_sub_blocks() -> None:
    with pytest.raises(SpecError, match=r"^cache=sub_block needs sub_block_length .*: set "
                                        r"sub_block_length$") as e:
        params("threshold", cache="sub_block")
    assert e.value.key == "sub_block_length"


def test_the_sub_block_cache_is_refused_on_a_bidirectional_model() -> None:
    m = peaky_model("llada", 0, 4.0, VOCAB, MASK, EOS)
    eng = Engine(m, mask_id=MASK, eos_id=EOS)
    with pytest.raises(DecoderMismatch, match="^cache=sub_block applies to block-causal") as e:
        eng.add_request([5], params("threshold,sub_block_length=2", 8, cache="sub_block"))
    assert e.value.key == "cache" and "\n" not in str(e.value)
    assert not eng.has_unfinished


def test_sub_blocks_on_a_model_predicting_at_its_own_position_are_refused() -> None:
    sdar = peaky_model("sdar", 0, 4.0, VOCAB, MASK, EOS)
    eng = Engine(sdar, mask_id=MASK, eos_id=EOS)
    with pytest.raises(DecoderMismatch, match="^sub_block_length cannot apply") as e:
        eng.add_request([5, 6], DecodeParams.parse("threshold,cache=block,sub_block_length=2",
                                                   gen_length=8, block_length=4))
    assert e.value.key == "sub_block_length" and "\n" not in str(e.value)
    assert not eng.has_unfinished


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A block-causal folder (SDAR, blocks of 4) that predicts each slot at its own position: a
    tiny Fast-dLLM v2 folder needs the published vocabulary (its mask id is fixed)."""
    return tiny_model_dir(tmp_path_factory.mktemp("sdar"), "sdar")


@pytest.mark.parametrize("decoder, needle", [
    ("threshold,sub_block_length=3", "sub_block_length (3) must divide block_length (4)"),
    ("threshold,sub_block_length=2", "sub_block_length cannot apply"),
    ("threshold,cache=sub_block", "cache=sub_block needs sub_block_length"),
])
def test_cli_refuses_with_exit_2(folder: Path, capsys, decoder: str, needle: str) -> None:
    code = main(["generate", "1 + 1 =", "--model", str(folder), "--decoder", decoder,
                 "--gen-length", "16"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1, err
