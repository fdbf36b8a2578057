"""Block-diffusion decoding against the references' loops: SDAR's `block_diffusion_generate` and
FreeDave's base block decoder, re-implemented in tests/block_reference.py from
docs/sdar-reference-semantics.md (the CI has neither repository; scripts/check_sdar_generate.py
runs the real ones, and the re-implementation beside them, benchmarks/sdar-generate.md).

First the re-implementation itself: the behaviours of the references that their names do not
say, each pinned on hand-made confidences, and its forward and store accounting on a model.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from block_reference import STOPS, Strategy, entropy_bounded, generate, pick, schedule
from helpers import peaky_model

VOCAB, MASK, EOS, BS = 64, 63, 1, 4
F, T = False, True


def masks(*flags: bool) -> torch.Tensor:
    return torch.tensor(flags)


@functools.cache
def sdar(seed: int = 0, scale: float = 4.0) -> torch.nn.Module:
    """A peaky tiny random SDAR (blocks of 4) whose output row for the mask token is zero: the
    references do not remove the mask token from the argmax, unmask does, so it must never win."""
    model = copy.deepcopy(peaky_model("sdar", seed, scale, VOCAB, MASK, EOS))
    with torch.no_grad():
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
