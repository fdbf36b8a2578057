"""Monte Carlo estimate of a masked-diffusion model's log-likelihood bound.

A masked dLLM has no exact log p(target | prompt); LLaDA's evaluation uses the lower bound its
training minimises. With L target tokens, draw a mask ratio t in (0, 1], mask l = ceil(t * L)
target positions chosen uniformly at random (never the prompt), and score

    loss = L / l * sum over masked positions i of -log p(target_i | prompt, partly masked target)

so that l is uniform on 1..L and E[loss] >= -log p(target | prompt). The estimate averages
``mc_num`` samples whose ratios are stratified (t_j = 1 - (u + j) / mc_num, one uniform offset u
for all): each stratum is still drawn at random, so the mean stays unbiased, with less spread
than independent draws. The log-likelihood reported is -mean(loss).

Everything random comes from one ``torch.Generator`` seeded from (seed, prompt, target), so an
estimate does not depend on which other requests share a run, or in which order they come.

`score_draws` turns drawn masks into the estimate for any bound of this form (per-position
weights, a layout of the forward); the block-diffusion bound (unmask.evaluation.block_likelihood)
is the other one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from unmask.kv import Frame


@dataclass(frozen=True)
class Bound:
    """A Monte Carlo estimate of the bound on log p(target | prompt)."""

    logprob: float  # -mean(loss): the log-likelihood estimate
    stderr: float  # std of the per-sample losses / sqrt(mc_num) (stratification makes it an overestimate)
    mc_num: int


def sample_seed(seed: int, prompt: list[int], target: list[int]) -> int:
    """A generator seed that depends only on the request and the user's seed."""
    text = f"{seed}|{','.join(map(str, prompt))}|{','.join(map(str, target))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def draw_masks(length: int, mc_num: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked (mc_num, length) bool, count (mc_num,) long): sample j masks count[j] >= 1 target
    positions chosen uniformly at random, with count[j] = ceil(t_j * length) for stratified t_j."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    t = 1 - (u + torch.arange(mc_num, dtype=torch.float64)) / mc_num  # in (0, 1]
    count = torch.ceil(t * length).long().clamp(1, length)
    # A uniformly random subset of size count[j]: the positions of the count[j] smallest keys.
    keys = torch.rand(mc_num, length, generator=generator)
    ranks = keys.argsort(dim=1).argsort(dim=1)
    return ranks < count[:, None], count


def check_draws(target: list[int], mc_num: int, batch_size: int) -> None:
    """A ValueError for a request no bound can score (a caller's bug: the adapter scores an
    empty continuation as 0 without asking)."""
    if not target:
        raise ValueError("target is empty: there is nothing to score")
    if mc_num < 1 or batch_size < 1:
        raise ValueError(f"mc_num and batch_size must be >= 1, got {mc_num} and {batch_size}")


# (clean (T,) prompt + target ids, noisy (B, T) the same with the draws' masks, at (N,) the
# sequence index of each masked target token) -> the forward's (input ids, position ids, frame,
# the input column holding each masked token's prediction (N,)): how one bound lays out a batch.
Layout = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Frame | None, Tensor]]


def score_draws(model: nn.Module, prompt: list[int], target: list[int], mask_id: int,
                masked: Tensor, weight: Tensor, batch_size: int, layout: Layout) -> Bound:
    """The bound from draws: masked (mc_num, L) bool, the target positions each draw masks;
    weight (mc_num, L) float64, what a masked position's -log p counts for in its draw's loss.
    ``batch_size`` draws a forward, laid out by ``layout``."""
    device = next(model.parameters()).device
    seq = torch.tensor(prompt + target, dtype=torch.long, device=device)
    want = seq[len(prompt):]
    losses = []
    for start in range(0, len(masked), batch_size):
        m = masked[start : start + batch_size].to(device)  # (B, L)
        noisy = seq.repeat(len(m), 1)
        noisy[:, len(prompt):][m] = mask_id
        rows, cols = m.nonzero(as_tuple=True)  # cols: index into the target
        ids, positions, frame, read_at = layout(seq, noisy, cols + len(prompt))
        logits = model(ids, positions, frame, logits_at=(rows, read_at))  # (N, V)
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -logp.gather(1, want[cols][:, None]).squeeze(1)  # (N,)
        w = weight[start : start + batch_size].to(device)[rows, cols]  # (N,)
        per_sample = torch.zeros(len(m), dtype=torch.float64, device=device)
        losses.append(per_sample.index_add_(0, rows, nll.double() * w).cpu())
    loss = torch.cat(losses)
    stderr = loss.std().item() / math.sqrt(len(loss)) if len(loss) > 1 else math.inf
    return Bound(logprob=-loss.mean().item(), stderr=stderr, mc_num=len(loss))


def whole_sequence(shift: int) -> Layout:
    """One row per draw, the noisy sequence alone, at positions 0..T-1; a masked token's
    prediction read at its own column less the model's logit shift."""
    def layout(seq: Tensor, noisy: Tensor, at: Tensor) -> tuple[Tensor, Tensor, None, Tensor]:
        positions = torch.arange(len(seq), device=seq.device).expand(len(noisy), -1)
        return noisy, positions, None, (at - shift).clamp(min=0)
    return layout


@torch.no_grad()
def estimate_bound(model: nn.Module, prompt: list[int], target: list[int], mask_id: int,
                   mc_num: int = 128, batch_size: int = 32, seed: int = 0) -> Bound:
    """Estimate log p(target | prompt) by the masked-diffusion bound (module docstring).

    ``model(input_ids, position_ids, logits_at=(rows, cols))`` gives the logits of the listed
    positions; ``model.logit_shift`` = 1 (Dream) reads position i's prediction at i - 1.
    Rows of one batch are samples of this one request: they share a length, so no padding
    (the model's attention is bidirectional and has no padding mask).
    """
    check_draws(target, mc_num, batch_size)
    generator = torch.Generator().manual_seed(sample_seed(seed, prompt, target))
    masked, count = draw_masks(len(target), mc_num, generator)
    weight = (len(target) / count.double())[:, None].expand(-1, len(target))  # (mc_num, L)
    layout = whole_sequence(int(getattr(model, "logit_shift", 0)))
    return score_draws(model, prompt, target, mask_id, masked, weight, batch_size, layout)
