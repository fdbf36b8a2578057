"""The block-diffusion likelihood bound (unmask.evaluation.block_likelihood): its one-forward form
against a naive loop (one plain block-causal forward per target block, earlier blocks clean), on
tiny random models of each block family; the draws it makes; and on the shipped trained block
model, that it prefers true answers, through the lm-eval adapter."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from helpers import BLOCK_FAMILIES, math_choice_wins, tiny_model
from lm_eval.api.instance import Instance

from unmask.evaluation.block_likelihood import (
    draw_block_masks,
    estimate_block_bound,
    target_blocks,
)
from unmask.evaluation.harness import UnmaskLM
from unmask.evaluation.likelihood import sample_seed
from unmask.evaluation.tasks import TASKS

MASK = 2


def naive_block_losses(model: torch.nn.Module, prompt: list[int], target: list[int],
                       mc_num: int, seed: int) -> list[float]:
    """Per draw, for the same drawn masks: per target block, one forward of [prompt + clean
    earlier target blocks ; that block with its drawn positions masked], nothing after it, under
    the model's own block-causal attention; position i's prediction read at i - logit_shift."""
    bs, shift = model.config.block_size, model.logit_shift
    sizes = target_blocks(len(prompt), len(target), bs)
    generator = torch.Generator().manual_seed(sample_seed(seed, prompt, target))
    masked, weight = draw_block_masks(sizes, mc_num, generator)
    seq, p = torch.tensor(prompt + target), len(prompt)
    losses = []
    for j in range(mc_num):
        loss, start = 0.0, 0
        for n in sizes:
            end = p + start + n
            ids = seq[:end].clone()
            cols = [c for c in range(start, start + n) if masked[j, c]]
            ids[[p + c for c in cols]] = MASK
            logits = model(ids[None], torch.arange(end)[None])[0]  # (end, V)
            for c in cols:
                logp = torch.log_softmax(logits[max(p + c - shift, 0)].double(), -1)
                loss -= float(weight[j, c]) * float(logp[target[c]])
            start += n
        losses.append(loss)
    return losses


@pytest.mark.parametrize("family", list(BLOCK_FAMILIES))
@pytest.mark.parametrize(("p_len", "t_len"), [(0, 6), (3, 9), (5, 1), (8, 7)])
def test_one_forward_equals_a_forward_per_block(family: str, p_len: int, t_len: int) -> None:
    """Prompts ending mid-block, at a block's end and empty; targets of one token and of several
    blocks: the noisy/clean layout's estimate and spread equal the naive loop's for the same
    draws (float32), batch by batch or all at once. Fast-dLLM v2's logit shift reads a block's
    first prediction from the clean block before it."""
    model = tiny_model(family, **BLOCK_FAMILIES[family], vocab_size=300)
    gen = torch.Generator().manual_seed(p_len * 31 + t_len)
    prompt = torch.randint(5, 300, (p_len,), generator=gen).tolist()
    target = torch.randint(5, 300, (t_len,), generator=gen).tolist()
    mc_num = 6
    with torch.no_grad():
        naive = naive_block_losses(model, prompt, target, mc_num, seed=3)
    mean = statistics.mean(naive)
    stderr = statistics.stdev(naive) / math.sqrt(mc_num)
    for batch_size in (mc_num, 4):
        got = estimate_block_bound(model, prompt, target, MASK, mc_num=mc_num,
                                   batch_size=batch_size, seed=3)
        assert got.mc_num == mc_num
        assert got.logprob == pytest.approx(-mean, rel=1e-5, abs=1e-5)
        assert got.stderr == pytest.approx(stderr, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize(("p_len", "t_len", "want"),
                         [(0, 6, [4, 2]), (3, 9, [1, 4, 4]), (5, 1, [1]), (8, 7, [4, 3])])
def test_target_blocks_follow_the_models_blocks(p_len: int, t_len: int, want: list[int]) -> None:
    assert target_blocks(p_len, t_len, 4) == want


def test_each_block_draws_its_own_stratified_count() -> None:
    """Every block of every draw masks at least one of its target tokens, and each masked
    position weighs its block's size over the block's masked count."""
    sizes = [1, 4, 3]
    masked, weight = draw_block_masks(sizes, 16, torch.Generator().manual_seed(0))
    assert masked.shape == weight.shape == (16, 8)
    start = 0
    for n in sizes:
        count = masked[:, start : start + n].sum(1)
        assert count.min() >= 1
        torch.testing.assert_close(weight[:, start : start + n],
                                   (n / count.double())[:, None].expand(-1, n))
        # stratified: the ratios 1 - (u + j) / 16 cover (0, 1], so every count 1..n appears
        assert set(count.tolist()) == set(range(1, n + 1))
        start += n


@pytest.fixture(scope="module")
def sdar_lm() -> UnmaskLM:
    return UnmaskLM(pretrained="unmask-sdar", device="cpu", mc_num=16, greedy_check=False)


def test_shipped_block_model_prefers_the_true_answer(sdar_lm: UnmaskLM) -> None:
    """As test_lm_eval's test for the LLaDA model: held-out prompts (chat template), their worked
    solution ending in the true `#### answer` or in a wrong one; the true one should win far more
    often than chance."""
    wins, n, chance = math_choice_wins(sdar_lm, 12)
    assert wins / n >= 0.75 > 2 * chance


def test_shipped_block_model_rolling_and_greedy(sdar_lm: UnmaskLM) -> None:
    """loglikelihood_rolling scores a document after BOS by the block bound; is_greedy is true
    for the model's own static-1 answer in its blocks, false for a corrupted one."""
    ex = TASKS["math"].load("heldout", 1)[0]
    llm = sdar_lm.llm
    (rolling,) = sdar_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (ex.response,), 0)])
    target = llm.tokenizer.encode(ex.response, add_special_tokens=False)
    want = estimate_block_bound(llm.model, sdar_lm._bos(), target, llm.config.mask_token_id,
                                mc_num=16).logprob
    assert rolling == want and math.isfinite(rolling)
    context = sdar_lm.apply_chat_template([{"role": "user", "content": ex.prompt}])
    prompt = sdar_lm._encode(context)
    (own,) = llm.generate(context, "static-1", chat=False, gen_length=12)
    answer = own.token_ids[:9]  # ends mid-block: the check decodes that block whole
    wrong = answer[:-1] + [answer[0] if answer[-1] != answer[0] else answer[1]]
    checker = UnmaskLM(pretrained="unmask-sdar", device="cpu", mc_num=2)
    # token ids, not text: the decoded answer need not encode back to the same tokens
    assert [checker._is_greedy(prompt, t) for t in (answer, wrong)] == [True, False]
