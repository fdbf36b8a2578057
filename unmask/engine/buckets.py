"""A model call as calls of a few fixed shapes (buckets), each run from persistent buffers.

A CUDA graph replays the kernels it captured, on the same addresses and shapes. The engine's
calls change shape every step (rows join and leave, a block's stored keys grow), so a graph can
hold a call only once the call is cut into *buckets*: rows, forwarded tokens and stored keys
rounded up by a rule (`BUCKET_RULES`), the inputs copied into buffers allocated once per bucket
(`BucketBuffers`), and every count a row has (its tokens, its keys) held in masks, not in
Python-side shapes. This module is that forward without capture: the path a capture would
record, and the one the CPU tests check.

- A row's bucket comes from its own counts, never from the batch: rows of one bucket run as one
  call, rows of another as another (unmask/engine/runner.py says why shapes must not depend on
  the batch: kernels round with them).
- Padding never changes what a real position attends to: padding keys are masked out, padding
  queries' outputs are dropped, and a padding row attends to its own first place only.
- With the `exact` rule each bucket is its rows' own shape, and a call gives today's bits
  (tests/test_buckets.py); with `pow2` the attention runs over masked padding keys, which the
  CPU's kernels round differently (docs/engine.md, "Batch invariance"): the tokens stay the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from unmask.engine.graphs import beyond_buckets, capture_failed, eager
from unmask.kv import Frame, KVStore, Past

NO_BLOCK = np.iinfo(np.int64).max  # a padding token's block: it sees every key


def exact_count(n: np.ndarray) -> np.ndarray:
    """(R,) each row's own count: buckets of exactly the rows' shapes."""
    return n


def next_pow2(n: np.ndarray) -> np.ndarray:
    """(R,) the least power of two >= n (0 stays 0): at most twice a row's own count, and few
    shapes, so few graphs."""
    power = np.left_shift(1, np.frexp(np.maximum(n - 1, 0))[1]).astype(np.int64)
    return np.where(n > 0, power, 0)


BUCKET_RULES: dict[str, Callable[[np.ndarray], np.ndarray]] = {"exact": exact_count, "pow2": next_pow2}
CallOut = tuple[Tensor, list[tuple[Tensor, Tensor]]]  # a bucket call's logits and fresh K/V


@dataclass(frozen=True)
class Bucket:
    """A call's shape: rows x tokens forwarded, each row attending to `keys` stored keys."""

    rows: int
    tokens: int
    keys: int

    def __post_init__(self) -> None:
        if self.rows < 1 or self.tokens < 1 or self.keys < 0:
            raise ValueError(f"a bucket needs rows and tokens >= 1, keys >= 0: {self}")


class BucketBuffers:
    """One bucket's inputs on the device, allocated once and overwritten by every call."""

    def __init__(self, b: Bucket, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        r, t, k = b.rows, b.tokens, b.keys
        self.ids, self.pos, self.blocks = zeros(r, t), zeros(r, t), zeros(r, t)  # (R_b, T_b)
        self.key_mask = zeros(r, t, dtype=torch.bool)
        self.flat, self.past_mask = zeros(r * k), zeros(r, k, dtype=torch.bool)  # (R_b*K_b,), (R_b, K_b)
        self.past_blocks = zeros(r, k)
        self.at_rows, self.at_cols = zeros(r * t), zeros(r * t)  # the LM head's positions

    def fill(self, staged: dict[str, np.ndarray]) -> None:
        """Copy host arrays of the bucket's shapes into the buffers of the same names."""
        for name, a in staged.items():
            getattr(self, name).copy_(torch.from_numpy(a))


@dataclass
class CallRows:
    """One model call's rows, as the runner built them (host arrays; R rows, T places each)."""

    ids: np.ndarray  # (R, T) forwarded tokens
    pos: np.ndarray  # (R, T) their positions
    ok: np.ndarray  # (R, T) bool, False for padding
    n_tokens: np.ndarray  # (R,) each row's forwarded tokens
    blocks: np.ndarray | None  # (R, T) each token's block (block-causal models; else None)
    rows: np.ndarray  # (N,) the scored positions' rows
    cols: np.ndarray  # (N,) and places


class BucketCall:
    """One bucket's forward from its buffers: the region a CUDA graph captures and replays.

    Called with no arguments: every input is a persistent buffer (`BucketBuffers`), overwritten
    in place between calls, and the K/V store is read at the flat indices in `buffers.flat`, so
    a call reads nothing from the host, depends on no Python-side shape and allocates no K/V
    storage (tests/test_buckets_replay.py). It returns the logits (R_b*T_b, V) at the LM head's
    positions and each layer's fresh (k, v) (R_b, H_kv, T_b, D): a replayed graph's outputs,
    overwritten by the next call."""

    def __init__(self, model: nn.Module, buffers: BucketBuffers, bucket: Bucket,
                 store: KVStore | None, block_causal: bool) -> None:
        self.model, self.buffers, self.bucket, self.store = model, buffers, bucket, store
        self.block_causal = block_causal

    def __call__(self) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        buf = self.buffers
        blocks = buf.blocks if self.block_causal else None
        if self.store is None:
            frame = Frame(key_mask=buf.key_mask, blocks=blocks)
        else:
            frame = Frame(key_mask=buf.key_mask,
                          past=self.store.read(buf.flat, (self.bucket.rows, self.bucket.keys)),
                          past_mask=buf.past_mask, blocks=blocks,
                          past_blocks=buf.past_blocks if self.block_causal else None)
        with torch.no_grad():
            logits = self.model(buf.ids, buf.pos, frame=frame, logits_at=(buf.at_rows, buf.at_cols))
        return logits, frame.fresh


class Buckets:
    """The bucketed forward of one runner: its rule and the buffers and calls of the buckets it
    met.

    min_rows: a bucket's calls give every matrix product at least this many rows (the runner's
    `ProductRows.blocks`: fewer can round differently). wrap: what a bucket's call becomes
    (unmask.engine.graphs: `eager`, or `capture` for a CUDA graph); max_keys: calls reading
    more stored keys run eagerly, unwrapped (None: no limit). shapes: the (tokens, keys)
    rounding of each row's counts in place of the rule's, which then rounds the rows only (the
    runner gives a bidirectional model its eager calls' attention shapes: see there)."""

    def __init__(self, rule: str, device: torch.device, min_rows: int,
                 wrap: Callable[[BucketCall], Callable[[], CallOut]] = eager,
                 max_keys: int | None = None,
                 shapes: tuple[Callable[[np.ndarray], np.ndarray], ...] | None = None) -> None:
        if rule not in BUCKET_RULES:
            raise ValueError(f"unknown bucket rule {rule!r}; valid: {', '.join(BUCKET_RULES)}")
        self.round, self.device, self.min_rows = BUCKET_RULES[rule], device, min_rows
        self.shapes = shapes or (self.round, self.round)
        self.wrap, self.max_keys = wrap, max_keys
        self.buffers: dict[Bucket, BucketBuffers] = {}
        # each bucket's call and the store it reads (a call reads the store's tensor where it
        # was when the call was made: a store that moved gets a new call)
        self.calls: dict[Bucket, tuple[KVStore | None, Callable[[], CallOut]]] = {}

    def buckets(self, n_tokens: np.ndarray, n_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(R,) each row's bucket tokens and keys, from its own counts."""
        tokens, keys = self.shapes
        return np.maximum(tokens(n_tokens), 1), keys(n_keys)

    def call(self, model: nn.Module, c: CallRows, past: Past | None,
             ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The call's logits (N, V) at (c.rows, c.cols) and each layer's fresh (k, v)
        (R, H_kv, T, D), as the runner's unpacked call returns them, one model call per
        bucket of rows."""
        r, t = c.ids.shape
        n_keys = past.n if past is not None else np.zeros(r, dtype=np.int64)
        t_b, k_b = self.buckets(c.n_tokens, n_keys)
        key = t_b * (int(k_b.max(initial=0)) + 1) + k_b
        groups = [np.flatnonzero(key == v) for v in np.unique(key)]
        logits: Tensor | None = None
        fresh: list[tuple[Tensor, Tensor]] = []
        for g in groups:
            b = self._bucket(g.size, int(t_b[g[0]]), int(k_b[g[0]]))
            sel = np.flatnonzero(np.isin(c.rows, g))
            out, kv = self._run(model, b, g, c, past, sel)
            whole = len(groups) == 1 and b.rows == r and b.tokens == t
            if whole:
                logits, fresh = out, kv
                break
            if logits is None:
                logits = out.new_empty(c.rows.size, out.shape[-1])
                fresh = [tuple(x.new_zeros(r, x.shape[1], t, x.shape[3]) for x in pair)
                         for pair in kv]
            logits[torch.from_numpy(sel).to(out.device)] = out
            g_t, width = torch.from_numpy(g).to(out.device), min(t, b.tokens)
            for into, got in zip(fresh, kv, strict=True):
                for whole_x, part in zip(into, got, strict=True):
                    whole_x[g_t, :, :width] = part[: g.size, :, :width]
        assert logits is not None
        return logits, fresh

    def _bucket(self, rows: int, tokens: int, keys: int) -> Bucket:
        # at least min_rows places a call, so that its products round as a row's alone
        rows = max(rows, -(-self.min_rows // tokens))
        return Bucket(int(self.round(np.array([rows]))[0]), tokens, keys)

    def bucket_call(self, model: nn.Module, b: Bucket, store: KVStore | None,
                    block_causal: bool) -> Callable[[], CallOut]:
        """Bucket b's call over `store` (None: b reads no stored keys), made at its first use
        and again when the store has moved; beyond max_keys, an eager call."""
        store = store if b.keys else None
        made = self.calls.get(b)
        if made is not None and made[0] is store:
            return made[1]
        if made is not None:  # the store moved: no call keeps the old one alive
            self.calls = {k: v for k, v in self.calls.items() if v[0] is None}
        buf = self.buffers.get(b)
        if buf is None:
            buf = self.buffers[b] = BucketBuffers(b, self.device)
        call = BucketCall(model, buf, b, store, block_causal)
        beyond = self.beyond(model, b)
        if beyond is not None:
            beyond_buckets(beyond)
            wrapped: Callable[[], CallOut] = call
        else:
            try:
                wrapped = self.wrap(call)
            except RuntimeError as e:  # out of memory, an op a graph cannot hold: serve on
                capture_failed(b, e)
                wrapped = call
        self.calls[b] = (store, wrapped)
        return wrapped

    def beyond(self, model: nn.Module, b: Bucket) -> str | None:
        """Why bucket b's call of `model` is not wrapped (captured), or None: more stored keys
        than max_keys, or more tokens than the model's forward holds without reading the host
        (`graph_tokens`: LLaDA2's expert counts, unmask.models.llada2)."""
        if self.max_keys is not None and b.keys > self.max_keys:
            return f"reading more than {self.max_keys} stored keys"
        most = getattr(model, "graph_tokens", None)
        if most is not None and b.rows * b.tokens > most:
            return f"of more than {most} tokens ({type(model).__name__}'s expert counts)"
        return None

    def _run(self, model: nn.Module, b: Bucket, g: np.ndarray, c: CallRows,
             past: Past | None, sel: np.ndarray) -> CallOut:
        """Rows g of the call as one call of bucket b: its scored positions' logits (n, V), in
        the order of `sel` (their indices among the call's scored positions), and its fresh
        K/V (R_b, H_kv, T_b, D)."""
        call = self.bucket_call(model, b, None if past is None else past.store,
                                c.blocks is not None)
        self.buffers[b].fill(self._stage(b, g, c, past, sel))
        logits, fresh = call()
        return logits[: sel.size], fresh

    @staticmethod
    def _stage(b: Bucket, g: np.ndarray, c: CallRows, past: Past | None,
               sel: np.ndarray) -> dict[str, np.ndarray]:
        """Host arrays of the bucket's shapes for rows g: their inputs, padding elsewhere."""
        r, t = g.size, min(c.ids.shape[1], b.tokens)
        shape = (b.rows, b.tokens)
        ids, pos = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
        key_mask, blocks = np.zeros(shape, bool), np.full(shape, NO_BLOCK, np.int64)
        ids[:r, :t], pos[:r, :t], key_mask[:r, :t] = c.ids[g, :t], c.pos[g, :t], c.ok[g, :t]
        key_mask[r:, 0] = True  # a padding row attends to its first place: no all-masked row
        if c.blocks is not None:
            blocks[:r, :t] = c.blocks[g, :t]
        local = np.zeros(c.ids.shape[0], np.int64)
        local[g] = np.arange(r)
        at_rows, at_cols = np.zeros(b.rows * b.tokens, np.int64), np.zeros(b.rows * b.tokens, np.int64)
        at_rows[: sel.size], at_cols[: sel.size] = local[c.rows[sel]], c.cols[sel]
        staged = {"ids": ids, "pos": pos, "key_mask": key_mask, "blocks": blocks,
                  "at_rows": at_rows, "at_cols": at_cols}
        if b.keys:
            k = min(past.pos.shape[1], b.keys)
            flat, mask = np.zeros((b.rows, b.keys), np.int64), np.zeros((b.rows, b.keys), bool)
            flat[:r, :k] = past.rows[g, None] * past.store.shape[1] + past.pos[g, :k]
            mask[:r, :k] = past.mask[g, :k]
            past_blocks = np.zeros((b.rows, b.keys), np.int64)
            if past.blocks is not None:
                past_blocks[:r, :k] = past.blocks[g, :k]
            staged |= {"flat": flat.reshape(-1), "past_mask": mask, "past_blocks": past_blocks}
        return staged
