"""The commit rules: which masked positions of the current block to commit, on the host (numpy,
over the decode state's (R, S) arrays; unmask.engine.batch says why). Scoring a position (token
and confidence) runs on the model's device: unmask.decoding.scoring.

Ties (docs/design.md § Exactness and ties), one rule used everywhere: argmax over the vocabulary keeps
the lowest token id (torch.argmax returns the first maximum) and rankings over positions keep
the lowest position (a stable sort of the negated confidence).
"""

from __future__ import annotations

import numpy as np

NEG_INF = float("-inf")


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


def threshold_count(conf: np.ndarray, candidates: np.ndarray, tau: float | np.ndarray) -> np.ndarray:
    """How many candidates each row commits under threshold decoding: all with conf >= tau (one
    value, or (B,) one per row, float32 like conf), at least one when the row has a candidate."""
    if isinstance(tau, np.ndarray):
        tau = tau[:, None]
    n = ((conf >= tau) & candidates).sum(-1)
    return np.maximum(n, candidates.any(-1))


def static_count(masked_at_block_start: np.ndarray, steps_per_block: np.ndarray | int,
                 block_step: np.ndarray) -> np.ndarray:
    """LLaDA's transfer schedule: M masked positions over s steps commit M // s per step, plus
    one for the first M % s steps."""
    base = masked_at_block_start // steps_per_block
    extra = block_step < masked_at_block_start % steps_per_block
    return base + extra
