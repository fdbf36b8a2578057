"""Monte Carlo estimate of a block-diffusion model's log-likelihood bound (SDAR, LLaDA2,
Fast-dLLM v2: a config with `block_size`).

Such a model attends block-causally in its own blocks, at absolute positions (docs/design.md §
Checkpoints): block k holds positions [k * b, (k + 1) * b), so the target's first block opens
with the prompt's tail, as in decoding (docs/decoders.md, "Block-diffusion decoding";
unmask.engine.layout). The chain rule over those blocks is exact,

    log p(target | prompt) = sum over target blocks k of log p(x_k | prompt, x_<k),

and each factor, a block decoded from the clean prompt and the clean earlier target blocks, has
the masked-diffusion bound of unmask.evaluation.likelihood over that block's n_k target tokens.
So, per draw, each target block is noised at its own ratio (l_k = ceil(t_k * n_k) of its target
tokens masked, never the prompt's tail sharing its block), and

    loss = sum over blocks k of n_k / l_k * sum over masked positions i of block k of -log p(x_i | ...)

with E[loss] >= -log p(target | prompt): the block-diffusion objective the model is trained on
(unmask.training.block_diffusion). Each block's ratios are stratified over the ``mc_num`` draws
as the masked-diffusion estimate's are, from the same seeded generator (`sample_seed`), so a
request's estimate does not depend on its batch; the reported log-likelihood is -mean(loss).

One forward scores every block of a draw (``batch_size`` draws a forward): the noisy copy and the
clean copy side by side under the training attention (`training_mask`), so each noisy block sees
the clean earlier blocks and its own noisy block only, what one forward per block, earlier
blocks clean, shows it. A model with `logit_shift` 1 (Fast-dLLM v2) predicts position i from
i - 1: inside a block that is the noisy copy's i - 1; at a block's first position, the clean
copy's i - 1, the last token of the clean block before it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from unmask.evaluation.likelihood import (
    Bound,
    Layout,
    check_draws,
    draw_masks,
    sample_seed,
    score_draws,
)
from unmask.kv import Frame
from unmask.models.sdar import training_mask


def target_blocks(prompt_len: int, target_len: int, block_size: int) -> list[int]:
    """The target's token counts per model block, in order: the first block holds what the
    prompt's tail leaves of it."""
    sizes, start = [], prompt_len
    while start < prompt_len + target_len:
        end = min((start // block_size + 1) * block_size, prompt_len + target_len)
        sizes.append(end - start)
        start = end
    return sizes


def draw_block_masks(sizes: list[int], mc_num: int,
                     generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(masked (mc_num, L) bool, weight (mc_num, L) float64) over the target's positions: each
    block of sizes[k] target tokens masked by its own stratified draw (`draw_masks`), a masked
    position of it weighing n_k / l_k in its draw's loss."""
    masks, weights = [], []
    for n in sizes:
        masked, count = draw_masks(n, mc_num, generator)
        masks.append(masked)
        weights.append((n / count.double())[:, None].expand(-1, n))
    return torch.cat(masks, dim=1), torch.cat(weights, dim=1)


def noisy_beside_clean(block_size: int, shift: int) -> Layout:
    """Each draw's row is [noisy (T) ; clean (T)] at positions 0..T-1 twice, under
    `training_mask`; a masked token's prediction is read in the noisy copy, or in the clean copy
    where the logit shift reaches into the block before (module docstring)."""
    masks: dict[int, Tensor] = {}  # T -> its (2T, 2T) attention, built once per request

    def layout(seq: Tensor, noisy: Tensor, at: Tensor) -> tuple[Tensor, Tensor, Frame, Tensor]:
        b, t_len = noisy.shape
        ids = torch.cat([noisy, seq.expand(b, -1)], dim=1)  # (B, 2T)
        positions = torch.arange(t_len, device=seq.device).repeat(2).expand(b, -1)  # (B, 2T)
        if t_len not in masks:
            masks[t_len] = training_mask(t_len, block_size, seq.device)
        frame = Frame(attn_mask=masks[t_len])
        src = (at - shift).clamp(min=0)  # (N,)
        same_block = torch.div(src, block_size, rounding_mode="floor") == torch.div(
            at, block_size, rounding_mode="floor")
        return ids, positions, frame, torch.where(same_block, src, src + t_len)
    return layout


@torch.no_grad()
def estimate_block_bound(model: nn.Module, prompt: list[int], target: list[int], mask_id: int,
                         mc_num: int = 128, batch_size: int = 32, seed: int = 0) -> Bound:
    """Estimate log p(target | prompt) by the block-diffusion bound (module docstring), for a
    model whose config sets `block_size`."""
    check_draws(target, mc_num, batch_size)
    block_size = model.config.block_size
    generator = torch.Generator().manual_seed(sample_seed(seed, prompt, target))
    sizes = target_blocks(len(prompt), len(target), block_size)
    masked, weight = draw_block_masks(sizes, mc_num, generator)
    layout = noisy_beside_clean(block_size, int(getattr(model, "logit_shift", 0)))
    return score_draws(model, prompt, target, mask_id, masked, weight, batch_size, layout)
