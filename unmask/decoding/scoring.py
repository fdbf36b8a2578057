"""Scoring: from logits to (token, confidence) per position, on the model's device.

The knobs it reads and the ranking rules are declared in unmask.decoding.sampling. Each knob is
one value or one value per position (N,): rows of one batch sample with their own values, and a
position's result never depends on the values of the others.

Ties (docs/design.md § Exactness and ties): argmax over the vocabulary keeps the lowest token id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from unmask.decoding.knobs import entry
from unmask.syncs import cpu_only

NEG_INF = float("-inf")
Values = float | int | np.ndarray  # one value for every position, or (N,) one each


@dataclass
class Scored:
    """Per-position predictions of N selected positions."""

    token: Tensor  # (N,) long: the token a commit would write (argmax, or a Gumbel sample)
    conf: Tensor  # (N,) float32: the score that ranks positions for committing
    entropy: Tensor  # (N,) float32: entropy of the predictive distribution (EntropyCache signal)


def score(logits: Tensor, remasking: str, temperature: Values, noise_u: Tensor | None,
          suppress: list[int] | Tensor, top_p: Values = 1.0, top_k: Values = 0,
          alg_temp: Values = 0.0, with_entropy: bool = True,
          drop: list[int] | Tensor = (), allowed: Tensor | None = None) -> Scored:
    """Score N positions from their logits (N, V).

    noise_u: (N, V + 1) float64 uniforms where a position samples: columns 0..V-1 for the token
    (LLaDA's Gumbel trick, in float64: ``exp(logits) / (-log U) ** temperature``), column V for
    the position (random remasking, alg_temp); rows of positions that do not sample are never
    read. suppress: token ids that may never be predicted (always the mask token: committing it
    would commit nothing; EOS when asked); ids past the vocabulary are ignored, and a tensor of
    ids must hold none. drop: those of them removed from the distribution itself (EOS when
    asked, as LLaDA's ``logits_eos_inf``); the others (the mask token) are only never chosen:
    every score comes from the softmax over the rest of the vocabulary, as the references
    compute it (docs/design.md § Vocabulary, "Confidence"). top_p / top_k restrict the sampled
    token to the smallest set with probability >= top_p / the k likeliest. alg_temp > 0: the
    ranking score is log(conf) + alg_temp * Gumbel noise (alg_temp times log(conf) / alg_temp +
    Gumbel), so ranking draws positions in proportion to conf ** (1 / alg_temp) (Dream's
    alg_temp). with_entropy=False skips the entropy (zeros) when nothing reads it: an O(V) pass
    per position saved. allowed: (N, V) bool, a structured output's tokens each position may
    take (unmask.decoding.grammar), or float log-weights added to the logits (-inf: not
    allowed; `grammar.TokenMasks`): the others leave the distribution before anything is
    scored, so the token, its confidence and the entropy are those of the constrained
    distribution.
    """
    rule = entry("remasking", remasking)
    n = logits.shape[0]
    temperature, alg_temp = _each(temperature, n), _each(alg_temp, n)
    suppressed, dropped = _ids(suppress, logits), _ids(drop, logits)
    full = logits.float()
    if dropped.numel():
        full = full.index_fill(-1, dropped, NEG_INF)
    if allowed is not None:
        full = full.masked_fill(~allowed, NEG_INF) if allowed.dtype == torch.bool else full + allowed
    # Scores from softmax over the full vocabulary, as LLaDA's reference computes them: without
    # the mask token's share a confidence came out 1-2 ulps higher, and exp(log_softmax) an ulp
    # off near p = 1, either of which breaks near-ties in the commit order the other way.
    p = torch.softmax(full, dim=-1)
    if with_entropy or rule.facts.reads_entropy:
        entropy = entropy_of(p, torch.log_softmax(full, dim=-1))
    else:
        entropy = torch.zeros(p.shape[0], device=p.device)
    logits = full.index_fill(-1, suppressed, NEG_INF)  # what the token is chosen from
    sampled = temperature > 0
    if not sampled.any():
        token = argmax(logits)
    elif sampled.all():
        token = _sample(logits, p, temperature, _each(top_p, n), _each(top_k, n, np.int64),
                        noise_u, suppressed)
    else:
        token = argmax(logits)
        at = _index(sampled, logits.device)
        token[at] = _sample(logits[at], p[at], temperature[sampled], _each(top_p, n)[sampled],
                            _each(top_k, n, np.int64)[sampled], noise_u[at], suppressed)
    conf = rule.impl(p, token, entropy, noise_u)
    drawn = alg_temp > 0
    if drawn.any():
        at = slice(None) if drawn.all() else _index(drawn, logits.device)
        u = noise_u[at, -1]
        gumbel = -torch.log(-torch.log(u.clamp(1e-300, 1 - 1e-16)))
        base = conf[at].clamp_min(1e-30).log() if rule.facts.probability else conf[at]
        # base / alg_temp + gumbel, times alg_temp: the same order, and a tiny alg_temp cannot
        # overflow it to -inf for every position.
        scale = torch.from_numpy(alg_temp[drawn]).to(u.device)
        conf[at] = base + (scale * gumbel).float()  # conf is the rule's own new tensor
    return Scored(token, conf, entropy)


def _ids(ids: list[int] | Tensor, logits: Tensor) -> Tensor:
    """Token ids as a tensor on the logits' device, those past the vocabulary left out."""
    if isinstance(ids, Tensor):
        return ids  # the caller's, already within the vocabulary
    return torch.tensor([t for t in ids if t < logits.shape[-1]], dtype=torch.long,
                        device=logits.device)


def _each(values: Values, n: int, dtype: type = np.float64) -> np.ndarray:
    """(n,) one value per position (the caller's array as it is: a step passes its rows')."""
    if isinstance(values, np.ndarray) and values.shape == (n,):
        return values
    return np.full(n, values, dtype=dtype)


def _index(flags: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(np.flatnonzero(flags)).to(device)


def _sample(logits: Tensor, p: Tensor, temperature: np.ndarray, top_p: np.ndarray,
            top_k: np.ndarray, noise_u: Tensor, suppressed: Tensor) -> Tensor:
    """(N,) Gumbel-sampled tokens of N positions that sample (temperature > 0 each)."""
    assert noise_u is not None
    allowed = _nucleus(p, top_p, top_k)
    e = -torch.log(noise_u[:, : logits.shape[-1]])  # (N, V) Exp(1) draws
    # e ** T with T a Python float, one pass per distinct temperature: torch computes some
    # powers (T = 0.5, 2, 3) by a faster formula than pow, and the reference's bits are those.
    values = np.unique(temperature)
    if values.size == 1:
        powered = e ** float(values[0])
    else:
        powered = torch.empty_like(e)
        for t in values.tolist():
            at = _index(temperature == t, e.device)
            powered[at] = e[at] ** t
    # NaN (0/0 of a suppressed token), suppressed and filtered tokens rank below every
    # real score (all >= 0).
    inf = float("inf")  # kept as inf (nan_to_num's default makes it the largest float)
    noisy = (logits.double().exp() / powered).nan_to_num(nan=-1.0, posinf=inf)
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
        # a copy: a row field of the batch's knobs is a strided view, which torch cannot take
        t_all = torch.from_numpy(np.array(temperature, dtype=np.float64)).to(e.device)
        t_bad = t_all[bad, None]
        log = (logits[bad].double() - t_bad * e[bad].log()).masked_fill(~allowed[bad], -inf)
        log[:, suppressed] = -inf
        noisy[bad] = log
    return argmax(noisy)


@cpu_only
def argmax(t: Tensor) -> Tensor:
    """Index of the first maximum along the last dim (NaN counts as the maximum). On the CPU
    this is numpy's argmax, which returns the same index: torch 2.13's CPU argmax over a
    vocabulary is ~15x slower (146 vs 8 us at (32, 2048); BENCHMARKS.md, "Host overhead")."""
    if t.device.type == "cpu":
        return torch.from_numpy(np.argmax(t.detach().numpy(), axis=-1))
    return t.argmax(-1)


def _nucleus(p: Tensor, top_p: Values, top_k: Values) -> Tensor:
    """(N, V) bool: tokens kept by top-k and top-p (nucleus) filtering (one value, or (N,) one
    per position; top_p 1 and top_k 0 are off); the likeliest is always kept. Ties in
    probability keep the lower token id first."""
    n, v = p.shape
    top_p, top_k = _each(top_p, n), _each(top_k, n, np.int64)
    by_p, by_k = top_p < 1, top_k > 0
    if not (by_p.any() or by_k.any()):
        return torch.ones_like(p, dtype=torch.bool)
    order = torch.sort(-p, dim=-1, stable=True).indices  # likeliest first
    sorted_p = p.gather(-1, order)
    keep_sorted = torch.ones_like(sorted_p, dtype=torch.bool)
    if by_p.any():
        # float32, as a Python float compared with the float32 mass is
        limit = np.where(by_p, top_p, np.inf).astype(np.float32)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above
        keep_sorted &= before < torch.from_numpy(limit).to(p.device)[:, None]
    if by_k.any():
        k = np.where(by_k, top_k, v)
        keep_sorted &= torch.arange(v, device=p.device)[None, :] < torch.from_numpy(k).to(p.device)[:, None]
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
