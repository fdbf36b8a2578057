"""One model call over a set of canvas rows: gather the slots to recompute, attend to stored K/V
for the other visible slots, and score the positions the decoder needs.

This is the only place that turns a canvas into model inputs, so every decoder, cache policy and
suffix policy shares it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from unmask.decoding.params import DecodeParams
from unmask.decoding.rules import score
from unmask.kv import Frame, KVStore
from unmask.suffix import SuffixPolicy


@dataclass
class Forwarded:
    """Result of one forward of R rows, scattered back to canvas slots."""

    token: Tensor  # (R, S) long  predicted token per slot (valid where `fresh`)
    conf: Tensor  # (R, S) float confidence
    entropy: Tensor  # (R, S) float entropy of the predictive distribution
    fresh: Tensor  # (R, S) bool  slots scored by this forward
    kv: list[tuple[Tensor, Tensor]]  # per layer (R, H_kv, T, D) K/V of the forwarded tokens
    idx: Tensor  # (R, T) slot of each forwarded token
    ids: Tensor  # (R, T) the forwarded tokens
    ok: Tensor  # (R, T) bool, False for batch padding
    refresh: Tensor  # (R,) bool, the row was a full forward
    visible: Tensor  # (R, S) bool, slots that took part (forwarded or read from the store)

    @property
    def n_tokens(self) -> Tensor:  # (R,) token-forwards per row
        return self.ok.sum(-1)


class Runner:
    def __init__(self, model: nn.Module, params: DecodeParams, mask_id: int, eos_id: int,
                 suffix: SuffixPolicy) -> None:
        self.model, self.params, self.suffix = model, params, suffix
        # Entropies feed EntropyCache's refresh decision (and entropy remasking) only.
        self.with_entropy = params.cache == "entropy" or params.remasking == "entropy"
        self.mask_id, self.eos_id = mask_id, eos_id
        self.shift = int(getattr(model, "logit_shift", 0))
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def forward(self, x: Tensor, pad: Tensor, visible: Tensor, active: Tensor, predict: Tensor,
                refresh: Tensor, store: KVStore | None, prev_token: Tensor,
                noise: Tensor | None, block_start: Tensor) -> Forwarded:
        """Forward rows x (R, S).

        visible: slots that exist in this step (R, S); active: slots recomputed (a subset);
        the rest of `visible` is read from `store` (already gathered to these R rows).
        predict: slots whose prediction is needed. noise: (R, block_length, V + 1) uniforms or None.
        """
        r, s = x.shape
        if self.shift:
            # Dream reads slot i's prediction from token i-1: that token must be recomputed too.
            # The slot before the block always is, so its stored K/V never depends on the path
            # (which steps happened to need it), keeping cached decoding path-independent.
            src = torch.zeros_like(predict)
            src[:, :-1] = predict[:, 1:]
            before = (block_start - 1).clamp_min(0)
            src[torch.arange(r, device=x.device), before] = True
            active = active | (src & visible)
        n = int(active.sum(-1).max())
        # Active slots first, in slot order (stable sort of the "not active" flag).
        idx = torch.sort((~active).to(torch.int8), dim=-1, stable=True).indices[:, :n]  # (R, T)
        ok = active.gather(1, idx)
        ids = x.gather(1, idx)
        pos = idx - pad[:, None]
        block_end = block_start + self.params.block_length
        embeds = self.suffix.embeds(self.model, ids, idx, ok, prev_token, block_end)
        cached = visible & ~active
        past = store if store is not None and bool(cached.any()) else None
        past_mask = cached & store.valid if past is not None else None
        target = idx + self.shift  # slot each output predicts
        want = ok & (target < s)
        want &= predict.gather(1, target.clamp_max(s - 1))
        rows, cols = want.nonzero(as_tuple=True)
        tslots = target[rows, cols]
        logits, kv = self._call(ids, pos, ok, embeds, past, past_mask, rows, cols)

        u = None
        if noise is not None:
            u = noise[rows, (tslots - block_start[rows]).clamp(0, noise.shape[1] - 1)]
        sup = [self.mask_id] + ([self.eos_id] if self.params.suppress_eos else [])
        pr = self.params
        sc = score(logits, pr.remasking, pr.temperature, u, sup, pr.top_p, pr.top_k, pr.alg_temp,
                   with_entropy=self.with_entropy)
        token = torch.full((r, s), self.mask_id, dtype=torch.long, device=x.device)
        conf = torch.full((r, s), float("-inf"), device=x.device)
        ent = torch.zeros((r, s), device=x.device)
        fresh = torch.zeros((r, s), dtype=torch.bool, device=x.device)
        token[rows, tslots], conf[rows, tslots], ent[rows, tslots] = sc.token, sc.conf, sc.entropy
        fresh[rows, tslots] = True
        return Forwarded(token, conf, ent, fresh, kv, idx, ids, ok, refresh, visible)

    def _call(self, ids: Tensor, pos: Tensor, ok: Tensor, embeds: Tensor | None,
              past: KVStore | None, past_mask: Tensor | None, rows: Tensor,
              cols: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The model call(s): logits (N, V) at (rows, cols) and each layer's fresh (k, v)
        (R, H_kv, T, D). Only the scored positions get the LM head (~10% of a forward on the
        embedded model).

        Rows are padded to the longest row's T. When a few rows forward far more tokens than
        the rest (a cache refresh next to cached steps), the padding would cost more than a
        second call: then the short rows get a call of their own."""
        groups = self._split(ok.sum(-1))
        if groups is None:
            frame = Frame(key_mask=ok, past=past, past_mask=past_mask)
            logits = self.model(ids, pos, frame=frame, embeds=embeds, logits_at=(rows, cols))
            return logits, frame.fresh
        r, t = ids.shape
        logits = None
        kv: list[tuple[Tensor, Tensor]] = []
        for g in groups:
            t_g = int(ok[g].sum(-1).max())
            local = torch.full((r,), -1, dtype=torch.long, device=ids.device)
            local[g] = torch.arange(g.numel(), device=ids.device)
            mine = local[rows] >= 0  # the scored positions of this group's rows
            frame = Frame(key_mask=ok[g, :t_g], past=None if past is None else past.rows(g),
                          past_mask=None if past is None else past_mask[g])
            out = self.model(ids[g, :t_g], pos[g, :t_g], frame=frame,
                             embeds=None if embeds is None else embeds[g, :t_g],
                             logits_at=(local[rows[mine]], cols[mine]))
            if logits is None:
                logits = out.new_empty(rows.numel(), out.shape[-1])
                kv = [(k.new_zeros(r, k.shape[1], t, k.shape[3]),
                       v.new_zeros(r, v.shape[1], t, v.shape[3])) for k, v in frame.fresh]
            logits[mine] = out
            for (k_all, v_all), (k, v) in zip(kv, frame.fresh, strict=True):
                k_all[g, :, :t_g], v_all[g, :, :t_g] = k, v
        return logits, kv

    @staticmethod
    def _split(n_tokens: Tensor) -> list[Tensor] | None:
        """Row groups for separate calls (None: one call). Two groups, long rows (more than half
        the longest) and short ones, when that forwards under 60% of the padded tokens of one
        call; only with 4+ rows, where the saving outweighs a second call's fixed cost."""
        r = n_tokens.shape[0]
        if r < 4:
            return None
        longest = n_tokens.max()
        long_rows = n_tokens * 2 > longest
        n_long = int(long_rows.sum())
        if n_long == r:
            return None
        short_max = n_tokens[~long_rows].max()
        split_cost = n_long * longest + (r - n_long) * short_max
        if bool(split_cost >= 0.6 * r * longest):
            return None
        return [long_rows.nonzero(as_tuple=True)[0], (~long_rows).nonzero(as_tuple=True)[0]]
