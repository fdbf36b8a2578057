"""The decoding rules: from logits to (token, confidence) per position, and which masked
positions of the current block to commit.

Ties (docs/design.md § Exactness and ties), one rule used everywhere: argmax over the vocabulary keeps
the lowest token id (torch.argmax returns the first maximum) and rankings over positions keep
the lowest position (a stable sort of the negated confidence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


@dataclass
class Scored:
    """Per-position predictions of N selected positions."""

    token: Tensor  # (N,) long: the token a commit would write (argmax, or a Gumbel sample)
    conf: Tensor  # (N,) float32: the score that ranks positions for committing
    entropy: Tensor  # (N,) float32: entropy of the predictive distribution (EntropyCache signal)


def score(logits: Tensor, remasking: str, temperature: float, noise_u: Tensor | None,
          suppress: list[int]) -> Scored:
    """Score N positions from their logits (N, V).

    noise_u: (N, V) float64 uniforms for temperature > 0 (LLaDA's Gumbel trick, in float64:
    ``exp(logits) / (-log U) ** temperature``). suppress: token ids that may never be predicted
    (always the mask token: committing it would commit nothing; EOS when asked).
    """
    logits = logits.float().clone()
    suppressed = [t for t in suppress if t < logits.shape[-1]]
    logits[:, suppressed] = NEG_INF
    # Confidence from softmax, as LLaDA's reference computes it (exp(log_softmax) differs by an
    # ulp near p = 1, which makes or breaks near-ties in the commit order).
    p = torch.softmax(logits, dim=-1)
    logp = torch.log_softmax(logits, dim=-1)
    entropy = entropy_of(p, logp)
    if temperature > 0:
        assert noise_u is not None
        noisy = logits.double().exp() / (-torch.log(noise_u)) ** temperature
        # A huge temperature underflows (-log U) ** T to 0: 0/0 is NaN, which argmax would pick.
        # NaN and suppressed tokens rank below every real score (all >= 0).
        noisy = noisy.nan_to_num(nan=-1.0)
        noisy[:, suppressed] = -1.0
        token = noisy.argmax(-1)
    else:
        token = logits.argmax(-1)
    if remasking in ("low_confidence", "maskgit_plus"):
        conf = p.gather(-1, token[:, None]).squeeze(-1)
    elif remasking == "topk_margin":
        top2 = p.topk(2, dim=-1).values
        conf = top2[:, 0] - top2[:, 1]
    elif remasking == "entropy":
        conf = -entropy
    elif remasking == "random":
        # Random remasking ranks by a uniform draw; taken from the (seeded) noise when there is one.
        conf = (noise_u[:, 0].float() if noise_u is not None else torch.rand(len(token)))
    else:
        raise ValueError(f"unknown remasking rule {remasking!r}")
    return Scored(token, conf, entropy)


def entropy_of(p: Tensor, logp: Tensor) -> Tensor:
    """Entropy (nats) of each row's distribution: O(V) per position, EntropyCache's signal."""
    return -(p * logp.clamp_min(-1e30)).sum(-1)


def rank(conf: Tensor) -> Tensor:
    """Rank (0 = best) of each position along the last dim; ties go to the lowest position."""
    order = torch.sort(-conf, dim=-1, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(conf.shape[-1], device=conf.device).expand_as(order))
    return ranks


def select_top(conf: Tensor, candidates: Tensor, k: Tensor) -> Tensor:
    """Commit mask (B, S): the k[b] best candidates of each row (fewer if fewer exist)."""
    c = conf.masked_fill(~candidates, NEG_INF)
    return (rank(c) < k[:, None]) & candidates


def threshold_count(conf: Tensor, candidates: Tensor, tau: float) -> Tensor:
    """How many candidates each row commits under threshold decoding: all with conf >= tau,
    at least one when the row has a candidate."""
    n = ((conf >= tau) & candidates).sum(-1)
    return torch.maximum(n, candidates.any(-1).long())


def static_count(masked_at_block_start: Tensor, steps_per_block: int, block_step: Tensor) -> Tensor:
    """LLaDA's transfer schedule: M masked positions over s steps commit M // s per step, plus
    one for the first M % s steps."""
    base = masked_at_block_start // steps_per_block
    extra = (block_step < masked_at_block_start % steps_per_block).long()
    return base + extra
