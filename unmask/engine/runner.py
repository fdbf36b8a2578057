"""One model call over a set of canvas rows: gather the slots to recompute, attend to stored K/V
for the other visible slots, and score the positions the decoder needs.

This is the only place that turns a canvas into model inputs, so every decoder, cache policy and
suffix policy shares it. It is also where the host meets the device: the rows come in as host
arrays (unmask.engine.batch), the model's inputs go to its device in one copy each, and the
scores come back in one copy each (three per call: token, confidence, entropy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from unmask.decoding.params import DecodeParams
from unmask.decoding.rules import score
from unmask.kv import Frame, KVStore
from unmask.suffix import SuffixPolicy


def _compact(flags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, S) bool -> the flagged slots of each row, in slot order, padded to the longest row's
    count N: (R, N) slot indices and (R, N) bool (False: padding)."""
    n = int(flags.sum(-1).max()) if flags.size else 0
    # Flagged slots first, in slot order: a stable sort of the "not flagged" flag.
    idx = np.argsort(~flags, axis=-1, kind="stable")[:, :n]
    return idx, flags[np.arange(flags.shape[0])[:, None], idx]


@dataclass
class StoreRead:
    """The K/V store as the R rows of one call see it."""

    store: KVStore
    rows: np.ndarray  # (R,) each call row's store row
    pad: np.ndarray  # (R,) each call row's left padding: slot pad + p holds position p
    valid: np.ndarray  # (R, S) bool slots whose K/V the store holds


@dataclass
class Past:
    """What a call reads from the store: store row `rows[i]` at positions `pos[i]` (R, K) for
    each of its rows; mask (R, K) False where a row has fewer positions than K."""

    store: KVStore
    rows: np.ndarray
    pos: np.ndarray
    mask: np.ndarray

    def take(self, index: np.ndarray) -> Past:
        """The rows `index`, their slots trimmed to their own longest count."""
        mask = self.mask[index]
        k = int(mask.sum(-1).max())
        return Past(self.store, self.rows[index], self.pos[index, :k], mask[:, :k])

    def frame(self, key_mask: Tensor, packed: bool) -> Frame:
        past_mask = torch.from_numpy(self.mask).to(key_mask.device)
        return Frame(key_mask=key_mask, past=self.store.gather(self.rows, self.pos),
                     past_mask=past_mask, packed=packed)


@dataclass
class Forwarded:
    """Result of one forward of R rows, scattered back to canvas slots (host arrays, but for
    the K/V, which stays on the model's device until the store takes it)."""

    token: np.ndarray  # (R, S) int64  predicted token per slot (valid where `fresh`)
    conf: np.ndarray  # (R, S) float32 confidence
    entropy: np.ndarray  # (R, S) float32 entropy of the predictive distribution
    fresh: np.ndarray  # (R, S) bool  slots scored by this forward
    kv: list[tuple[Tensor, Tensor]]  # per layer (R, H_kv, T, D) K/V of the forwarded tokens
    idx: np.ndarray  # (R, T) slot of each forwarded token
    ids: np.ndarray  # (R, T) the forwarded tokens
    ok: np.ndarray  # (R, T) bool, False for batch padding
    refresh: np.ndarray  # (R,) bool, the row was a full forward
    visible: np.ndarray  # (R, S) bool, slots that took part (forwarded or read from the store)

    @property
    def n_tokens(self) -> np.ndarray:  # (R,) token-forwards per row
        return self.ok.sum(-1)


class Runner:
    # Calls whose padding is at least this share of their padded tokens go packed. Packing
    # copies q/k/v in and out of rows in every layer, which costs more than little padding
    # saves (BENCHMARKS.md, "Engine batching"; scripts/engine_padding.py sets 1.0: never).
    pack_min_padding = 0.1

    def __init__(self, model: nn.Module, params: DecodeParams, mask_id: int, eos_id: int,
                 suffix: SuffixPolicy) -> None:
        self.model, self.params, self.suffix = model, params, suffix
        self.device = next(model.parameters()).device
        # Entropies feed EntropyCache's refresh decision (and entropy remasking) only.
        self.with_entropy = params.cache == "entropy" or params.remasking == "entropy"
        self.mask_id, self.eos_id = mask_id, eos_id
        vocab = model.config.vocab_size
        self.suppress = torch.tensor([t for t in [mask_id] + ([eos_id] if params.suppress_eos else [])
                                      if t < vocab], dtype=torch.long, device=self.device)
        self.shift = int(getattr(model, "logit_shift", 0))

    def _to_device(self, a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).to(self.device)

    def forward(self, x: np.ndarray, pad: np.ndarray, visible: np.ndarray, active: np.ndarray,
                predict: np.ndarray, refresh: np.ndarray, store: StoreRead | None,
                prev_token: np.ndarray, noise: Tensor | None, block_start: np.ndarray) -> Forwarded:
        """Forward rows x (R, S).

        visible: slots that exist in this step (R, S); active: slots recomputed (a subset);
        the rest of `visible` is read from `store` (None: no cache, or nothing stored).
        predict: slots whose prediction is needed. noise: (R, block_length, V + 1) uniforms on
        the model's device, or None.
        """
        r, s = x.shape
        if self.shift:
            # Dream reads slot i's prediction from token i-1: that token must be recomputed too.
            # The slot before the block always is, so its stored K/V never depends on the path
            # (which steps happened to need it), keeping cached decoding path-independent.
            src = np.zeros_like(predict)
            src[:, :-1] = predict[:, 1:]
            src[np.arange(r), np.maximum(block_start - 1, 0)] = True
            active = active | (src & visible)
        idx, ok = _compact(active)  # (R, T) the slots to forward, padded
        rows_of = np.arange(r)[:, None]
        ids = x[rows_of, idx]
        past = self._past(visible & ~active, store)
        target = idx + self.shift  # slot each output predicts
        want = ok & (target < s) & predict[rows_of, np.minimum(target, s - 1)]
        rows, cols = np.nonzero(want)
        tslots = target[rows, cols]
        ids_t = self._to_device(ids)
        embeds = self.suffix.embeds(self.model, ids, idx, ok, prev_token,
                                    block_start + self.params.block_length, ids_t)
        logits, kv = self._call(ids_t, self._to_device(idx - pad[:, None]), ok, embeds, past,
                                rows, cols)
        u = None
        if noise is not None:
            offset = np.clip(tslots - block_start[rows], 0, noise.shape[1] - 1)
            u = noise[self._to_device(rows), self._to_device(offset)]
        pr = self.params
        sc = score(logits, pr.remasking, pr.temperature, u, self.suppress, pr.top_p, pr.top_k,
                   pr.alg_temp, with_entropy=self.with_entropy)
        token = np.full((r, s), self.mask_id, dtype=np.int64)
        conf = np.full((r, s), -np.inf, dtype=np.float32)
        ent = np.zeros((r, s), dtype=np.float32)
        fresh = np.zeros((r, s), dtype=bool)
        token[rows, tslots] = sc.token.cpu().numpy()
        conf[rows, tslots] = sc.conf.cpu().numpy()
        ent[rows, tslots] = sc.entropy.cpu().numpy()
        fresh[rows, tslots] = True
        return Forwarded(token, conf, ent, fresh, kv, idx, ids, ok, refresh, visible)

    @staticmethod
    def _past(cached: np.ndarray, read: StoreRead | None) -> Past | None:
        """The stored positions each row attends to besides its forwarded tokens: its visible
        slots not recomputed that hold K/V, in slot order, padded to the longest row's count K.
        Attention then costs what a row sees, not the canvas width."""
        if read is None:
            return None
        slots, mask = _compact(cached & read.valid)  # (R, K)
        if slots.shape[1] == 0:
            return None
        # Padding entries (mask False) may point anywhere: clip them into the store.
        pos = np.clip(slots - read.pad[:, None], 0, read.store.shape[1] - 1)
        return Past(read.store, read.rows, pos, mask)

    def _call(self, ids: Tensor, pos: Tensor, ok: np.ndarray, embeds: Tensor | None,
              past: Past | None, rows: np.ndarray,
              cols: np.ndarray) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The model call(s): logits (N, V) at (rows, cols) and each layer's fresh (k, v)
        (R, H_kv, T, D). Only the scored positions get the LM head (~10% of a forward on the
        embedded model).

        Attention pads rows to the longest row's T (and K). When a few rows forward far more
        tokens than the rest (a cache refresh next to cached steps), that padding would cost
        more than a second call: then the short rows get a call of their own."""
        n_tokens = ok.sum(-1)
        groups = self._split(n_tokens)
        if groups is None:
            return self._model(ids, pos, ok, embeds, past, rows, cols)
        r, t = ids.shape
        logits = None
        kv: list[tuple[Tensor, Tensor]] = []
        for g in groups:
            t_g = int(n_tokens[g].max())
            local = np.full(r, -1, dtype=np.int64)
            local[g] = np.arange(g.size)
            mine = local[rows] >= 0  # the scored positions of this group's rows
            g_t = self._to_device(g)
            out, fresh = self._model(
                ids[g_t, :t_g], pos[g_t, :t_g], ok[g, :t_g],
                None if embeds is None else embeds[g_t, :t_g],
                None if past is None else past.take(g), local[rows[mine]], cols[mine])
            if logits is None:
                logits = out.new_empty(rows.size, out.shape[-1])
                kv = [(k.new_zeros(r, k.shape[1], t, k.shape[3]),
                       v.new_zeros(r, v.shape[1], t, v.shape[3])) for k, v in fresh]
            logits[self._to_device(mine)] = out
            for (k_all, v_all), (k, v) in zip(kv, fresh, strict=True):
                k_all[g_t, :, :t_g], v_all[g_t, :, :t_g] = k, v
        return logits, kv

    def _model(self, ids: Tensor, pos: Tensor, ok: np.ndarray, embeds: Tensor | None,
               past: Past | None, rows: np.ndarray,
               cols: np.ndarray) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One model call; rows with padding go packed (the model's projections and MLPs, most
        of a forward, then skip the padded tokens)."""
        r, t = ids.shape
        padding = r * t - int(ok.sum())
        packed = padding > 0 and padding >= self.pack_min_padding * r * t
        ok_t = self._to_device(ok)
        frame = Frame(key_mask=ok_t, packed=packed) if past is None else past.frame(ok_t, packed)
        if packed:
            at = (np.cumsum(ok.reshape(-1)) - 1).reshape(r, t)  # (R, T) packed index of each token
            logits = self.model(ids[ok_t][None], pos[ok_t][None], frame=frame,
                                embeds=None if embeds is None else embeds[ok_t][None],
                                logits_at=(torch.zeros(rows.size, dtype=torch.long, device=self.device),
                                           self._to_device(at[rows, cols])))
        else:
            logits = self.model(ids, pos, frame=frame, embeds=embeds,
                                logits_at=(self._to_device(rows), self._to_device(cols)))
        return logits, frame.fresh

    @staticmethod
    def _split(n_tokens: np.ndarray) -> list[np.ndarray] | None:
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
        if split_cost >= 0.6 * r * longest:
            return None
        return [np.nonzero(long_rows)[0], np.nonzero(~long_rows)[0]]
