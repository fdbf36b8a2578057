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
from unmask.kv import Frame, KVStore, RowGroup
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

    def frame(self, key_mask: Tensor) -> Frame:
        """An unpacked frame of these rows (key_mask: their (R, T) forwarded tokens), or of no
        stored keys when none of them reads any."""
        if self.pos.shape[1] == 0:
            return Frame(key_mask=key_mask)
        past_mask = torch.from_numpy(self.mask).to(key_mask.device)
        return Frame(key_mask=key_mask, past=self.store.gather(self.rows, self.pos),
                     past_mask=past_mask)


@dataclass
class Forwarded:
    """Result of one forward of R rows, scattered back to canvas slots (host arrays, but for
    the K/V, which stays on the model's device until the store takes it)."""

    token: np.ndarray  # (R, S) int64  predicted token per slot (valid where `fresh`)
    conf: np.ndarray  # (R, S) float32 confidence
    entropy: np.ndarray  # (R, S) float32 entropy of the predictive distribution
    fresh: np.ndarray  # (R, S) bool  slots scored by this forward
    kv: list[tuple[Tensor, Tensor]]  # per layer K/V of the forwarded tokens (`Frame.fresh`)
    kv_at: np.ndarray | None  # (R, T) each token's index in packed kv (None: kv is (R, H_kv, T, D))
    idx: np.ndarray  # (R, T) slot of each forwarded token
    ids: np.ndarray  # (R, T) the forwarded tokens
    ok: np.ndarray  # (R, T) bool, False for batch padding
    refresh: np.ndarray  # (R,) bool, the row was a full forward
    visible: np.ndarray  # (R, S) bool, slots that took part (forwarded or read from the store)

    @property
    def n_tokens(self) -> np.ndarray:  # (R,) token-forwards per row
        return self.ok.sum(-1)


class Runner:
    # Calls whose padding is at least this share of their padded tokens go packed, as do calls
    # whose attention runs in several row groups. Packing gathers q/k/v into rows in every
    # layer, which costs more than little padding saves (BENCHMARKS.md, "Engine batching";
    # scripts/engine_padding.py sets 2.0: never for padding alone).
    pack_min_padding = 0.1
    # Attention splits a call's rows into one more group when that saves more than this many
    # (query, key) pairs: what another group's gathers and kernel calls cost. Measured on one
    # CPU thread (`attention_groups`; BENCHMARKS.md, "Engine batching"): 5,400-12,100 pairs for
    # the embedded model, 3,500-5,100 for random 4-layer models of d_model 512 and 1024, so a
    # count of pairs carries over between widths; the cuts that matter (a refresh beside cached
    # steps) save ~10^5. A GPU pays relatively more per kernel: `scripts/engine_padding.py
    # --model DIR --device D --group-cost-only` measures it there. inf: one group.
    group_cost = 4096.0

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
        logits, kv, kv_at = self._call(ids_t, self._to_device(idx - pad[:, None]), ok, embeds, past,
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
        return Forwarded(token, conf, ent, fresh, kv, kv_at, idx, ids, ok, refresh, visible)

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
              cols: np.ndarray) -> tuple[Tensor, list[tuple[Tensor, Tensor]], np.ndarray | None]:
        """The model call: logits (N, V) at (rows, cols), each layer's fresh (k, v) (`Frame.fresh`)
        and, packed, each token's index among the packed ones ((R, T); None: unpacked). Only the
        scored positions get the LM head (~10% of a forward on the embedded model).

        Rows with padding go packed: the model's projections and MLPs, most of a forward, then
        skip the padded tokens, and attention runs per group of rows of similar shape
        (`attention_groups`), each padded to its own longest row and stored context."""
        r, t = ids.shape
        n_tokens = ok.sum(-1)
        n_past = past.mask.sum(-1) if past is not None else np.zeros(r, dtype=np.int64)
        groups = attention_groups(n_tokens, n_past, self.group_cost)
        padding = r * t - int(n_tokens.sum())
        ok_t = self._to_device(ok)
        if len(groups) == 1 and (padding == 0 or padding < self.pack_min_padding * r * t):
            frame = Frame(key_mask=ok_t) if past is None else past.frame(ok_t)
            logits = self.model(ids, pos, frame=frame, embeds=embeds,
                                logits_at=(self._to_device(rows), self._to_device(cols)))
            return logits, frame.fresh, None
        at = (np.cumsum(ok.reshape(-1)) - 1).reshape(r, t)  # (R, T) packed index of each token
        frame = Frame(key_mask=ok_t, packed=True,
                      groups=[self._group(g, len(groups) == 1, at, ok, n_tokens, ok_t, past)
                              for g in groups])
        logits = self.model(ids[ok_t][None], pos[ok_t][None], frame=frame,
                            embeds=None if embeds is None else embeds[ok_t][None],
                            logits_at=(torch.zeros(rows.size, dtype=torch.long, device=self.device),
                                       self._to_device(at[rows, cols])))
        return logits, frame.fresh, at

    def _group(self, g: np.ndarray, whole: bool, at: np.ndarray, ok: np.ndarray,
               n_tokens: np.ndarray, ok_t: Tensor, past: Past | None) -> RowGroup:
        """Rows g of a packed call as one attention batch (whole: g is every row, in order)."""
        t_g = int(n_tokens[g].max())
        ok_g = ok[g, :t_g]  # real tokens come first in each row (`_compact`)
        grid = np.where(ok_g, at[g, :t_g], 0).reshape(-1)
        real = ok_g.reshape(-1)
        key_mask = ok_t[:, :t_g] if whole else ok_t[self._to_device(g), :t_g]
        # the whole call's stored keys are already trimmed to its longest row
        sub = past if past is None or whole else past.take(g)
        return RowGroup(
            grid=self._to_device(grid), shape=(g.size, t_g),
            real=None if real.all() else self._to_device(np.flatnonzero(real)),
            out_at=None if whole else self._to_device(grid[real]),
            frame=Frame(key_mask=key_mask) if sub is None else sub.frame(key_mask))


def attention_groups(n_tokens: np.ndarray, n_past: np.ndarray, group_cost: float) -> list[np.ndarray]:
    """Rows of one call in groups that attend as separate padded batches (at most 4).

    A padded batch costs rows x T x (T + K) (query, key) pairs for its longest row's T tokens
    and K stored keys; a refresh row (many tokens, no stored keys) beside cached rows (few
    tokens, many stored keys) pads every row to both. Rows sorted by token count are cut
    greedily where a cut saves the most pairs, while it saves more than `group_cost` (the fixed
    cost of another group: its gathers and kernel calls, in pairs). One group: every row, in
    order."""
    r = n_tokens.shape[0]
    whole = [np.arange(r)]
    if r < 2:
        return whole
    one = _pairs(n_tokens, n_past)
    # No grouping computes fewer pairs than the rows need: if all the padding is worth less
    # than a group, no cut pays.
    if one - int((n_tokens * (n_tokens + n_past)).sum()) <= group_cost:
        return whole
    order = np.argsort(n_tokens, kind="stable")
    # Each group with its best cut, found once per group: (pairs saved, j, left, right).
    groups, cuts = [order], [_best_cut(n_tokens[order], n_past[order], one)]
    while len(groups) < 4:
        i = 0
        for n, cut in enumerate(cuts):  # the first of the largest savings
            if cut[0] > cuts[i][0]:
                i = n
        saving, j, left, right = cuts[i]
        if saving <= group_cost:
            break
        g = groups[i]
        groups[i:i + 1] = [g[:j], g[j:]]
        cuts[i:i + 1] = [_best_cut(n_tokens[g[:j]], n_past[g[:j]], left),
                         _best_cut(n_tokens[g[j:]], n_past[g[j:]], right)]
    return whole if len(groups) == 1 else groups


def _pairs(t: np.ndarray, k: np.ndarray) -> int:
    """(query, key) pairs of rows with t tokens and k stored keys as one padded batch."""
    return int(t.size * t.max() * (t.max() + k.max()))


def _best_cut(t: np.ndarray, k: np.ndarray, cost: int) -> tuple[int, int, int, int]:
    """The cut j of rows (t, k), `cost` pairs as one batch, into [:j] and [j:] with the fewest
    pairs: (pairs saved, j, pairs of [:j], pairs of [j:]); nothing saved for a single row."""
    n = t.size
    if n < 2:
        return 0, 0, cost, 0
    lt, lk = np.maximum.accumulate(t), np.maximum.accumulate(k)  # longest of rows [:j+1]
    rt, rk = np.maximum.accumulate(t[::-1])[::-1], np.maximum.accumulate(k[::-1])[::-1]
    j = np.arange(1, n)
    left = j * lt[:-1] * (lt[:-1] + lk[:-1])
    right = (n - j) * rt[1:] * (rt[1:] + rk[1:])
    i = int((left + right).argmin())
    return cost - int(left[i] + right[i]), i + 1, int(left[i]), int(right[i])
