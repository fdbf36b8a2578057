"""The decoding rules: from logits to (token, confidence) per position, and which masked
positions of the current block to commit.

`score` runs on the model's device (torch, over logits); the commit rules below run on the
host (numpy, over the decode state's (R, S) arrays; unmask.engine.batch says why).

Ties (docs/design.md § Exactness and ties), one rule used everywhere: argmax over the vocabulary keeps
the lowest token id (torch.argmax returns the first maximum) and rankings over positions keep
the lowest position (a stable sort of the negated confidence).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
          suppress: list[int] | Tensor, top_p: float = 1.0, top_k: int = 0, alg_temp: float = 0.0,
          with_entropy: bool = True) -> Scored:
    """Score N positions from their logits (N, V).

    noise_u: (N, V + 1) float64 uniforms when sampling: columns 0..V-1 for the token (LLaDA's
    Gumbel trick, in float64: ``exp(logits) / (-log U) ** temperature``), column V for the
    position (random remasking, alg_temp). suppress: token ids that may never be predicted
    (always the mask token: committing it would commit nothing; EOS when asked); ids past the
    vocabulary are ignored, and a tensor of ids must hold none. top_p / top_k
    restrict the sampled token to the smallest set with probability >= top_p / the k likeliest.
    alg_temp > 0: the ranking score is log(conf) + alg_temp * Gumbel noise (alg_temp times
    log(conf) / alg_temp + Gumbel), so ranking draws positions in proportion to
    conf ** (1 / alg_temp) (Dream's alg_temp). with_entropy=False
    skips the entropy (zeros) when nothing reads it: an O(V) pass per position saved.
    """
    if isinstance(suppress, Tensor):
        suppressed = suppress  # the caller's, already within the vocabulary
    else:
        suppressed = torch.tensor([t for t in suppress if t < logits.shape[-1]], dtype=torch.long,
                                  device=logits.device)
    logits = logits.float().index_fill(-1, suppressed, NEG_INF)
    # Confidence from softmax, as LLaDA's reference computes it (exp(log_softmax) differs by an
    # ulp near p = 1, which makes or breaks near-ties in the commit order).
    p = torch.softmax(logits, dim=-1)
    if with_entropy or remasking == "entropy":
        entropy = entropy_of(p, torch.log_softmax(logits, dim=-1))
    else:
        entropy = torch.zeros(p.shape[0], device=p.device)
    if temperature > 0:
        assert noise_u is not None
        allowed = _nucleus(p, top_p, top_k)
        e = -torch.log(noise_u[:, : logits.shape[-1]])  # (N, V) Exp(1) draws
        # NaN (0/0 of a suppressed token), suppressed and filtered tokens rank below every
        # real score (all >= 0).
        inf = float("inf")  # kept as inf (nan_to_num's default makes it the largest float)
        noisy = (logits.double().exp() / e**temperature).nan_to_num(nan=-1.0, posinf=inf)
        noisy = noisy.masked_fill(~allowed, -1.0)
        noisy[:, suppressed] = -1.0
        # A huge temperature underflows e ** T to 0 (or overflows it): exp(l) / 0 is inf for
        # every token with e < 1, and argmax took the first of them, so the lowest ids always
        # won. Such rows (an inf, or no score above 0) rank by the same score's log,
        # l - T log e, which stays finite; the other rows keep the reference's formula, bit for
        # bit, and pay one reduction for the check.
        top = noisy.amax(-1)
        bad = top.isinf() | (top <= 0)
        if bad.any():
            log = (logits[bad].double() - temperature * e[bad].log()).masked_fill(
                ~allowed[bad], -inf)
            log[:, suppressed] = -inf
            noisy[bad] = log
        token = argmax(noisy)
    else:
        token = argmax(logits)
    if remasking in ("low_confidence", "maskgit_plus"):
        conf = p.gather(-1, token[:, None]).squeeze(-1)
    elif remasking == "topk_margin":
        top2 = p.topk(2, dim=-1).values
        conf = top2[:, 0] - top2[:, 1]
    elif remasking == "entropy":
        conf = -entropy
    elif remasking == "random":
        # Random remasking ranks by a uniform draw; taken from the (seeded) noise when there is one.
        conf = (noise_u[:, -1].float() if noise_u is not None else torch.rand(len(token)))
    else:
        raise ValueError(f"unknown remasking rule {remasking!r}")
    if alg_temp > 0:
        assert noise_u is not None
        gumbel = -torch.log(-torch.log(noise_u[:, -1].clamp(1e-300, 1 - 1e-16)))
        base = conf.clamp_min(1e-30).log() if remasking != "entropy" else conf
        # base / alg_temp + gumbel, times alg_temp: the same order, and a tiny alg_temp cannot
        # overflow it to -inf for every position.
        conf = base + (alg_temp * gumbel).float()
    return Scored(token, conf, entropy)


def argmax(t: Tensor) -> Tensor:
    """Index of the first maximum along the last dim (NaN counts as the maximum). On the CPU
    this is numpy's argmax, which returns the same index: torch 2.13's CPU argmax over a
    vocabulary is ~15x slower (146 vs 8 us at (32, 2048); BENCHMARKS.md, "Host overhead")."""
    if t.device.type == "cpu":
        return torch.from_numpy(np.argmax(t.detach().numpy(), axis=-1))
    return t.argmax(-1)


def _nucleus(p: Tensor, top_p: float, top_k: int) -> Tensor:
    """(N, V) bool: tokens kept by top-k and top-p (nucleus) filtering; the likeliest is always
    kept. Ties in probability keep the lower token id first."""
    if top_p >= 1 and top_k <= 0:
        return torch.ones_like(p, dtype=torch.bool)
    order = torch.sort(-p, dim=-1, stable=True).indices  # likeliest first
    sorted_p = p.gather(-1, order)
    keep_sorted = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_p < 1:
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above
        keep_sorted &= before < top_p
    if top_k > 0:
        keep_sorted[:, top_k:] = False
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted)
    keep.scatter_(-1, order, keep_sorted)
    return keep


def entropy_of(p: Tensor, logp: Tensor) -> Tensor:
    """Entropy (nats) of each row's distribution: O(V) per position, EntropyCache's signal."""
    # In place on one temporary (the same values as -(p * logp.clamp_min(-1e30)).sum(-1)): at a
    # few hundred positions x a vocabulary, fresh temporaries cost a quarter of the time.
    t = logp.clamp_min(-1e30)
    return t.mul_(p).sum(-1).neg_()


def rank(conf: np.ndarray) -> np.ndarray:
    """Rank (0 = best) of each position of each row (R, S); ties go to the lowest position."""
    order = np.argsort(-conf, axis=-1, kind="stable")  # (R, S)
    ranks = np.empty_like(order)
    ranks[np.arange(order.shape[0])[:, None], order] = np.arange(conf.shape[-1])
    return ranks


def candidate_ranks(conf: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """(B, S) rank of each candidate among its row's candidates (`rank`'s order); the k best
    candidates of a row are those ranked below k, for any k (FreeDave's drafts rank once).
    Non-candidates rank after every candidate, even one scored -inf or NaN: they are NaN, which
    a sort puts last, and a candidate's NaN is -inf (fmax ignores NaN); a -inf fill would tie
    with such a candidate and win by position."""
    neg_inf = np.float32(NEG_INF)
    return rank(np.where(candidates, np.fmax(conf, neg_inf), np.float32(np.nan)))


def select_top(conf: np.ndarray, candidates: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Commit mask (B, S): the k[b] best candidates of each row (fewer if fewer exist)."""
    return (candidate_ranks(conf, candidates) < k[:, None]) & candidates


def threshold_count(conf: np.ndarray, candidates: np.ndarray, tau: float) -> np.ndarray:
    """How many candidates each row commits under threshold decoding: all with conf >= tau,
    at least one when the row has a candidate."""
    n = ((conf >= tau) & candidates).sum(-1)
    return np.maximum(n, candidates.any(-1))


def static_count(masked_at_block_start: np.ndarray, steps_per_block: np.ndarray | int,
                 block_step: np.ndarray) -> np.ndarray:
    """LLaDA's transfer schedule: M masked positions over s steps commit M // s per step, plus
    one for the first M % s steps."""
    base = masked_at_block_start // steps_per_block
    extra = block_step < masked_at_block_start % steps_per_block
    return base + extra
