"""The commit rules: which masked positions of the current block to commit, over the decode
state's (R, S) arrays. On the CPU the engine runs them on the host (numpy; unmask.engine.batch
says why); each function here takes torch tensors too and then runs on their device with the
same results (tests/test_device_rules.py), as a GPU's engine runs `static`, `static-1` and
`threshold` (unmask.engine.commit; docs/engine.md, "Host syncs"). Scoring a position (token
and confidence) runs on the model's device: unmask.decoding.scoring.

Ties (docs/design.md § Exactness and ties), one rule used everywhere: argmax over the vocabulary keeps
the lowest token id (torch.argmax returns the first maximum) and rankings over positions keep
the lowest position (a stable sort of the negated confidence).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

NEG_INF = float("-inf")
A = TypeVar("A", np.ndarray, "Tensor")  # host arrays or device tensors, the same in and out


def _torch_of(x: Any) -> Any:
    """torch when x is a tensor, else None. Read from sys.modules: whoever passes a tensor has
    imported torch, and importing it here would load torch for `unmask --help`
    (tests/test_hardening.py)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(x, torch.Tensor) else None


def _inverse(order: A) -> A:
    """(R, S) each row's inverse permutation of `order` (R, S)."""
    torch = _torch_of(order)
    if torch is not None:
        positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
        return torch.empty_like(order).scatter_(-1, order, positions)
    ranks = np.empty_like(order)
    ranks[np.arange(order.shape[0])[:, None], order] = np.arange(order.shape[-1])
    return ranks


def rank(conf: A) -> A:
    """Rank (0 = best) of each position of each row (R, S); ties go to the lowest position."""
    torch = _torch_of(conf)
    if torch is not None:
        return _inverse(torch.argsort(-conf, dim=-1, stable=True))  # NaN last, as numpy
    return _inverse(np.argsort(-conf, axis=-1, kind="stable"))


def candidate_ranks(conf: A, candidates: A) -> A:
    """(B, S) rank of each candidate among its row's candidates (`rank`'s order); the k best
    candidates of a row are those ranked below k, for any k (FreeDave's drafts rank once).
    Non-candidates rank after every candidate, even one scored -inf or NaN: they are NaN, which
    a sort puts last, and a candidate's NaN is -inf (fmax ignores NaN); a -inf fill would tie
    with such a candidate and win by position."""
    torch = _torch_of(conf)
    xp = torch or np
    neg_inf, nan = np.float32(NEG_INF), np.float32(np.nan)
    if torch is not None:
        neg_inf, nan = conf.new_tensor(NEG_INF), conf.new_tensor(float("nan"))
    return rank(xp.where(candidates, xp.fmax(conf, neg_inf), nan))


def select_top(conf: A, candidates: A, k: A) -> A:
    """Commit mask (B, S): the k[b] best candidates of each row (fewer if fewer exist)."""
    return (candidate_ranks(conf, candidates) < k[:, None]) & candidates


def at_least_one(n: A, candidates: A) -> A:
    """(B,) the counts n, raised to one in each row that has a candidate."""
    return n + ((n == 0) & candidates.any(-1))


def threshold_count(conf: A, candidates: A, tau: float | A) -> A:
    """How many candidates each row commits under threshold decoding: all with conf >= tau (one
    value, or (B,) one per row, float32 like conf), at least one when the row has a candidate."""
    if getattr(tau, "ndim", 0) == 1:
        tau = tau[:, None]
    return at_least_one(((conf >= tau) & candidates).sum(-1), candidates)


def larger(a: A, b: A) -> A:
    """The elementwise maximum of two arrays (or two tensors)."""
    torch = _torch_of(a)
    return torch.maximum(a, b) if torch is not None else np.maximum(a, b)


def static_count(masked_at_block_start: A, steps_per_block: A | int, block_step: A) -> A:
    """LLaDA's transfer schedule: M masked positions over s steps commit M // s per step, plus
    one for the first M % s steps."""
    base = masked_at_block_start // steps_per_block
    extra = block_step < masked_at_block_start % steps_per_block
    return base + extra
