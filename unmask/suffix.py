"""Suffix policies: which masked positions after the current block take part in a forward.

- full: all of them (the reference).
- window: only the first `suffix_local` positions after the block (the prior approach).
- structured: local (first `suffix_local` after the block), tail (last `suffix_tail` of the
  canvas) and `suffix_middle` positions of the middle chosen by a deterministic rule (`even`:
  evenly spaced; `decay`: denser near the block; `grid`: fixed slots, see `_grid`). Dropped
  positions are left out of the forward entirely; kept ones keep their true position ids. With
  `inject` > 0 a kept position's input embedding carries the previous step's prediction:
  e = E[mask] + inject * (E[pred] - E[mask]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from unmask.decoding.params import DecodeParams


def keep_mask(params: DecodeParams, slots: Tensor, block_end: Tensor) -> Tensor:
    """(R, S) bool: slots kept in this step's forward (everything up to the block end, plus the
    chosen suffix positions)."""
    end = block_end[:, None]  # (R, 1)
    keep = slots[None, :] < end
    if params.suffix == "full":
        return torch.ones_like(keep)
    local_end = end + params.suffix_local
    keep = keep | (slots[None, :] < local_end)
    if params.suffix == "window":
        return keep
    n_slots = slots.shape[0]
    tail_start = max(n_slots - params.suffix_tail, 0)
    keep = keep | (slots[None, :] >= tail_start)
    if params.suffix_middle > 0:
        rule = _grid if params.suffix_rule == "grid" else _middle
        keep = keep | rule(params, slots, local_end.squeeze(1), tail_start)
    return keep


def _grid(params: DecodeParams, slots: Tensor, mid_start: Tensor, mid_end: int) -> Tensor:
    """The middle's share of a fixed grid: slots mid_end-1, mid_end-1-stride, ... (N_mid of
    them, stride = mid_end // N_mid). The picks do not move with the block, so a K/V cache keeps
    them from one block to the next instead of computing new ones; the price is that fewer
    than N_mid remain as the block advances into the grid."""
    n = params.suffix_middle
    stride = max(mid_end // n, 1)
    back = mid_end - 1 - slots[None, :]  # (1, S) distance below the tail
    on_grid = (back >= 0) & (back % stride == 0) & (back < n * stride)
    return on_grid & (slots[None, :] >= mid_start[:, None])


def _middle(params: DecodeParams, slots: Tensor, mid_start: Tensor, mid_end: int) -> Tensor:
    """Exactly min(N_mid, width) distinct positions of [mid_start, mid_end) per row.

    Position i sits at i + floor(f_i * (gaps + 1)) past mid_start, with gaps = width - N_mid and
    f_i increasing in [0, 1): strictly increasing, so no two picks collide. `even` spaces the
    gaps evenly; `decay` (f_i squared) keeps more positions next to the block.
    """
    n = params.suffix_middle
    width = (mid_end - mid_start).clamp_min(0)  # (R,)
    i = torch.arange(n, device=slots.device)  # (n,)
    frac = (i.float() + 0.5) / n
    if params.suffix_rule == "decay":
        frac = frac**2
    gaps = (width - n).clamp_min(0)[:, None]  # (R, 1)
    spread = i[None, :] + (frac[None, :] * (gaps + 1).float()).long()  # (R, n)
    offset = torch.where(width[:, None] >= n, spread, torch.minimum(i[None, :], width[:, None] - 1))
    picks = (mid_start[:, None] + offset).clamp(0, slots.shape[0] - 1)
    out = torch.zeros(mid_start.shape[0], slots.shape[0], dtype=torch.bool, device=slots.device)
    out.scatter_(1, picks, (width[:, None] > 0).expand_as(picks))
    return out
