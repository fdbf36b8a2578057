"""Suffix policies: which masked positions after the current block take part in a forward.

- full: all of them (the reference).
- window: only the first `suffix_local` positions after the block (the prior approach).
- structured: local (first `suffix_local` after the block), tail (last `suffix_tail` of the
  row's canvas) and `suffix_middle` positions of the middle chosen by a deterministic rule
  (`even`: evenly spaced; `decay`: denser near the block; `grid`: fixed slots, see `grid`).
  Dropped positions are left out of the forward entirely; kept ones keep their true position
  ids. With `inject` > 0 a kept position's input embedding carries the previous step's
  prediction: e = E[mask] + inject * (E[pred] - E[mask]).

Every quantity is computed from the row's own canvas (its prompt start, block and end), never
from the batch's padded width, so a row keeps the same positions whoever shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from unmask.decoding.knobs import REGISTRY, Knobs, at_least, choice, knob, register, within

if TYPE_CHECKING:
    from torch import Tensor, nn


@dataclass(frozen=True)
class LocalKnobs(Knobs):
    suffix_local: int = knob(32, ">= 0", at_least(0))


@dataclass(frozen=True)
class MiddleKnobs(Knobs):
    suffix_middle: int = knob(8, ">= 0", at_least(0))
    suffix_tail: int = knob(8, ">= 0", at_least(0))
    suffix_rule: str = choice("even", lambda: MIDDLE_RULES)


@dataclass(frozen=True)
class InjectKnobs(Knobs):
    inject: float = knob(0.0, "in [0, 1]", within(0, 1))


class SuffixParams(Protocol):
    """What a suffix policy reads of the decode parameters (a DecodeParams, which composes the
    knob classes above with every other policy's: unmask/decoding/params.py)."""

    suffix: str
    suffix_local: int
    suffix_middle: int
    suffix_tail: int
    suffix_rule: str
    inject: float


class SuffixPolicy:
    """Interface: `keep` -> (R, S) slots in this step's forward (host arrays); `embeds` -> input
    embeddings on the model's device (None: plain lookup)."""

    def __init__(self, params: SuffixParams) -> None:
        self.params = params

    def keep(self, slots: np.ndarray, row_start: np.ndarray, block_end: np.ndarray,
             row_end: np.ndarray) -> np.ndarray:
        """slots (S,); row_start (R,) slot of position 0 (after left padding); block_end (R,)
        one past the current block; row_end (R,) one past the row's last generated slot."""
        raise NotImplementedError

    def embeds(self, model: nn.Module, ids: np.ndarray, idx: np.ndarray, ok: np.ndarray,
               prev_token: np.ndarray, block_end: np.ndarray, ids_t: Tensor) -> Tensor | None:
        """(R, T, d) embeddings of the forwarded tokens ids (R, T) at slots idx (ids_t: ids on
        the model's device), carrying the previous step's predictions (prev_token (R, S)) into
        kept suffix slots; None when off."""
        import torch  # here, not at the top: the spec grammar imports this module's knobs

        lam = self.params.inject
        if lam == 0:
            return None
        prev = np.take_along_axis(prev_token, idx, 1)  # (R, T)
        mask_id = model.config.mask_token_id
        use = ok & (ids == mask_id) & (idx >= block_end[:, None]) & (prev != mask_id)
        if not use.any():
            return None
        e = model.embed(ids_t)  # (R, T, d)
        e_pred = model.embed(torch.from_numpy(np.where(use, prev, ids)).to(ids_t.device))
        use_t = torch.from_numpy(use).to(ids_t.device)
        return torch.where(use_t[..., None], e + lam * (e_pred - e), e)


class Full(SuffixPolicy):
    def keep(self, slots: np.ndarray, row_start: np.ndarray, block_end: np.ndarray,
             row_end: np.ndarray) -> np.ndarray:
        return slots[None, :] < row_end[:, None]

    def embeds(self, *args, **kwargs) -> Tensor | None:
        return None  # nothing is dropped, so there is nothing to carry


def _within(n: int, slots: np.ndarray) -> int:
    """A region size n (any int the spec allows) at most the canvas width: a larger region keeps
    the same slots, and numpy cannot hold every Python int."""
    return min(n, slots.shape[0])


class Window(SuffixPolicy):
    def keep(self, slots: np.ndarray, row_start: np.ndarray, block_end: np.ndarray,
             row_end: np.ndarray) -> np.ndarray:
        local_end = np.minimum(block_end + _within(self.params.suffix_local, slots), row_end)
        return slots[None, :] < local_end[:, None]


class Structured(SuffixPolicy):
    def keep(self, slots: np.ndarray, row_start: np.ndarray, block_end: np.ndarray,
             row_end: np.ndarray) -> np.ndarray:
        p = self.params
        local_end = block_end + _within(p.suffix_local, slots)  # (R,)
        tail_start = np.maximum(row_end - _within(p.suffix_tail, slots), row_start)  # (R,)
        s = slots[None, :]
        keep = (s < local_end[:, None]) | (s >= tail_start[:, None])
        if p.suffix_middle > 0:
            keep |= MIDDLE_RULES[p.suffix_rule](p, slots, row_start, local_end, tail_start)
        return keep & (s < row_end[:, None])


def grid(p: SuffixParams, slots: np.ndarray, row_start: np.ndarray, mid_start: np.ndarray,
         mid_end: np.ndarray) -> np.ndarray:
    """The middle's share of a fixed grid: slots mid_end-1, mid_end-1-stride, ... (N_mid of them,
    stride = the row's positions before the tail // N_mid). The picks do not move with the block,
    so a K/V cache keeps them from one block to the next instead of computing new ones; the price
    is that fewer than N_mid remain as the block advances into the grid."""
    n = _within(p.suffix_middle, slots)
    stride = np.maximum((mid_end - row_start) // n, 1)[:, None]  # (R, 1), in the row's positions
    back = mid_end[:, None] - 1 - slots[None, :]  # (R, S) distance below the tail
    on_grid = (back >= 0) & (back % stride == 0) & (back < n * stride)
    return on_grid & (slots[None, :] >= mid_start[:, None])


def spread(p: SuffixParams, slots: np.ndarray, row_start: np.ndarray, mid_start: np.ndarray,
           mid_end: np.ndarray) -> np.ndarray:
    """Exactly min(N_mid, width) distinct positions of [mid_start, mid_end) per row.

    Position i sits at i + floor(f_i * (gaps + 1)) past mid_start, with gaps = width - N_mid and
    f_i increasing in [0, 1): strictly increasing, so no two picks collide. `even` spaces the
    gaps evenly; `decay` (f_i squared) keeps more positions next to the block. The fractions are
    float32, so the picks are those the torch version of this rule made.
    """
    n = _within(p.suffix_middle, slots)
    width = np.maximum(mid_end - mid_start, 0)  # (R,)
    i = np.arange(n)  # (n,)
    frac = (i.astype(np.float32) + np.float32(0.5)) / np.float32(n)
    if p.suffix_rule == "decay":
        frac = frac**2
    gaps = np.maximum(width - n, 0)[:, None]  # (R, 1)
    offsets = i[None, :] + (frac[None, :] * (gaps + 1).astype(np.float32)).astype(np.int64)  # (R, n)
    offset = np.where(width[:, None] >= n, offsets, np.minimum(i[None, :], width[:, None] - 1))
    picks = np.minimum(np.maximum(mid_start[:, None] + offset, 0), slots.shape[0] - 1)
    out = np.zeros((mid_start.shape[0], slots.shape[0]), dtype=bool)
    np.put_along_axis(out, picks, np.broadcast_to(width[:, None] > 0, picks.shape), axis=1)
    return out


MIDDLE_RULES: dict[str, Callable[..., np.ndarray]] = {"even": spread, "decay": spread, "grid": grid}

register("suffix", "full", Full)
register("suffix", "window", Window, (LocalKnobs, InjectKnobs))
register("suffix", "structured", Structured, (LocalKnobs, MiddleKnobs, InjectKnobs))

# name -> policy class, the registry's view
POLICIES = {name: e.impl for name, e in REGISTRY["suffix"].items()}


def make_suffix_policy(params: SuffixParams) -> SuffixPolicy:
    return REGISTRY["suffix"][params.suffix].impl(params)
