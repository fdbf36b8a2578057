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
        frame = Frame(key_mask=ok)
        cached = visible & ~active
        if store is not None and bool(cached.any()):
            frame.past, frame.past_mask = store, cached & store.valid
        target = idx + self.shift  # slot each output predicts
        want = ok & (target < s)
        want &= predict.gather(1, target.clamp_max(s - 1))
        rows, cols = want.nonzero(as_tuple=True)
        tslots = target[rows, cols]
        # Only the scored positions get the LM head (~10% of a forward on the embedded model).
        logits = self.model(ids, pos, frame=frame, embeds=embeds, logits_at=(rows, cols))  # (N, V)

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
        return Forwarded(token, conf, ent, fresh, frame.fresh, idx, ids, ok, refresh, visible)
