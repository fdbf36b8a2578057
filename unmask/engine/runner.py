"""One model call over a set of canvas rows: gather the slots to recompute, attend to stored K/V
for the other visible slots, and score the positions the decoder needs.

This is the only place that turns a canvas into model inputs, so every decoder, cache policy and
suffix policy shares it. It is also where the host meets the device: the rows come in as host
arrays (unmask.engine.batch), the model's inputs go to its device in one copy each, and the
scores stay there (`Scores`) until the decoder's commit reads them in one copy
(unmask.engine.commit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from unmask.decoding.grammar import TokenMasks
from unmask.decoding.knobs import entry
from unmask.decoding.params import DecodeParams
from unmask.decoding.scoring import score
from unmask.engine.batch import Scores
from unmask.engine.buckets import Buckets, CallRows
from unmask.engine.graphs import CudaGraphs, capturer
from unmask.engine.product_rows import ProductRows, product_rows
from unmask.kv import Frame, InPlace, KVStore, Past, RowGroup, Span, shared_context
from unmask.suffix import SuffixPolicy

# A row's shape in a model call depends on the row alone, whoever shares the call, because the
# CPU kernels round a row's results differently with the shapes around it (BENCHMARKS.md,
# "Engine batching"): flash attention with the padding of its keys and queries, matrix products
# with how many rows they get. So each row's attention runs at a shape of its own among rows of
# that shape only (`shape_groups`), and every matrix product gets at least the rows its kind
# needs (unmask/engine/product_rows.py: 16 in float32; fewer where a kernel was measured). The
# shape (`ATTENTION_SHAPES`) is the row's exact one where a decode has a forward to match: no
# padding key, so a row's attention is the plain forward's (or an exact cache's), bit for bit.
# A cache that reads stale K/V (`Facts.stale_keys`) has no such forward, and there "canonical"
# pads rows to `canonical_tokens` and `canonical_keys`: fewer shapes a call, faster at high
# concurrency (docs/engine.md, "Batch invariance").
TOKEN_STEP = 16  # canonical: forwarded tokens are padded to a multiple of this
KEY_STEP = 16  # canonical: stored keys up to KEY_STEP * 4 to a multiple of this, then to 2^j
# or 1.5 * 2^j
# Block-by-block attention (`Runner._spans`): a row's finished blocks attend in one call per
# chunk of at least this many positions (whole blocks), each over the keys up to its chunk's end.
SPAN_CHUNK = 64
# Attention in place over their store rows (`Runner.attend_in_place`) for calls where at least
# this many rows qualify: in CPU time against the gathered call, rows of ~100 / ~600 keys,
# static-1 (BENCHMARKS.md, "Attention in place"): 1 row 0.94x / 0.97x, 2-4 rows 0.99-1.02x, 8
# rows 1.07x / 1.03x, 16 rows 1.07x / 1.05x (rows read apart, as the store keeps them, where a
# gathered copy is read in one run). Rows sharing the context buffer attend in place in a call
# of any size (two or more share it): at 4 rows of a shared ~540-token prompt, steps 1.23-1.34x.
IN_PLACE_MIN_ROWS = 8


def exact(n: np.ndarray) -> np.ndarray:
    """(R,) each row's own count n (R,): its attention runs over exactly its tokens and keys."""
    return n


def canonical_tokens(n: np.ndarray) -> np.ndarray:
    """(R,) the query count each row's attention runs at: n (R,) forwarded tokens rounded up to
    a multiple of TOKEN_STEP (at least one step)."""
    return np.maximum(-(-n // TOKEN_STEP), 1) * TOKEN_STEP


def canonical_keys(n: np.ndarray) -> np.ndarray:
    """(R,) the stored-key count each row's attention runs at, for n (R,) stored keys: 0 for
    none; a multiple of KEY_STEP up to 4 steps; above, the next of 2^j and 1.5 * 2^j, so rows of
    similar contexts share a shape (its padding at most half the row's own count)."""
    small = -(-n // KEY_STEP) * KEY_STEP
    power = np.left_shift(1, np.frexp(np.maximum(n - 1, 1))[1]).astype(n.dtype)  # 2^j >= n
    large = np.where(power * 3 // 4 >= n, power * 3 // 4, power)
    return np.where(n <= 4 * KEY_STEP, small, large)


# Runner.attention_shapes -> (the forwarded tokens' shape, the stored keys' shape)
ATTENTION_SHAPES: dict[str, tuple[Callable[[np.ndarray], np.ndarray], ...]] = {
    "exact": (exact, exact),
    "canonical": (canonical_tokens, canonical_keys),
}


class Placed(NamedTuple):
    """A call's rows that attend in place (`Runner._in_place`): which (R,) bool; order (M,) those
    rows in the order they attend; starts (M,) their places (`InPlace.starts`); one_block (M,)
    whether a row forwards one block alone (else finished blocks too: it attends by chunk)."""

    which: np.ndarray
    order: np.ndarray
    starts: np.ndarray
    one_block: np.ndarray


def shape_groups(t_hat: np.ndarray, k_hat: np.ndarray) -> list[np.ndarray]:
    """Rows of one call grouped by attention shape (t_hat, k_hat: (R,) each), each group in row
    order; one group: every row, in order."""
    r = t_hat.shape[0]
    key = t_hat * (int(k_hat.max(initial=0)) + 1) + k_hat
    if r < 2 or (key == key[0]).all():
        return [np.arange(r)]
    _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")
    return np.split(order, np.cumsum(counts)[:-1])


def _compact(flags: np.ndarray, shape_of: Callable[[np.ndarray], np.ndarray],
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(R, S) bool -> the flagged slots of each row, in slot order, padded to the widest row's
    attention count W (`shape_of` its count): (R, W) slot indices (slot 0 past the canvas),
    (R, W) bool (False: padding), and (R,) each row's count and attention count."""
    n = flags.sum(-1)
    shape = shape_of(n)
    w = int(shape.max()) if n.size else 0
    # Flagged slots first, in slot order: a stable sort of the "not flagged" flag.
    idx = np.argsort(~flags, axis=-1, kind="stable")[:, :w]
    if idx.shape[1] < w:
        # not np.pad (nor np.clip below): their Python wrappers cost 20-100 us a call, a few
        # percent of a step's host time (BENCHMARKS.md, "Host overhead")
        idx = np.concatenate([idx, np.zeros((idx.shape[0], w - idx.shape[1]), idx.dtype)], 1)
    return idx, np.arange(w)[None, :] < n[:, None], n, shape


@dataclass
class StoreRead:
    """The K/V store as the R rows of one call see it."""

    store: KVStore
    rows: np.ndarray  # (R,) each call row's store row
    pad: np.ndarray  # (R,) each call row's left padding: slot pad + p holds position p
    valid: np.ndarray  # (R, S) bool slots whose K/V the store holds


@dataclass
class ForwardPlan:
    """What one model call does for R canvas rows, built by the decoder (host arrays)."""

    x: np.ndarray  # (R, S) canvases
    pad: np.ndarray  # (R,) left padding: slot pad + p holds position p
    visible: np.ndarray  # (R, S) bool slots that exist in this step
    active: np.ndarray  # (R, S) bool slots recomputed (a subset of visible); the rest of
    # `visible` is read from `store`
    predict: np.ndarray  # (R, S) bool slots whose prediction is needed
    refresh: np.ndarray  # (R,) bool the row is a full forward
    store: StoreRead | None  # None: no cache, or nothing stored
    prev_token: np.ndarray  # (R, S) the last step's predictions (suffix injection)
    noise: Tensor | None  # (R, block_length, V + 1) uniforms on the model's device, or None
    block_start: np.ndarray  # (R,) first slot of each row's current block
    knobs: np.ndarray  # (R,) the rows' per-row knobs (unmask.decoding.params.ROW_DTYPE)
    masks: TokenMasks | None = None  # structured output: the tokens each scored slot may take


@dataclass
class Forwarded:
    """Result of one forward of R rows, scattered back to canvas slots (host arrays, but for
    the K/V, which stays on the model's device until the store takes it, and `scores`, which
    fill token, conf and entropy once the decoder's commit reads them: unmask.engine.commit)."""

    token: np.ndarray  # (R, S) int64  predicted token per slot (valid where `fresh`, once read)
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
    n_tokens: np.ndarray  # (R,) token-forwards per row (ok's count)
    scores: Scores  # on the device, at the forward's rows


class Runner:
    # Calls whose padding packing would save is at least this share of their padded tokens go
    # packed, as do calls whose rows attend in several shape groups. Packing gathers q/k/v into
    # rows in every layer, which costs more than little padding saves (BENCHMARKS.md, "Engine
    # batching").
    pack_min_padding = 0.1
    # The shape each row's attention runs at (`ATTENTION_SHAPES`): "exact" (its own tokens and
    # keys, the plain forward's bits) or "canonical" (padded; docs/engine.md, "Batch invariance").
    # None: by the cache policy, canonical for one that reads stale K/V, exact otherwise.
    attention_shapes: str | None = None
    # Calls cut into shape buckets run from persistent buffers (unmask/engine/buckets.py: the
    # forward a CUDA graph can hold, for every family: a bidirectional canvas's padding keys
    # are masked out), by this rule of `BUCKET_RULES`; None: the calls as they come. The
    # buckets do not attend block by block (below) yet: with them a finished block's K/V bits
    # may depend on the call that computed it, so prefix reuse is exact in tokens there, not
    # in bits (docs/engine.md, "Shape buckets").
    bucket_rule: str | None = None
    # The exact block cache's rows attend by span (kv.Frame.spans, `_spans`: the current block
    # alone, finished blocks by chunk): a finished block's K/V is then the same bits whichever
    # call computed it (docs/engine.md, "Prefix reuse").
    block_by_block: bool = True
    # Calls of fewer places than their products' fewest rows (`self.rows.blocks`) that attend
    # block by block run as rows widened to that many places (`_widened`: the packed call's
    # bits without its gathers); False: packed.
    widen_small_calls: bool = True
    # Rows attending block by block whose call forwards their current block alone (a decode
    # step) attend over their store row where it lies (kv.InPlace: the same bits without
    # copying their context twice a layer). None: on a CPU only, where those copies bound a
    # step; on a GPU each row would be a kernel launch of its own (BENCHMARKS.md, "Attention in
    # place").
    attend_in_place: bool | None = None

    def __init__(self, model: nn.Module, params: DecodeParams, mask_id: int, eos_id: int,
                 suffix: SuffixPolicy, graphs: CudaGraphs | None = None) -> None:
        """graphs: set when calls replay CUDA graphs (the engine gives it only where
        `CudaGraphs.active`; None: never)."""
        self.model, self.params, self.suffix = model, params, suffix
        self.device = next(model.parameters()).device
        self._rows: tuple[int, ProductRows] | None = None  # (threads, rows): `rows`
        # Entropies are computed only for the policies that read them.
        self.with_entropy = any(entry(kind, getattr(params, kind)).facts.reads_entropy
                                for kind in ("cache", "remasking", "method"))
        stale = entry("cache", params.cache).facts.stale_keys
        self.shapes = self.attention_shapes or ("canonical" if stale else "exact")
        self.block_size: int | None = getattr(model.config, "block_size", None)
        self.captures = graphs is not None
        self.buckets = self._buckets(graphs)
        self.by_block = (self.block_by_block and self.buckets is None
                         and self.block_size is not None and self.shapes == "exact" and not stale)
        self.mask_id, self.eos_id = mask_id, eos_id
        vocab = model.config.vocab_size
        # EOS leaves the distribution (LLaDA's logits_eos_inf); the mask token is only never chosen
        self.drop = torch.tensor([eos_id] if params.suppress_eos and eos_id < vocab else [],
                                 dtype=torch.long, device=self.device)
        self.suppress = torch.cat([torch.tensor([mask_id] if mask_id < vocab else [],
                                                dtype=torch.long, device=self.device), self.drop])
        self.shift = int(getattr(model, "logit_shift", 0))
        self._buffer: Tensor | None = None  # `_context_buffer`

    def _buckets(self, graphs: CudaGraphs | None) -> Buckets | None:
        """The bucketed forward: captured in CUDA graphs where `graphs` is active
        (power-of-two buckets: few shapes, so few graphs), else by `bucket_rule`."""
        if self.captures:
            # A bidirectional row's bucket is the attention shape its eager call has (exact, or
            # canonical for a cache that reads stale keys: `self.shapes`), its rows a power of
            # two: its canvas's keys padded to a power of two change bfloat16 bits, and with
            # random weights' near ties the tokens (scripts/gpu_check.py --tiny), where the
            # eager shapes give eager's bits. A block-causal row forwards a block: pow2.
            shapes = None if self.block_size is not None else ATTENTION_SHAPES[self.shapes]
            return Buckets("pow2", self.device, self.rows.blocks, wrap=capturer(),
                           max_keys=graphs.max_keys, shapes=shapes)
        if self.bucket_rule is not None:
            return Buckets(self.bucket_rule, self.device, self.rows.blocks)
        return None

    @property
    def rows(self) -> ProductRows:
        """The fewest rows a call's matrix products get (unmask.engine.product_rows): read
        again whenever torch's thread count changed, since a float32 product's minimum follows
        it (bucketed calls keep the count their buckets were made with)."""
        threads = torch.get_num_threads()
        if self._rows is None or self._rows[0] != threads:
            self._rows = (threads, product_rows(self.model, threads))
        return self._rows[1]

    def _to_device(self, a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).to(self.device)

    def forward(self, plan: ForwardPlan) -> Forwarded:
        """Forward the plan's rows: recompute their active slots, attend to the stored K/V of
        the rest of their visible slots, score the slots they predict."""
        x, pad, visible, active, predict = (plan.x, plan.pad, plan.visible, plan.active,
                                            plan.predict)
        block_start, noise = plan.block_start, plan.noise
        r, s = x.shape
        if self.shift:
            # Dream reads slot i's prediction from token i-1: that token must be recomputed too.
            # The slot before the block always is, so its stored K/V never depends on the path
            # (which steps happened to need it), keeping cached decoding path-independent.
            src = np.zeros_like(predict)
            src[:, :-1] = predict[:, 1:]
            src[np.arange(r), np.maximum(block_start - 1, 0)] = True
            active = active | (src & visible)
        token_shape, key_shape = ATTENTION_SHAPES[self.shapes]
        # (R, T) the slots to forward, padded to the widest row's attention count
        idx, ok, n_tokens, t_hat = _compact(active, token_shape)
        rows_of = np.arange(r)[:, None]
        ids = x[rows_of, idx]
        past = self._past(visible & ~active, plan.store, self.block_size, key_shape)
        blocks = None
        if self.block_size is not None:  # padding tokens sit in no block: they see every key
            blocks = np.where(ok, (idx - pad[:, None]) // self.block_size, np.iinfo(np.int64).max)
        target = idx + self.shift  # slot each output predicts
        want = ok & (target < s) & predict[rows_of, np.minimum(target, s - 1)]
        rows, cols = np.nonzero(want)
        tslots = target[rows, cols]
        ids_t = self._to_device(ids)
        embeds = self.suffix.embeds(self.model, ids, idx, ok, plan.prev_token,
                                    block_start + self.params.block_length, ids_t)
        positions = idx - pad[:, None]
        if self.buckets is not None and embeds is None:
            logits, kv = self.buckets.call(self.model, CallRows(ids, positions, ok, n_tokens,
                                                                blocks, rows, cols), past)
            kv_at = None
        else:
            logits, kv, kv_at = self._call(ids_t, self._to_device(positions), ok, n_tokens,
                                           t_hat, embeds, past, blocks, rows, cols,
                                           self._in_place(past, positions, n_tokens))
        u = None
        if noise is not None:
            offset = np.minimum(np.maximum(tslots - block_start[rows], 0), noise.shape[1] - 1)
            u = noise[self._to_device(rows), self._to_device(offset)]
        at = plan.knobs[rows]  # (N,) each scored position's row's knobs
        allowed = None
        if plan.masks is not None:  # (N, V) float32 log-weights (-inf: not allowed)
            allowed = self._to_device(plan.masks.at(rows, tslots, logits.shape[-1]))
        sc = score(logits, self.params.remasking, at["temperature"], u, self.suppress, at["top_p"],
                   at["top_k"], at["alg_temp"], with_entropy=self.with_entropy, drop=self.drop,
                   allowed=allowed)
        token = np.full((r, s), self.mask_id, dtype=np.int64)
        conf = np.full((r, s), -np.inf, dtype=np.float32)
        ent = np.zeros((r, s), dtype=np.float32)
        fresh = np.zeros((r, s), dtype=bool)
        fresh[rows, tslots] = True
        return Forwarded(token, conf, ent, fresh, kv, kv_at, idx, ids, ok, plan.refresh, visible,
                         n_tokens, Scores(rows, tslots, sc.token, sc.conf, sc.entropy))

    @staticmethod
    def _past(cached: np.ndarray, read: StoreRead | None, block_size: int | None,
              key_shape: Callable[[np.ndarray], np.ndarray]) -> Past | None:
        """The stored positions each row attends to besides its forwarded tokens: its visible
        slots not recomputed that hold K/V, in slot order, padded to the largest attention count
        K (`key_shape` of each row's count). Attention then costs what a row sees, not the
        canvas width."""
        if read is None:
            return None
        slots, mask, n, k_hat = _compact(cached & read.valid, key_shape)  # (R, K)
        if slots.shape[1] == 0:
            return None
        # Padding entries (mask False) may point anywhere: clip them into the store.
        pos = np.minimum(np.maximum(slots - read.pad[:, None], 0), read.store.shape[1] - 1)
        return Past(read.store, read.rows, pos, mask, n, k_hat,
                    None if block_size is None else pos // block_size)

    def _in_place(self, past: Past | None, positions: np.ndarray,
                  n_tokens: np.ndarray) -> Placed | None:
        """The call's rows that attend in place (`attend_in_place`), None: none."""
        on = self.device.type == "cpu" if self.attend_in_place is None else self.attend_in_place
        fewest = min(2, IN_PLACE_MIN_ROWS)  # two share the buffer
        if not (on and self.by_block) or past is None or past.rows.size < fewest:
            return None  # (a lone row never qualifies: a lone request pays no checks)
        every = None  # `_shared` of all the call's rows, where a small call looked first
        if past.rows.size < IN_PLACE_MIN_ROWS:
            every = self._shared(past, None, n_tokens)
            if max(every[1]) < 0:
                return None  # only rows sharing the buffer could, and none does: a ~20 us look
        lined, free = past.in_place(positions, n_tokens)
        rows = np.flatnonzero(lined)
        if rows.size < fewest:
            return None
        order, starts = (every if every is not None and rows.size == lined.size
                         else self._shared(past, rows, n_tokens))
        rows, starts = rows[order], np.array(starts, dtype=np.int64)
        # a row forwarding finished blocks too (a prompt's tail, the step after a block
        # finished) attends in place only over the buffer: over its store row one call per span
        # and row ran at 0.87x with short prompts at 16 rows, where the gathered call runs a
        # span for its whole shape group at once (BENCHMARKS.md, "Attention in place")
        bs = self.block_size
        last = positions[rows, np.maximum(n_tokens[rows] - 1, 0)]
        one = positions[rows, 0] // bs == last // bs
        direct = (starts < 0) & free[rows] & one  # over their store rows
        keep = (starts >= 0) | (direct if direct.sum() >= IN_PLACE_MIN_ROWS else False)
        if not keep.any():
            return None
        which = np.zeros(lined.size, dtype=bool)
        which[rows[keep]] = True
        return Placed(which, rows[keep], starts[keep], one[keep])

    def _shared(self, past: Past, rows: np.ndarray | None,
                n_tokens: np.ndarray) -> tuple[list[int], list[int]]:
        """`kv.shared_context` of the call's rows `rows` (None: all): their order and starts.
        Over more rows a row's starts only grow (a row between two in lexicographic order shares
        at least what they share), so none sharing among all means none among some."""
        rows = np.arange(past.rows.size) if rows is None else rows
        n = past.n[rows]
        return shared_context([past.store.token[b, :k] for b, k in
                               zip(past.rows[rows].tolist(), n.tolist(), strict=True)],
                              (n + n_tokens[rows]).tolist(), self.block_size)

    def _in_place_rows(self, past: Past, placed: Placed, n_tokens: np.ndarray,
                       blocks: np.ndarray, at: np.ndarray | None, width: int,
                       total: int) -> InPlace:
        """`InPlace` of the call's rows `placed`, whose fresh K/V is each token's packed index at
        (R, T), or (at None) unpacked rows of `width` places; the call forwards `total` tokens
        or places."""
        i, starts = placed.order, placed.starts
        t, n, srow = n_tokens[i], past.n[i], past.rows[i]
        spans = [[Span(0, c, k + c)] if one else self._spans(blocks, j, c, past)
                 for j, c, k, one in zip(i.tolist(), t.tolist(), n.tolist(),
                                         placed.one_block.tolist(), strict=True)]
        keys = [max(x.keys for x in sp) for sp in spans]
        if at is None:
            queries = [(b, 0, c) for b, c in zip(i.tolist(), t.tolist(), strict=True)]
        else:
            queries = [(0, a, c) for a, c in zip(at[i, 0].tolist(), t.tolist(), strict=True)]
        # the rows attending over their store row write their fresh K/V there first
        d = starts < 0
        cols = np.arange(int(t[d].max(initial=0)))[None, :]
        real = cols < t[d, None]  # (R', T')
        dst = (srow[d, None] * past.store.shape[1] + n[d, None] + cols)[real]
        src = (i[d, None] * width + cols)[real] if at is None else at[i[d], : cols.shape[1]][real]
        dev = past.store.kv.device
        whole = src.size == total and (src == np.arange(src.size)).all()
        widest = max((w for w, s in zip(keys, starts.tolist(), strict=True) if s >= 0), default=0)
        return InPlace(past.store.kv, srow.tolist(), spans, keys, queries,
                       torch.from_numpy(dst).to(dev),
                       None if whole else torch.from_numpy(src).to(dev), starts.tolist(),
                       n.tolist(), self.block_size,
                       self._context_buffer(past.store.kv, widest) if widest else None)

    def _context_buffer(self, kv: Tensor, width: int) -> Tensor:
        """(2, H_kv, >= width, D) memory for `InPlace.buffer`, like the K/V store kv's (N, W,
        L, 2, H_kv, D): kept between calls, so that it stays in cache (and is not allocated
        each call), and grown by doubling."""
        buf = self._buffer
        shape = (2, kv.shape[4], width, kv.shape[5])
        if (buf is None or buf.shape[2] < width or buf.dtype != kv.dtype
                or buf.device != kv.device or buf.shape[1::2] != shape[1::2]):
            grown = max(width, 2 * buf.shape[2] if buf is not None else 0)
            # zeros: a row reads masked keys past its own (a finished block's chunk)
            self._buffer = buf = kv.new_zeros(2, shape[1], grown, shape[3])
        return buf

    def _call(self, ids: Tensor, pos: Tensor, ok: np.ndarray, n_tokens: np.ndarray,
              t_hat: np.ndarray, embeds: Tensor | None, past: Past | None,
              blocks: np.ndarray | None, rows: np.ndarray, cols: np.ndarray,
              placed: Placed | None = None,
              ) -> tuple[Tensor, list[tuple[Tensor, Tensor]], np.ndarray | None]:
        """The model call: logits (N, V) at (rows, cols), each layer's fresh (k, v) (`Frame.fresh`)
        and, packed, each token's index among the packed ones ((R, T); None: unpacked). Only the
        scored positions get the LM head (~10% of a forward on the embedded model).

        ids, pos, ok: (R, T) the forwarded tokens, T the widest attention count; n_tokens and
        t_hat (R,) each row's count and attention count; blocks (R, T) each token's block
        (block-causal models; None: bidirectional). Each row attends at its own shape among the
        rows of that shape (`shape_groups`). One group with little padding runs as
        padded rows; otherwise the call goes packed: projections and MLPs skip the padding, and
        attention runs per group, gathered into its rows."""
        r, t = ids.shape
        k_hat = past.shape if past is not None else np.zeros(r, dtype=np.int64)
        groups = shape_groups(t_hat, k_hat)
        n = int(n_tokens.sum())
        ok_t = self._to_device(ok)
        # rows attending by span read no mask, so no blocks (`Frame.spans`)
        blocks_t = None if blocks is None or self.by_block else self._to_device(blocks)
        in_place = None if placed is None else placed.which
        every = in_place is not None and bool(in_place.all())
        if self.widen_small_calls and self.by_block and len(groups) == 1 and r * t < self.rows.blocks:
            # gathered: a call this small has a row or few (in place over store rows pays
            # from IN_PLACE_MIN_ROWS; over the buffer unmeasured at the few rows of a widened call)
            return self._widened(ids, pos, ok_t, embeds, past, blocks, rows, cols)
        if self.unpacked(len(groups), r, t, n) and (in_place is None or every):
            frame = (Frame(in_place=self._in_place_rows(past, placed, n_tokens, blocks, None, t,
                                                        r * t))
                     if every else self._frame(past, ok_t, blocks_t, self._spans(blocks, 0, t, past)))
            logits = self.model(ids, pos, frame=frame, embeds=embeds,
                                logits_at=self._at_least(rows, cols))
            return logits[: rows.size], frame.fresh, None
        at = (np.cumsum(ok.reshape(-1)) - 1).reshape(r, t)  # (R, T) packed index of each token
        extra = max(self.rows.blocks - n, 0)  # tokens that no row attends with, for the products' sake
        if in_place is not None:  # the other rows attend by group
            groups = [h for h in (g[~in_place[g]] for g in groups) if h.size]
        whole = len(groups) == 1 and not extra and in_place is None
        frame = Frame(key_mask=ok_t, packed=True, extra=extra,
                      groups=[self._group(g, whole, at, ok, t_hat, ok_t, past, blocks, blocks_t)
                              for g in groups],
                      in_place=None if placed is None else self._in_place_rows(
                          past, placed, n_tokens, blocks, at, t, n + extra))
        logits = self.model(self._packed(ids[ok_t], extra), self._packed(pos[ok_t], extra),
                            frame=frame,
                            embeds=None if embeds is None else self._packed(embeds[ok_t], extra),
                            logits_at=self._at_least(np.zeros_like(rows), at[rows, cols]))
        return logits[: rows.size], frame.fresh, at

    def _widened(self, ids: Tensor, pos: Tensor, ok_t: Tensor, embeds: Tensor | None,
                 past: Past | None, blocks: np.ndarray, rows: np.ndarray,
                 cols: np.ndarray) -> tuple[Tensor, list[tuple[Tensor, Tensor]], np.ndarray]:
        """A call of fewer than `self.rows.blocks` places whose rows attend block by block (one
        shape group, every place real), as rows widened to that many places in all: the products
        get as many rows as a packed call's do, and attention, which reads only the blocks' own
        spans, never sees the added places, so the bits are the packed call's without its
        gathers in every layer (a batch-1 block-4 call: BENCHMARKS.md, "Host overhead").
        Returns the logits, the fresh K/V (R, H_kv, W, D) and each real token's index among
        the R*W places."""
        r, t = ids.shape
        w = -(-self.rows.blocks // r)

        def widened(x: Tensor, fill: int | bool = 0) -> Tensor:  # (R, T, ...) -> (R, W, ...)
            return torch.cat([x, x.new_full((r, w - t, *x.shape[2:]), fill)], dim=1)

        frame = self._frame(past, widened(ok_t, False), None, self._spans(blocks, 0, t, past))
        logits = self.model(widened(ids), widened(pos), frame=frame,
                            embeds=None if embeds is None else widened(embeds),
                            logits_at=self._at_least(rows, cols))
        at = np.arange(r)[:, None] * w + np.arange(t)[None, :]  # (R, T)
        return logits[: rows.size], frame.fresh, at

    def unpacked(self, n_groups: int, r: int, t: int, n: int) -> bool:
        """Whether a call of r rows x t places holding n real tokens, whose rows attend in
        n_groups shape groups, runs as padded rows (else packed). Packing saves the places
        beyond the max(n, m) tokens its products would run on (m: `self.rows.blocks`): none
        for a row of m places, which then skips the gathers. A call of fewer places goes
        packed, so that its products get m rows."""
        m = self.rows.blocks
        return n_groups == 1 and r * t >= m and r * t - max(n, m) < self.pack_min_padding * r * t

    def _at_least(self, rows: np.ndarray, cols: np.ndarray) -> tuple[Tensor, Tensor]:
        """The LM head's (rows, cols) on the device, repeating the first position up to
        `self.rows.head` (fewer positions could round differently; the repeats are dropped)."""
        m = self.rows.head
        if 0 < rows.size < m:
            rows, cols = (np.concatenate([a, np.repeat(a[:1], m - a.size)])
                          for a in (rows, cols))
        return self._to_device(rows), self._to_device(cols)

    @staticmethod
    def _packed(t: Tensor, extra: int) -> Tensor:
        """Packed tokens (N, ...) as the model's (1, N + extra, ...) input, the extra ones zeros."""
        if extra:
            t = torch.cat([t, t.new_zeros(extra, *t.shape[1:])])
        return t[None]

    def _frame(self, past: Past | None, key_mask: Tensor, blocks: Tensor | None,
               spans: list[Span] | None) -> Frame:
        """An unpacked frame of rows that read `past` (None: no stored keys)."""
        if past is None:
            return Frame(key_mask=None if spans is not None else key_mask, blocks=blocks,
                         spans=spans, span_rows=self.block_size or 1)
        return past.frame(key_mask, blocks, spans, self.block_size or 1)

    def _spans(self, blocks: np.ndarray | None, row: int, t: int,
               past: Past | None) -> list[Span] | None:
        """`Frame.spans` of rows at the exact shape of call row `row` (blocks: (R, T) each
        forwarded token's block; t: the rows' token count), None unless they attend by block.
        Their stored keys are the positions before their forwarded tokens (the block cache's
        finished blocks), so key i is position i.

        The last block (the current one, whose K/V the store never keeps) attends alone over
        exactly the keys up to its end. The blocks before it are finished: their K/V goes to
        the store and must be the same bits whichever call computes it (a prompt's prefill, the
        step after the block finished, another request's prefill). They attend one chunk of
        `SPAN_CHUNK` positions per call, each block's queries over the keys up to its chunk's
        end, those past its own block masked: the key count of a block's call is then fixed by
        its position, and the kernel rounds a query alike whichever queries of its chunk share
        the call and whatever the masked keys hold (docs/engine.md, "Prefix reuse"). A prefill
        of n tokens is then n / SPAN_CHUNK calls, not n / block size."""
        if not self.by_block:
            return None
        own = blocks[row, :t]  # (t,) each forwarded token's block
        last = int(np.flatnonzero(own != own[-1])[-1]) + 1 if own[0] != own[-1] else 0
        n_past = 0 if past is None else int(past.n[row])
        spans = []
        if last:
            bs = self.block_size
            chunk = -(-SPAN_CHUNK // bs) * bs  # positions, whole blocks
            of = own[:last] * bs // chunk  # (last,) each finished token's chunk
            cut = (np.flatnonzero(of[1:] != of[:-1]) + 1).tolist()
            for a, b in zip([0, *cut], [*cut, last], strict=True):
                end = (int(of[a]) + 1) * chunk
                sees = np.arange(end)[None, :] < (own[a:b, None] + 1) * bs  # (b - a, end)
                spans.append(Span(a, b, end, self._to_device(sees)))
        spans.append(Span(last, t, n_past + t))
        return spans

    def _group(self, g: np.ndarray, whole: bool, at: np.ndarray, ok: np.ndarray,
               t_hat: np.ndarray, ok_t: Tensor, past: Past | None, blocks: np.ndarray | None,
               blocks_t: Tensor | None) -> RowGroup:
        """Rows g (one attention shape) of a packed call as one attention batch (whole: g is every
        row, in order, and the call has no extra tokens)."""
        t_g = int(t_hat[g[0]])
        ok_g = ok[g, :t_g]  # real tokens come first in each row (`_compact`)
        grid = np.where(ok_g, at[g, :t_g], 0).reshape(-1)
        real = ok_g.reshape(-1)
        rows = slice(None) if whole else self._to_device(g)
        key_mask = ok_t[rows, :t_g]
        blocks_g = None if blocks_t is None else blocks_t[rows, :t_g]
        # a single group's stored keys are already at its attention count
        sub = past if past is None or whole else past.take(g)
        frame = self._frame(sub, key_mask, blocks_g, self._spans(blocks, int(g[0]), t_g, past))
        return RowGroup(
            grid=self._to_device(grid), shape=(g.size, t_g),
            real=None if real.all() else self._to_device(np.flatnonzero(real)),
            out_at=None if whole else self._to_device(grid[real]), frame=frame)
