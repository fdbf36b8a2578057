"""K/V state that a forward may attend to, written and read by canvas slot.

The model knows nothing of caching policies: every attention layer hands its fresh K/V to the
`Frame` and gets back the keys to attend over. A policy (``unmask.caching``) decides which slots
are forwarded and which are read from the store; the model code is the same either way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class PastKV:
    """Per-layer keys and values a call attends to besides its forwarded tokens: k[layer],
    v[layer] (B, K, H_kv, D), position-major (`KVStore.gather` makes them)."""

    k: Sequence[Tensor]
    v: Sequence[Tensor]


@dataclass
class KVStore:
    """Per-layer K/V of canvas positions from the last time they were forwarded, for a pool of
    rows: a batch row holds one store row while it is in the batch (`DecodeBatch.store_row`),
    and its slot pad + p keeps position p's K/V. Rows joining, leaving or widening the batch's
    canvas move nothing here.

    kv: (N, W, L, 2, H_kv, D) on the model's device: for each (row, position), every layer's
    key ([..., 0, :, :]) and value ([..., 1, :, :]) side by side, so that storing a call's K/V
    and reading the positions a call attends to are one copy each, for all layers at once.
    token: (N, W) host array, the token each position's K/V was computed from, -1 where it holds
    none (never forwarded, dropped by `invalidate`, or a free row). A position committed since
    its forward holds K/V of its old [MASK], which a policy may recompute.
    """

    kv: Tensor
    token: np.ndarray

    @classmethod
    def empty(cls, n_layers: int, rows: int, n_kv_heads: int, width: int, head_dim: int,
              dtype: torch.dtype, device: torch.device) -> KVStore:
        return cls(kv=_records(rows, width, (n_layers, 2, n_kv_heads, head_dim), dtype, device),
                   token=np.full((rows, width), -1, dtype=np.int64))

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, width) of the pool."""
        return self.token.shape[0], self.token.shape[1]

    def gather(self, rows: np.ndarray, pos: np.ndarray) -> PastKV:
        """The store as seen by a call: for each of its R rows (`rows` (R,): store row; several
        call rows may read one store row, e.g. FreeDave's drafts), the K positions `pos` (R, K)
        only. A layer's keys and values are gathered together when its attention reads them, so
        no copy of the whole store is ever made, at most one layer's reads are held at a time,
        and attention runs over what a row can see, not over the store's width."""
        w = self.shape[1]
        at = (rows[:, None] * w + pos).reshape(-1)  # (R*K,) flat (row * width + position)
        if at.size and (np.diff(at) == 1).all():
            # consecutive places (a row's positions 0..K-1, the exact block cache's reads): a
            # view of the store, which the layer's concatenation copies once, not twice
            return self.read(slice(int(at[0]), int(at[-1]) + 1), pos.shape)
        return self.read(torch.from_numpy(at).to(self.kv.device), pos.shape)

    def read(self, flat: Tensor | slice, shape: tuple[int, int]) -> PastKV:
        """`gather` at flat (row * width + position) indices (R*K,) on the device, already
        made, or a slice of them: (R, K) = shape. A caller that keeps the indices in a buffer of
        its own reads the store without building them (unmask.engine.buckets)."""
        n, w = self.shape
        layers = _LayerReads(self.kv.view(n * w, *self.kv.shape[2:]), flat, shape)
        return PastKV(_Half(layers, 0), _Half(layers, 1))

    def tokens_at(self, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """(R, S) token of store row rows[i] at positions pos[i] (any ints: -1 outside 0..W-1)."""
        w = self.token.shape[1]
        inside = (pos >= 0) & (pos < w)
        tok = self.token[rows[:, None], np.minimum(np.maximum(pos, 0), max(w - 1, 0))]
        return np.where(inside, tok, -1)

    # --- the pool (rows join and leave; not per step) ------------------------------------------
    def grown(self, rows: int, width: int) -> KVStore:
        """This pool with at least `rows` rows and `width` positions (new ones empty)."""
        n, w = self.shape
        if rows <= n and width <= w:
            return self
        rows, width = max(rows, n), max(width, w)
        kv = _records(rows, width, self.kv.shape[2:], self.kv.dtype, self.kv.device)
        kv[:n, :w] = self.kv
        token = np.full((rows, width), -1, dtype=np.int64)
        token[:n, :w] = self.token
        return KVStore(kv, token)

    def compacted(self, rows: np.ndarray, width: int) -> KVStore:
        """A pool of just `rows` (in that order), `width` positions wide."""
        index = torch.from_numpy(rows).to(self.kv.device)
        kv = _records(rows.size, width, self.kv.shape[2:], self.kv.dtype, self.kv.device,
                      torch.empty)  # every place copied below
        kv.copy_(self.kv[index, :width])
        return KVStore(kv, self.token[rows, :width].copy())

    def invalidate(self, rows: np.ndarray) -> None:
        """Forget every position of store rows `rows` (a refresh rebuilds them)."""
        self.token[rows] = -1

    def write(self, rows: np.ndarray, pad: np.ndarray, src: np.ndarray, slots: np.ndarray,
              fresh: list[tuple[Tensor, Tensor]], at: np.ndarray | None, ok: np.ndarray,
              tokens: np.ndarray) -> None:
        """Store a call's fresh K/V (`Frame.fresh`: one (k, v) per layer, each (C, H_kv, T, D)
        for its C rows, or packed (1, H_kv, N, D)) computed from `tokens` (C, T) at canvas
        `slots` (C, T): call row src[i] goes to store row rows[i], whose canvas row has left
        padding pad[i]; entries with ok=False (padding queries) are skipped. at: (C, T) each
        token's index among the N packed ones (None: unpacked, row-major)."""
        r_idx, t_idx = np.nonzero(ok[src])
        if r_idx.size == 0:
            return
        c = src[r_idx]  # the call row of each written entry
        b, p = rows[r_idx], slots[c, t_idx] - pad[r_idx]
        n, w, n_layers, _, h, d = self.kv.shape
        dev = self.kv.device
        dst = torch.from_numpy(b * w + p).to(dev)
        # (C, H, T, D) or (1, H, N, D) per layer and half -> (C*T | N, L, 2, H, D), the store's
        # order, in one copy
        new = torch.stack([t.transpose(1, 2) for kv in fresh for t in kv], dim=2)
        new = new.view(-1, n_layers, 2, h, d)
        src_index = c * ok.shape[1] + t_idx if at is None else at[c, t_idx]
        if src_index.size != new.shape[0] or (src_index != np.arange(src_index.size)).any():
            new = new.index_select(0, torch.from_numpy(src_index).to(dev))
        # view, not reshape: a copy here would drop the write silently
        self.kv.view(n * w, n_layers, 2, h, d).index_copy_(0, dst, new)
        self.token[b, p] = tokens[c, t_idx]


# Bytes between one position's K/V and the next's in a `KVStore` beyond the K/V itself. Without
# them a position's record (every layer's K and V: 4 KiB on the shipped SDAR, a multiple of 4 KiB
# on most models) puts a row's keys of one layer a power of two apart, where they share the same
# few cache sets: attention over a row where it lies (`InPlace`) read 600 keys in 69 us, with
# 64 bytes more a record in 45 us (a contiguous copy: 39 us; BENCHMARKS.md, "Attention in place").
RECORD_PAD_BYTES = 64


def _records(rows: int, width: int, record: Sequence[int], dtype: torch.dtype,
             device: torch.device, make: Callable[..., Tensor] = torch.zeros) -> Tensor:
    """A `KVStore.kv` (rows, width, *record) made by `make` (zeros: unwritten places may be read
    as masked keys, and a masked NaN is still NaN), each position's record padded by
    `RECORD_PAD_BYTES` (a view: rows and positions still merge into one flat index)."""
    size = int(np.prod(record))
    pad = -(-RECORD_PAD_BYTES // dtype.itemsize)
    flat = make(rows, width, size + pad, dtype=dtype, device=device)
    return flat[:, :, :size].view(rows, width, *record)


class _LayerReads:
    """A call's reads of the store (N*W, L, 2, H, D), one layer at a time: `get(layer)` gathers
    that layer's keys and values at the flat (row, position) indices in one copy, or views them
    where `flat` is a slice, (R, K, 2, H, D), and keeps only the last layer's (attention asks for
    keys, then values)."""

    def __init__(self, kv: Tensor, flat: Tensor | slice, shape: tuple[int, ...]) -> None:
        self.kv, self.flat, self.shape = kv, flat, shape
        self._layer, self._seen = -1, None

    def get(self, layer: int) -> Tensor:
        if layer != self._layer:
            kv = self.kv.select(1, layer)
            seen = kv[self.flat] if isinstance(self.flat, slice) else kv.index_select(0, self.flat)
            self._layer, self._seen = layer, seen.view(*self.shape, *seen.shape[1:])
        return self._seen


class _Half(Sequence):
    """Keys (0) or values (1) of a `_LayerReads`, indexed by layer: (R, K, H, D)."""

    def __init__(self, reads: _LayerReads, half: int) -> None:
        self.reads, self.half = reads, half

    def __getitem__(self, layer: int) -> Tensor:  # type: ignore[override]
        return self.reads.get(layer)[:, :, self.half]

    def __len__(self) -> int:
        return self.reads.kv.shape[1]


@dataclass
class InPlace:
    """Rows of a call that attend over their context where it lies (`Frame.in_place`), instead
    of over a gathered copy of it joined to their fresh K/V: a row whose stored keys are its
    positions 0..n-1 and whose forwarded tokens are its next t positions (`Past.in_place`;
    `Runner._in_place` picks them). Each attends by its spans (`Frame.spans`) over positions
    0.. of one of two places, as a strided view: the same keys, values and shapes as the
    gathered call, so the same bits, without copying its whole context twice a layer
    (BENCHMARKS.md, "Attention in place"):
    - its store row (`starts` -1): a row forwarding one block into slots that hold no stored
      token (the store reads them only once a write marks them). Its fresh K/V of each layer
      is first written there.
    - the context buffer (`starts` s >= 0): rows sharing leading blocks attend one after another
      (`shared_context`); each copies its stored keys from position s on from its store row,
      and its fresh K/V after them, into the buffer, whose first s positions the row before it
      left there. A row forwarding finished blocks too (a prompt's tail, the step after a block
      finished) may take this place only.

    kv: the store (N, W, L, 2, H_kv, D).
    rows: each row's store row; spans: its spans; keys: the keys they read (the view's length:
        n + t, or a finished block's chunk end past it, masked); stored: its n (lists: read per
        row and layer, in the order rows attend).
    queries: each row's (call row, first column, count t) in the layer's q (B, H, T, D); a packed
        call's q is (1, H, N, D), its rows' columns their packed tokens. Its fresh K/V is at the
        same places.
    dst: (M,) flat store index (store row * W + position) of the forwarded tokens of the rows
        attending over their store row, src (M,) its index among the call's B * T tokens (None:
        all of them, in order).
    span_rows: as `Frame.span_rows`.
    starts: each row's place: -1 its store row; s >= 0 the buffer.
    buffer: (2, H_kv, >= keys, D) zeros or K/V (a masked key is read; a masked NaN is still NaN),
        at least the widest buffer row's keys.
    """

    kv: Tensor
    rows: list[int]
    spans: list[list[Span]]
    keys: list[int]
    queries: list[tuple[int, int, int]]
    dst: Tensor
    src: Tensor | None
    starts: list[int]
    stored: list[int]
    span_rows: int = 1
    buffer: Tensor | None = None
    _places: list[_Places] | None = field(default=None, init=False, repr=False)
    _join: tuple[int, bool] | None = field(default=None, init=False, repr=False)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        """Write the fresh k/v (B, H_kv, T, D) of `layer` of the rows attending over their store
        row there, then every row's attention of q (B, H, T, D) into out (B, H, T, D) at its
        places."""
        if self.dst.numel():
            fresh = torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=2)  # (B, T, 2, H_kv, D)
            flat = fresh.view(-1, *fresh.shape[2:])
            if self.src is not None:
                flat = flat.index_select(0, self.src)
            kv = self.kv.select(2, layer)  # (N, W, 2, H_kv, D)
            kv.view(-1, *kv.shape[2:]).index_copy_(0, self.dst, flat)
        if self._places is None:  # the same views and tiling serve every layer of the call
            self._places, self._join = self._place(), _tiling(self.queries, q.shape)
        pair = torch.stack([k, v]) if self.buffer is not None else None  # (2, B, H_kv, T, D)
        gqa = q.shape[1] != k.shape[1]
        joined = [None] * len(self._places) if self._join[1] else None
        for p in self._places:
            if p.fresh is None:  # its store row: the layer's keys there
                keys, values = p.keys[layer], p.values[layer]
            else:
                if p.copy is not None:
                    p.copy[1].copy_(p.copy[0][layer])
                p.fresh.copy_(pair[:, p.b, :, p.a : p.a + p.t])
                keys, values = p.keys, p.values
            qr = q[p.b : p.b + 1, :, p.a : p.a + p.t]
            if p.spans is None:  # one block over every key: the kernel called as it comes
                o = F.scaled_dot_product_attention(qr, keys, values, enable_gqa=gqa)
            else:
                o = by_block(qr, keys, values, p.spans, self.span_rows)
            if joined is None:
                out[p.b, :, p.a : p.a + p.t] = o[0]
            else:
                joined[p.at] = o
        if joined is not None:  # one copy instead of a write a row (~4 us each)
            torch.cat(joined, dim=self._join[0], out=out)

    def _place(self) -> list[_Places]:
        """Each row's views, in the order rows attend (`_Places`)."""
        places = []
        at = {bat: i for i, bat in enumerate(sorted(self.queries))}
        for r, spans, w, (b, a, t), s, n in zip(self.rows, self.spans, self.keys, self.queries,
                                                self.starts, self.stored, strict=True):
            plain = _one_call(spans, t, w, self.span_rows)
            if s < 0:
                # (L, 1, H_kv, w, D): layer l's keys as the kernel takes them
                seen = self.kv[r, :w].permute(1, 2, 3, 0, 4).unsqueeze(2)
                places.append(_Places(b, a, t, at[b, a, t], None if plain else spans,
                                      seen[:, 0], seen[:, 1]))
                continue
            buf = self.buffer
            copy = None
            if n > s:  # (L, 2, H_kv, n - s, D) its stored keys past what the row before left
                copy = (self.kv[r, s:n].permute(1, 2, 3, 0, 4), buf[:, :, s:n])
            places.append(_Places(b, a, t, at[b, a, t], None if plain else spans,
                                  buf[None, 0, :, :w], buf[None, 1, :, :w], copy,
                                  buf[:, :, n : n + t]))
        return places


def _tiling(queries: list[tuple[int, int, int]], shape: torch.Size) -> tuple[int, bool]:
    """(dim, whether) the rows' outputs, in call order, tile a call's (B, H, T, D) output
    along dim: unpacked rows each a whole call row (dim 0), or packed rows whose places fill
    its one row (dim 2; a call with other rows or extra places does not)."""
    order = sorted(queries)
    if len(order) == shape[0] and all(a == 0 and t == shape[2] for _, a, t in order):
        return 0, True
    ends = [a + t for _, a, t in order]  # each row's, where the next must start
    return 2, (shape[0] == 1 and all(b == 0 for b, _, _ in order)
               and [a for _, a, _ in order] == [0, *ends[:-1]] and ends[-1] == shape[2])


class _Places(NamedTuple):
    """A row's views for `InPlace.attend`, built at a call's first layer and read by every
    layer (a view costs about what a small kernel takes to run: 16 rows of ~540 keys x 4
    layers, the attention loop 4.4 -> 3.5 ms, a steady step 0.93x:
    benchmarks/ab/shared-steps-lean-attention.md).

    spans: None when the row's one span reads every key (the kernel called as it comes, as
        `by_block` would). keys/values: over its store row, (L, 1, H_kv, w, D), layer l's at
        [l]; over the buffer, (1, H_kv, w, D), the same every layer. copy: a buffer row's
        stored keys past what the row before it left, (L, 2, H_kv, m, D) from its store row,
        and their (2, H_kv, m, D) places in the buffer (None: nothing to copy). fresh: a buffer
        row's (2, H_kv, t, D) places of its fresh K/V (None: it attends over its store row)."""

    b: int
    a: int
    t: int
    at: int  # its place among the outputs joined in call order (`_tiling`)
    spans: list[Span] | None
    keys: Tensor
    values: Tensor
    copy: tuple[Tensor, Tensor] | None = None
    fresh: Tensor | None = None


# A row attends over the context buffer (`shared_context`) when the finished blocks it shares
# with the row before it are at least this share of its keys: it then copies the rest of its
# keys there and attends over keys in cache, where over its store row it reads every key from
# memory (a step of 16 rows of a shared ~540-token prompt: BENCHMARKS.md, "Attention in place").
# 0.25 measured alike; 0, every row through the buffer sharing or not, 0.90-0.97x on prompts
# that share nothing (benchmarks/probe/attend-in-place.md).
SHARE_MIN = 0.5


def shared_context(prefixes: list[np.ndarray], keys: list[int], block_size: int,
                   ) -> tuple[list[int], list[int]]:
    """(order, starts): the order in which rows attend in place, and where each row, in that
    order, starts copying its keys into the context buffer (`InPlace.starts`; -1: it attends
    where it lies).

    prefixes[i]: the tokens of row i's stored finished blocks (its store row's `token` at
    positions 0..); keys[i]: how many keys it attends over. Rows go in lexicographic order of
    their prefixes, so that rows sharing leading blocks are next to each other. A block's K/V
    under the exact block cache is the same bits whichever row computed it, given its tokens
    and those before it (docs/engine.md, "Prefix reuse"), so the keys that a row shares in
    whole blocks with the row before it in the buffer are its own bits: it copies only the
    rest. A row shares with the one before it when those blocks are at least SHARE_MIN of its
    keys; the first row of a run of such rows loads the buffer whole."""
    raw = [p.tobytes() for p in prefixes]
    order = sorted(range(len(prefixes)), key=raw.__getitem__)
    first = block_size * prefixes[0].itemsize if prefixes else 0  # a block's bytes
    common = [_common_blocks(prefixes[a], prefixes[b], block_size)
              if len(raw[a]) >= first and raw[a][:first] == raw[b][:first] else 0
              for a, b in itertools.pairwise(order)]  # with the row after, in order
    shares = [c >= SHARE_MIN * keys[b] for c, b in zip(common, order[1:], strict=True)]
    starts = []
    for j in range(len(order)):
        if j and shares[j - 1]:
            starts.append(common[j - 1])  # the row before it is in the buffer
        else:
            starts.append(0 if j < len(shares) and shares[j] else -1)
    return order, starts


def _common_blocks(a: np.ndarray, b: np.ndarray, block_size: int) -> int:
    """Positions of the whole blocks token arrays a and b begin with alike."""
    m = min(a.size, b.size)
    differ = np.flatnonzero(a[:m] != b[:m])
    return (int(differ[0]) if differ.size else m) // block_size * block_size


@dataclass
class Span:
    """One attention call of a block-causal row's forwarded tokens [a, b) over its first `keys`
    keys (stored ones first, then the forwarded: key i is position i), as `Frame.spans` lists
    them; mask (b - a, keys) bool, which keys each query sees (None: all)."""

    a: int
    b: int
    keys: int
    mask: Tensor | None = None


@dataclass
class RowGroup:
    """Rows of a packed call whose attention runs as one batch (`Frame.groups`): rows of one
    attention shape (`unmask.engine.runner.shape_groups`: by default each row's exact one, else
    its canonical padded one), which depends on the row alone, so the kernels round a row's
    attention alike in any batch; and a
    refresh row (~100 tokens, no stored keys) beside cached rows (~30 tokens, ~200 stored keys)
    does not pad them to both.

    grid: (G*T_g,) the packed index of each (row, column) place of the group's G rows, row-major;
        padding places hold any real token (masked out as keys, their queries' outputs dropped).
    shape: (G, T_g).
    real: (n_g,) the places in grid of the group's real tokens (None: every place is real).
    out_at: (n_g,) their packed index (None: the group is every row of the call, in order, so
        its real tokens are already in packed order).
    frame: the group's rows unpacked: key_mask (G, T_g), and past and past_mask (G, K_g) at the
        group's count of stored keys.
    """

    grid: Tensor
    shape: tuple[int, int]
    real: Tensor | None
    out_at: Tensor | None
    frame: Frame


@dataclass
class Frame:
    """What the T forwarded tokens of one call attend to.

    key_mask: (B, T) bool, which forwarded tokens are keys (False: batch padding).
    packed: the model's inputs are the key_mask's True tokens only, packed row after row as one
        (1, N) sequence (a call of few tokens adds `extra` zeros after them, which no row
        attends with), so projections and MLPs skip the padding; attention gathers them into padded
        rows, one `RowGroup` at a time (`groups`), and packs its output back.
    past / past_mask: optional stored keys and values (B rows, K positions each; `KVStore.gather`) and its
        (B, K) bool mask of positions to attend to in addition (unpacked frames; a packed
        frame's groups have their own).
    blocks / past_blocks: for a block-causal model, the block (position // block size) of each
        forwarded token (B, T) and stored key (B, K): a token then sees only keys of its own
        block or earlier ones (unmask.models.sdar.block_causal_mask), among the forwarded tokens
        (a call that forwards a finished block with the next one) and the stored keys alike.
        None: bidirectional.
    attn_mask: optional (B, 1, T, K) bool overriding everything (tests use it for causal masks).
    spans: a block-causal model's rows at their exact shapes (keys in position order, no
        padding; every row of the frame at the same positions): the attention calls of their
        forwarded tokens (`Span`), chosen so that the bits of a finished block's K/V depend on
        its tokens and those before it only, never on how far the call reaches: the K/V of a
        finished block is the same bits whichever request computed it
        (unmask.engine.prefix_store; docs/engine.md, "Prefix reuse"). span_rows: the model's
        block size, the fewest queries a call runs with.
    in_place: rows that attend over their context where it lies, their store row or the context
        buffer (`InPlace`): an unpacked frame's every row (it has no past then), or some of a
        packed frame's (its groups hold the others).
    After the forward, `fresh` holds each layer's (k, v) of the forwarded tokens as attention
    got them: (B, H_kv, T, D), or packed (1, H_kv, N, D).
    """

    key_mask: Tensor | None = None
    past: PastKV | None = None
    past_mask: Tensor | None = None
    blocks: Tensor | None = None
    past_blocks: Tensor | None = None
    attn_mask: Tensor | None = None
    packed: bool = False
    groups: list[RowGroup] | None = None
    extra: int = 0  # packed: tokens after the rows' own, which no group attends with
    spans: list[Span] | None = None
    span_rows: int = 1
    in_place: InPlace | None = None
    fresh: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    _mask: Tensor | None = field(default=None, repr=False)  # the keys' mask, once built
    _mask_built: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.packed and (self.key_mask is None or self.attn_mask is not None
                            or not (self.groups or self.in_place) or self.past is not None):
            raise ValueError("a packed frame needs key_mask (where each token goes) and row "
                             "groups (with their own stored keys), no attn_mask")

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention of the forwarded tokens: q (B, H, T, D), k/v (B, H_kv, T, D) -> (B, H, T, D);
        packed, B = 1 and T = N. A forward calls it once per layer, in layer order: the i-th
        call is layer i (whose stored keys it reads, and whose K/V is fresh[i])."""
        layer = len(self.fresh)
        self.fresh.append((k, v))
        if not self.packed:
            if self.in_place is None:
                return self._attend(layer, q, k, v)
            out = torch.empty_like(q)  # every place a row's (`Runner._call`: one shape group)
            self.in_place.attend(layer, q, k, v, out)
            return out
        tokens = [t[0].transpose(0, 1) for t in (q, k, v)]  # (N, H, D) each
        out = None
        if self.in_place is not None:  # (N, H, D); the extra tokens, which no row writes: zeros
            out = q.new_zeros(tokens[0].shape) if self.extra else q.new_empty(tokens[0].shape)
            self.in_place.attend(layer, q, k, v, out.transpose(0, 1)[None])
        for g in self.groups or ():
            rows = [t.index_select(0, g.grid).view(*g.shape, *t.shape[1:]).transpose(1, 2)
                    for t in tokens]  # (G, H, T_g, D) each
            o = g.frame._attend(layer, *rows)
            o = o.transpose(1, 2).reshape(-1, *o.shape[1::2])  # (G*T_g, H, D)
            if g.real is not None:
                o = o.index_select(0, g.real)
            if g.out_at is None:
                out = o
            else:
                if out is None:  # the extra tokens, which no group writes, get zeros
                    shape = (tokens[0].shape[0], *o.shape[1:])
                    out = o.new_zeros(shape) if self.extra else o.new_empty(shape)
                out.index_copy_(0, g.out_at, o)
        return out.transpose(0, 1)[None]  # (1, H, N, D)

    def rows(self, t: Tensor) -> Tensor:
        """A packed call's input (1, N, ...) as (B, T, ...) rows, zeros at padding (for code
        that looks at a call's inputs per row: spies, test models); unpacked input as is. The
        `extra` tokens are left out."""
        if not self.packed:
            return t
        out = t.new_zeros(*self.key_mask.shape, *t.shape[2:])
        out[self.key_mask] = t[0, : t.shape[1] - self.extra]
        return out

    def _attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Unpacked rows: q (B, H, T, D), k/v (B, H_kv, T, D) with the stored keys -> (B, H, T, D)."""
        if self.spans is not None:
            width = max(s.keys for s in self.spans)
            return by_block(q, *self._concat(layer, k, v, width), self.spans, self.span_rows)
        k, v, mask = self._keys(layer, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              enable_gqa=q.shape[1] != k.shape[1])

    def _concat(self, layer: int, k: Tensor, v: Tensor, width: int = 0,
                ) -> tuple[Tensor, Tensor]:
        """The layer's keys and values, stored ones first: (B, H_kv, K, D) each, with zeros after
        them up to `width` keys."""
        parts_k, parts_v = [k.transpose(1, 2)], [v.transpose(1, 2)]  # (B, T, H_kv, D)
        if self.past is not None:  # the store is slot-major: (R, K, H_kv, D)
            parts_k.insert(0, self.past.k[layer])
            parts_v.insert(0, self.past.v[layer])
        extra = width - sum(p.shape[1] for p in parts_k)
        if extra > 0:
            zeros = parts_k[-1].new_zeros(k.shape[0], extra, *parts_k[-1].shape[2:])
            parts_k.append(zeros)
            parts_v.append(zeros)
        if len(parts_k) == 1:
            return k, v
        return (torch.cat(parts_k, dim=1).transpose(1, 2),
                torch.cat(parts_v, dim=1).transpose(1, 2))

    def _keys(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """The layer's keys and values (stored ones first) and the (B,1,T|1,K) mask."""
        if self.attn_mask is not None:
            return k, v, self.attn_mask
        k, v = self._concat(layer, k, v)
        if not self._mask_built:  # the same keys in every layer: built at the first
            mask = self.key_mask
            if self.past is not None:
                new = mask if mask is not None else torch.ones(
                    k.shape[0], k.shape[2] - self.past_mask.shape[1], dtype=torch.bool,
                    device=k.device)
                mask = torch.cat([self.past_mask, new], dim=1)
            self._mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, K)
            if self.blocks is not None:
                self._mask = self._block_causal(self._mask)
            self._mask_built = True
        return k, v, self._mask

    def _block_causal(self, keys: Tensor | None) -> Tensor:
        """(B, 1, T, K) the keys each forwarded token sees: `keys` (B, 1, 1, K) (None: all)
        within its own block and earlier ones."""
        kb = self.blocks if self.past is None else torch.cat([self.past_blocks, self.blocks], 1)
        mask = self.blocks[:, None, :, None] >= kb[:, None, None, :]
        return mask if keys is None else mask & keys


def _one_call(spans: list[Span], t: int, keys: int, span_rows: int) -> bool:
    """Whether spans are a decode step's one block of t queries over all `keys` keys, unmasked:
    the kernel called as it comes (`by_block`)."""
    s0 = spans[0]
    return (len(spans) == 1 and s0.mask is None and s0.a == 0 and s0.b == t and s0.keys == keys
            and t >= span_rows)


def by_block(q: Tensor, k: Tensor, v: Tensor, spans: list[Span], span_rows: int) -> Tensor:
    """`Frame.spans` one call each: q (B, H, T, D) over k/v (B, H_kv, K, D) -> (B, H, T, D). A
    span of fewer queries than span_rows is padded with copies of its first: the kernel
    rounds a query's result differently with a lone query or two beside it
    (benchmarks/probe/block-attention-bits.md). Keys that a span counts past the forwarded
    tokens (its chunk reaches past them) are zeros (`Frame._concat`) or whatever the store row
    holds there (`InPlace`), which its mask hides."""
    gqa = q.shape[1] != k.shape[1]
    t = q.shape[2]
    if _one_call(spans, t, k.shape[2], span_rows):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    # queries past the last span (a widened call's added places: `Runner._widened`) get
    # zeros, not whatever empty memory holds: later layers' chunk spans read their keys
    # (masked), and a NaN masked is still NaN
    out = torch.empty_like(q) if spans[-1].b == t else torch.zeros_like(q)
    for s in spans:
        qa = q[:, :, s.a : s.b]
        n = s.b - s.a
        if n < span_rows:
            qa = torch.cat([qa, qa[:, :, :1].expand(-1, -1, span_rows - n, -1)], dim=2)
        o = F.scaled_dot_product_attention(qa, k[:, :, : s.keys], v[:, :, : s.keys],
                                           attn_mask=s.mask, enable_gqa=gqa)
        out[:, :, s.a : s.b] = o[:, :, :n]
    return out


@dataclass
class Past:
    """What a call reads from the store: store row `rows[i]` at positions `pos[i]` (R, K) for
    each of its rows; mask (R, K) False where a row has fewer positions than K; n (R,) each
    row's count and shape (R,) its attention count (K is the largest)."""

    store: KVStore
    rows: np.ndarray
    pos: np.ndarray
    mask: np.ndarray
    n: np.ndarray
    shape: np.ndarray
    blocks: np.ndarray | None  # (R, K) each position's block (block-causal models; else None)

    def take(self, index: np.ndarray) -> Past:
        """The rows `index`, all of one attention count, their slots cut to it."""
        k = int(self.shape[index[0]])
        return Past(self.store, self.rows[index], self.pos[index, :k], self.mask[index, :k],
                    self.n[index], self.shape[index],
                    None if self.blocks is None else self.blocks[index, :k])

    def in_place(self, positions: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows that may attend in place (`InPlace`), for their forwarded tokens' positions (R,
        T) (the first t (R,) of each real): (R,) those whose stored keys are positions 0..n-1
        and whose forwarded tokens are the next t positions, inside the store, and whose store
        row no other row of the call reads (FreeDave's drafts share one: none of the call's
        rows then attends in place); and (R,) those of them whose forwarded tokens' slots hold
        no stored token, where their fresh K/V may be written before the store takes what it
        keeps (a row attending over its store row)."""
        r = np.arange(self.rows.size)
        if len(set(self.rows.tolist())) != r.size:  # (np.unique: ~30 us a call)
            none = np.zeros(r.size, dtype=bool)
            return none, none
        n = self.n
        ok = ((n == 0) | (self.pos[r, np.maximum(n - 1, 0)] == n - 1)) & (positions[:, 0] == n)
        ok &= (positions[r, np.maximum(t - 1, 0)] == n + t - 1) & (n + t <= self.store.shape[1])
        cols = np.arange(positions.shape[1])[None, :]
        held = self.store.tokens_at(self.rows, n[:, None] + cols) >= 0  # (R, T)
        return ok, ok & ~(held & (cols < t[:, None])).any(-1)

    def frame(self, key_mask: Tensor, blocks: Tensor | None, spans: list[Span] | None = None,
              span_rows: int = 1) -> Frame:
        """An unpacked frame of these rows (key_mask: their (R, T) forwarded tokens; blocks:
        their blocks, block-causal models only), or of no stored keys when none reads any.
        With spans (`Frame.spans`) the rows attend by span, which reads no mask: none is built."""
        if spans is not None:
            past = self.store.gather(self.rows, self.pos) if self.pos.shape[1] else None
            return Frame(past=past, spans=spans, span_rows=span_rows)
        if self.pos.shape[1] == 0:
            return Frame(key_mask=key_mask, blocks=blocks)
        dev = key_mask.device
        past_mask = torch.from_numpy(self.mask).to(dev)
        return Frame(key_mask=key_mask, past=self.store.gather(self.rows, self.pos),
                     past_mask=past_mask, blocks=blocks,
                     past_blocks=None if blocks is None else torch.from_numpy(self.blocks).to(dev))
