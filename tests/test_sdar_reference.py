"""Block-diffusion decoding against the references' loops: SDAR's `block_diffusion_generate` and
FreeDave's base block decoder, re-implemented in tests/block_reference.py from
docs/sdar-reference-semantics.md (the CI has neither repository; scripts/check/sdar_generate.py
runs the real ones, and the re-implementation beside them, benchmarks/check/sdar-generate.md).

First the re-implementation itself: the behaviours of the references that their names do not
say, each pinned on hand-made confidences, and its forward and store accounting on a model.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from block_reference import STOPS, Strategy, answer, entropy_bounded, freedave, generate, pick, schedule
from helpers import peaky_model

from unmask.decoding.params import DecodeParams
from unmask.engine import decode

VOCAB, MASK, EOS, BS = 64, 63, 1, 4
F, T = False, True


def masks(*flags: bool) -> torch.Tensor:
    return torch.tensor(flags)


@functools.cache
def sdar(seed: int = 0, scale: float = 4.0, head: float = 1.0) -> torch.nn.Module:
    """A peaky tiny random SDAR (blocks of 4), its output rows scaled by `head`, the mask
    token's zero: the references do not remove the mask token from the argmax, unmask does, so
    it must never win."""
    model = copy.deepcopy(peaky_model("sdar", seed, scale, VOCAB, MASK, EOS))
    with torch.no_grad():
        model.lm_head.weight.mul_(head)
        model.lm_head.weight[MASK] = 0
    return model


def forward(model: torch.nn.Module):
    """The model's own block-causal forward of a prefix, without a cache."""
    return lambda ids, pos: model(ids, pos)


# --- the re-implementation's semantics, on hand-made confidences ---------------------------------
def test_schedule_spreads_the_block_not_its_masks() -> None:
    assert schedule(4, 4) == [1, 1, 1, 1]
    assert schedule(4, 2) == [2, 2]
    assert schedule(8, 3) == [3, 3, 2]


def test_static_past_the_masks_overwrites_a_committed_offset() -> None:
    """SDAR's topk takes k offsets even when fewer are masked: the first decode block with three
    prompt tokens and one mask, at two per step, rewrites a prompt offset too."""
    chosen = pick(Strategy("static", 2), torch.tensor([0.9, 0.8, 0.7, 0.1]), masks(F, F, F, T), 2)
    assert int(chosen.sum()) == 2 and bool(chosen[3])


def test_dynamic_threshold_is_strict_and_falls_back_to_the_schedule() -> None:
    conf = torch.tensor([0.5, 0.25, 0.75, 0.125])  # exact in float32
    everything = masks(T, T, T, T)
    sdar_rule = Strategy("dynamic", 4, threshold=0.5)
    freedave_rule = Strategy("dynamic", 4, threshold=0.5, at_least=True)
    assert pick(sdar_rule, conf, everything, 1).tolist() == [F, F, T, F]  # 0.5 is not > 0.5
    assert pick(freedave_rule, conf, everything, 1).tolist() == [T, F, T, F]
    # one passes but the step's count is 2: the top 2, not the one above the threshold
    assert pick(Strategy("dynamic", 2, threshold=0.6), conf, everything, 2).tolist() == [T, F, T, F]


def test_entropy_bounded_counts_once_per_block_and_takes_the_leftmost() -> None:
    """SDAR's formula: S = sum over the block of -p log p of the chosen tokens' probabilities;
    k = how many multiples of S stay below the threshold, at least one, at most the masks."""
    half = torch.full((4,), 0.5)
    s = 4 * 0.5 * torch.log(torch.tensor(2.0))  # 1.386
    assert entropy_bounded(half, masks(F, T, T, T), 0.35).tolist() == [F, T, F, F]  # S > 0.35
    assert entropy_bounded(half, masks(F, T, T, T), float(2.5 * s)).tolist() == [F, T, T, F]
    assert entropy_bounded(torch.ones(4), masks(T, F, T, T), 0.35).tolist() == [T, F, T, T]  # S = 0
    # the most confident offset does not come first: every masked offset gets the same S
    assert entropy_bounded(torch.tensor([0.2, 0.3, 0.99, 0.5]), masks(T, T, T, T), 0.35)[0]


def test_sequential_takes_a_run_from_the_first_mask() -> None:
    chosen = pick(Strategy("sequential", 2), torch.tensor([0.9, 0.1, 0.1, 0.9]), masks(F, T, T, T), 2)
    assert chosen.tolist() == [F, T, T, F]


# --- the re-implementation's loop on a model ------------------------------------------------------
@pytest.mark.parametrize("prompt_len,nfe,token_forwards", [
    (6, 1 + 3 + 5 + 5, 4 + 4 * (3 + 5 + 5)),  # a prefill block; the prompt's tail opens block 1
    (3, 2 + 5 + 5, 4 * (2 + 5 + 5)),  # no whole block: no prefill
    (8, 1 + 5 + 5, 8 + 4 * (5 + 5)),  # aligned: the first decode block is all masks
])
def test_forwards_are_prefill_denoising_and_store(prompt_len: int, nfe: int,
                                                  token_forwards: int) -> None:
    """static-1 over gen_length 8 (to whole blocks): one prefill forward of the prompt's whole
    blocks, then per block one forward per mask and one store forward, b tokens each."""
    prompt = list(range(3, 3 + prompt_len))
    with torch.no_grad():
        r = generate(forward(sdar()), prompt, MASK, 8, BS, Strategy("static", BS), [VOCAB])
    assert (r.nfe, r.token_forwards) == (nfe, token_forwards)
    assert r.canvas[:prompt_len] == prompt and MASK not in r.canvas
    assert all(len(step) == 1 for block in r.commits for step in block)


def test_stops_after_the_block_holding_eos() -> None:
    """SDAR stops after the first block holding a stop id (its masks beyond stay masks);
    FreeDave's early exit only after a block of EOS alone."""
    prompt = [5, 6, 7, 8, 9]
    with torch.no_grad():
        full = generate(forward(sdar()), prompt, MASK, 24, BS, Strategy("static", BS), [VOCAB])
        stop = full.canvas[len(prompt) + 5]  # a token of the second decode block, used as EOS
        sdar_stop = generate(forward(sdar()), prompt, MASK, 24, BS, Strategy("static", BS), [stop])
        freedave_stop = generate(forward(sdar()), prompt, MASK, 24, BS, Strategy("static", BS),
                                 [stop], STOPS[1])
    first = full.canvas.index(stop, len(prompt))
    end = (first // BS + 1) * BS
    assert sdar_stop.canvas[:end] == full.canvas[:end]
    assert set(sdar_stop.canvas[end:]) == {MASK}
    whole = next(i for i in range(end - BS, len(full.canvas), BS) if set(full.canvas[i:i + BS]) == {stop})
    assert freedave_stop.canvas[:whole + BS] == full.canvas[:whole + BS]
    assert set(freedave_stop.canvas[whole:]) == {stop}  # the rest filled with EOS


# --- unmask against the re-implementation ---------------------------------------------------------
# Prompts of every length modulo the block size, one shorter than a block (no prefill).
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10], [20], [30, 31, 32, 33, 34]]
GEN = 16  # whole blocks, but not past a prompt of odd length: its last block runs past GEN
# ours, the reference's strategy, the prompts it applies to. steps=8 over 16 tokens: 2 per block
# of 4; SDAR's static schedule rewrites a committed offset when a first decode block holds an odd
# number of masks (docs/sdar-reference-semantics.md), which ours never does: those prompts left out.
CASES = [
    ("static-1", Strategy("static", BS), PROMPTS),
    ("static,steps=8", Strategy("static", 2), [p for p in PROMPTS if len(p) % 2 == 0]),
    ("threshold,threshold=0.5", Strategy("dynamic", BS, threshold=0.5, at_least=True), PROMPTS),
    ("freedave,draft_steps=3", Strategy("static", BS), PROMPTS),
    ("freedave++,draft_steps=3,threshold=0.5",
     Strategy("dynamic", BS, threshold=0.5, at_least=True), PROMPTS),
]


# (seed, scale, head, eos): varied tokens, one commit a step under threshold 0.5, EOS on some
# prompts early, on some late, on one never; sharper output rows, threshold steps of 1 to 4
MODELS = [(0, 4.0, 1.0, 22), (3, 2.0, 4.0, 5)]


@pytest.mark.parametrize("spec,strategy,prompts", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed,scale,head,eos", MODELS, ids=["varied", "sharp"])
def test_tokens_are_the_references(spec: str, strategy: Strategy, prompts: list[list[int]],
                                   seed: int, scale: float, head: float, eos: int) -> None:
    """Token-identical to the reference loop through the first EOS (a token the model commits,
    so some prompts stop early); NFE is the reference's denoising forwards alone (the prefill
    and each store forward ride on the next block's first call) and the token-forwards its own
    less the last block's store, for the plain rules; FreeDave forwards drafts, never more
    calls than the rule it reproduces."""
    model = sdar(seed, scale, head)
    params = DecodeParams.parse(spec, gen_length=GEN, block_length=BS)
    out = decode(model, params, prompts, mask_id=MASK, eos_id=eos)
    for prompt, req in zip(prompts, out, strict=True):
        with torch.no_grad():
            want = generate(forward(model), prompt, MASK, GEN, BS, strategy, [eos])
        assert answer(req.token_ids, eos, GEN, MASK) == answer(want.canvas[len(prompt):], eos,
                                                               GEN, MASK), prompt
        denoising = sum(len(block) for block in want.commits)
        if spec.startswith("freedave"):
            assert req.nfe <= denoising
        else:
            assert (req.nfe, req.token_forwards) == (denoising, want.token_forwards - BS)


@pytest.mark.parametrize("spec,threshold", [("freedave,draft_steps=3", None),
                                            ("freedave++,draft_steps=3,threshold=0.5", 0.5)],
                         ids=["freedave", "freedave++"])
@pytest.mark.parametrize("seed,scale,head,eos", MODELS, ids=["varied", "sharp"])
def test_freedave_calls_no_more_than_freedaves_own(spec: str, threshold: float | None, seed: int,
                                                   scale: float, head: float, eos: int) -> None:
    """FreeDave's own block decoder (re-implemented, no eager acceptance) reproduces its rule;
    ours gives its tokens in no more forwards per prompt than it, less the prefill and the store
    forwards ours fuses into the next call (one per decoded block)."""
    model = sdar(seed, scale, head)
    rule = (Strategy("static", BS) if threshold is None else
            Strategy("dynamic", BS, threshold=threshold, at_least=True))
    out = decode(model, DecodeParams.parse(spec, gen_length=GEN, block_length=BS), PROMPTS,
                 mask_id=MASK, eos_id=eos)
    for prompt, req in zip(PROMPTS, out, strict=True):
        with torch.no_grad():
            theirs = freedave(forward(model), prompt, MASK, GEN, BS, 3, threshold, [eos])
            plain = generate(forward(model), prompt, MASK, GEN, BS, rule, [eos], STOPS[1])
        want = answer(theirs.canvas[len(prompt):], eos, GEN, MASK)
        assert want == answer(plain.canvas[len(prompt):], eos, GEN, MASK)
        assert answer(req.token_ids, eos, GEN, MASK) == want, prompt
        assert req.nfe <= theirs.nfe - (len(prompt) >= BS) - len(theirs.commits)
