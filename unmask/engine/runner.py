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


def _compact(flags: Tensor) -> tuple[Tensor, Tensor]:
    """(R, S) bool -> the flagged slots of each row, in slot order, padded to the longest row's
    count N: (R, N) slot indices and (R, N) bool (False: padding)."""
    n = int(flags.sum(-1).max())
    # Flagged slots first, in slot order: a stable sort of the "not flagged" flag.
    idx = torch.sort((~flags).to(torch.int8), dim=-1, stable=True).indices[:, :n]
    return idx, flags.gather(1, idx)


@dataclass
class StoreRead:
    """The K/V store as the R rows of one call see it."""

    store: KVStore
    rows: Tensor  # (R,) each call row's store row
    pad: Tensor  # (R,) each call row's left padding: slot pad + p holds position p
    valid: Tensor  # (R, S) bool slots whose K/V the store holds


@dataclass
class Past:
    """What a call reads from the store: store row `rows[i]` at positions `pos[i]` (R, K) for
    each of its rows; mask (R, K) False where a row has fewer positions than K."""

    store: KVStore
    rows: Tensor
    pos: Tensor
    mask: Tensor

    def take(self, index: Tensor) -> Past:
        """The rows `index`, their slots trimmed to their own longest count."""
        mask = self.mask[index]
        k = int(mask.sum(-1).max())
        return Past(self.store, self.rows[index], self.pos[index, :k], mask[:, :k])

    def frame(self, key_mask: Tensor, packed: bool) -> Frame:
        return Frame(key_mask=key_mask, past=self.store.gather(self.rows, self.pos),
                     past_mask=self.mask, packed=packed)


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
    # Calls whose padding is at least this share of their padded tokens go packed. Packing
    # copies q/k/v in and out of rows in every layer, which costs more than little padding
    # saves (BENCHMARKS.md, "Engine batching"; scripts/engine_padding.py sets 1.0: never).
    pack_min_padding = 0.1

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
                refresh: Tensor, store: StoreRead | None, prev_token: Tensor,
                noise: Tensor | None, block_start: Tensor) -> Forwarded:
        """Forward rows x (R, S).

        visible: slots that exist in this step (R, S); active: slots recomputed (a subset);
        the rest of `visible` is read from `store` (None: no cache, or nothing stored).
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
        idx, ok = _compact(active)  # (R, T) the slots to forward, padded
        ids = x.gather(1, idx)
        pos = idx - pad[:, None]
        block_end = block_start + self.params.block_length
        embeds = self.suffix.embeds(self.model, ids, idx, ok, prev_token, block_end)
        past = self._past(visible & ~active, store)
        target = idx + self.shift  # slot each output predicts
        want = ok & (target < s)
        want &= predict.gather(1, target.clamp_max(s - 1))
        rows, cols = want.nonzero(as_tuple=True)
        tslots = target[rows, cols]
        logits, kv = self._call(ids, pos, ok, embeds, past, rows, cols)

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

    @staticmethod
    def _past(cached: Tensor, read: StoreRead | None) -> Past | None:
        """The stored positions each row attends to besides its forwarded tokens: its visible
        slots not recomputed that hold K/V, in slot order, padded to the longest row's count K.
        Attention then costs what a row sees, not the canvas width."""
        if read is None:
            return None
        slots, mask = _compact(cached & read.valid)  # (R, K)
        if slots.shape[1] == 0:
            return None
        # Padding entries (mask False) may point anywhere: clamp them into the store.
        pos = (slots - read.pad[:, None]).clamp(0, read.store.shape[1] - 1)
        return Past(read.store, read.rows, pos, mask)

    def _call(self, ids: Tensor, pos: Tensor, ok: Tensor, embeds: Tensor | None,
              past: Past | None, rows: Tensor,
              cols: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The model call(s): logits (N, V) at (rows, cols) and each layer's fresh (k, v)
        (R, H_kv, T, D). Only the scored positions get the LM head (~10% of a forward on the
        embedded model).

        Attention pads rows to the longest row's T (and K). When a few rows forward far more
        tokens than the rest (a cache refresh next to cached steps), that padding would cost
        more than a second call: then the short rows get a call of their own."""
        groups = self._split(ok.sum(-1))
        if groups is None:
            return self._model(ids, pos, ok, embeds, past, rows, cols)
        r, t = ids.shape
        logits = None
        kv: list[tuple[Tensor, Tensor]] = []
        for g in groups:
            t_g = int(ok[g].sum(-1).max())
            local = torch.full((r,), -1, dtype=torch.long, device=ids.device)
            local[g] = torch.arange(g.numel(), device=ids.device)
            mine = local[rows] >= 0  # the scored positions of this group's rows
            out, fresh = self._model(
                ids[g, :t_g], pos[g, :t_g], ok[g, :t_g], None if embeds is None else embeds[g, :t_g],
                None if past is None else past.take(g),
                local[rows[mine]], cols[mine])
            if logits is None:
                logits = out.new_empty(rows.numel(), out.shape[-1])
                kv = [(k.new_zeros(r, k.shape[1], t, k.shape[3]),
                       v.new_zeros(r, v.shape[1], t, v.shape[3])) for k, v in fresh]
            logits[mine] = out
            for (k_all, v_all), (k, v) in zip(kv, fresh, strict=True):
                k_all[g, :, :t_g], v_all[g, :, :t_g] = k, v
        return logits, kv

    def _model(self, ids: Tensor, pos: Tensor, ok: Tensor, embeds: Tensor | None,
               past: Past | None, rows: Tensor,
               cols: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One model call; rows with padding go packed (the model's projections and MLPs, most
        of a forward, then skip the padded tokens)."""
        r, t = ids.shape
        padding = r * t - int(ok.sum())
        packed = padding > 0 and padding >= self.pack_min_padding * r * t
        frame = Frame(key_mask=ok, packed=packed) if past is None else past.frame(ok, packed)
        if packed:
            at = (ok.flatten().cumsum(0) - 1).view(r, t)  # (R, T) packed index of each token
            logits = self.model(ids[ok][None], pos[ok][None], frame=frame,
                                embeds=None if embeds is None else embeds[ok][None],
                                logits_at=(torch.zeros_like(rows), at[rows, cols]))
        else:
            logits = self.model(ids, pos, frame=frame, embeds=embeds, logits_at=(rows, cols))
        return logits, frame.fresh

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
