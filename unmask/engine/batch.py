"""The decode state of the rows one decoder runs together, with `extend` and `filter`.

Canvas layout, per row: left padding (never attended to), the prompt, then the row's generated
positions, then right padding up to the batch's width S (rows may generate different lengths):

    slot:  0 .. pad-1 | pad .. P-1 | P .. end-1 | end .. S-1
           padding    | prompt     | generated  | padding

The generated region is the request's `canvas` (gen_length; for a block-causal model, rounded
up to the end of the model's block: unmask.engine.layout).

Every generated region starts at slot P, so blocks line up across rows. A row's positions
(RoPE ids) are slot - pad, so neither padding changes what a row computes. Joining rows with a
longer prompt or generation widen every array (a copy when membership changes, never per
step); leaving rows are dropped and the width shrinks back to what the remaining rows need.
The K/V store is a pool indexed by (store row, position), so none of this copies it: a joining
row takes a free store row, a leaving row frees its own (KVStore).

The decode state lives on the host, as numpy arrays, whatever the model's device: a step's
bookkeeping (drafts, blocks, cache and suffix plans, verification) is a few hundred operations
on arrays of a few hundred entries, where a numpy call costs ~1 us and a torch call 3-5 us
(BENCHMARKS.md, "Host overhead"). Only the K/V store's tensors are on the model's device,
and on a GPU the last forward's scores until the next rule step reads them (`pending`,
unmask.engine.commit); a model call copies its inputs there (unmask.engine.runner).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch import Tensor

from unmask.decoding.params import row_knobs
from unmask.engine.request import Request
from unmask.kv import KVStore


@dataclass
class Predictions:
    """The last forward's predictions of each row, by slot (valid where `fresh`)."""

    token: np.ndarray  # (R, S) long
    conf: np.ndarray  # (R, S) float
    entropy: np.ndarray  # (R, S) float
    fresh: np.ndarray  # (R, S) bool


@dataclass
class Scores:
    """A forward's scores on the model's device at N (row, slot) places: the forward's rows as
    the runner returns them, the batch's rows once accepted and left there until the next rule
    step reads them (unmask.engine.commit.DeviceCommit)."""

    rows: np.ndarray  # (N,) row
    slots: np.ndarray  # (N,) canvas slot
    token: Tensor  # (N,) int64, on the device
    conf: Tensor  # (N,) float32
    entropy: Tensor  # (N,) float32

    def keep(self, which: np.ndarray, rows: np.ndarray, slots: np.ndarray) -> Scores:
        """The places `which` (N,) bool, now at batch rows `rows` and slots `slots` (N,)."""
        index = torch.from_numpy(np.flatnonzero(which)).to(self.token.device)
        return Scores(rows[which], slots[which],
                       *(t.index_select(0, index) for t in (self.token, self.conf, self.entropy)))

    def taken(self, idx: np.ndarray) -> Scores:
        """After the batch kept its rows `idx` (in that order)."""
        size = max(int(self.rows.max(initial=-1)), int(idx.max(initial=-1))) + 1
        new_row = np.full(size, -1, dtype=np.int64)  # old batch row -> new (-1: left)
        new_row[idx] = np.arange(idx.size)
        moved = new_row[self.rows]
        return self.keep(moved >= 0, moved, self.slots)

    def at(self, rows: np.ndarray) -> Scores:
        """A subset batch's scores (`DecodeBatch.subset`) at the batch rows `rows` (R',) its
        rows are."""
        return Scores(rows[self.rows], self.slots, self.token, self.conf, self.entropy)

    def replaced(self, rows: np.ndarray, other: Scores | None) -> Scores:
        """These places but those of batch rows `rows`, and `other`'s (None: none)."""
        mine = self.keep(~np.isin(self.rows, rows), self.rows, self.slots)
        if other is None:
            return mine
        return Scores(np.concatenate([mine.rows, other.rows]),
                      np.concatenate([mine.slots, other.slots]),
                      *(torch.cat([x, y]) for x, y in ((mine.token, other.token),
                                                       (mine.conf, other.conf),
                                                       (mine.entropy, other.entropy))))

    def shifted(self, front: int, width: int) -> Scores:
        """After `front` slots were added (dropped, when negative) before every row of a canvas
        now `width` slots wide."""
        slots = self.slots + front
        return self.keep((slots >= 0) & (slots < width), self.rows, slots)


@dataclass
class Rows:
    """Per-row state (R,) of a batch. pad, end, store_block and block_seen are slot indices
    (-1: none), which move when the canvas widens at the front (`shifted`)."""

    pad: np.ndarray  # left padding: the row's prompt starts at slot pad
    end: np.ndarray  # one past the row's last generated slot
    step: np.ndarray  # steps taken
    store_block: np.ndarray  # block start the K/V store was last fully refreshed at (-1)
    block_seen: np.ndarray  # block start of LLaDA's schedule (static; -1)
    block_m: np.ndarray  # masked positions when that block started (static)
    block_step: np.ndarray  # steps taken in it (static)
    steps_per_block: np.ndarray  # the row's static schedule
    nfe: np.ndarray  # model calls the row took part in
    tok_fw: np.ndarray  # token positions those calls forwarded for it
    decided: np.ndarray  # generated positions committed by a forward's decision
    has_preds: np.ndarray  # bool: the row has predictions to commit from
    done: np.ndarray  # bool
    # float32 max entropy of the tokens its last rule step committed (-inf: none), for the cache
    # plan of the forward that follows it in the next step (Decoder's forward-first order)
    new_entropy: np.ndarray
    knobs: np.ndarray  # ROW_DTYPE: the request's per-row knobs (temperature, threshold, ...)

    @classmethod
    def joining(cls, reqs: list[Request], P: int) -> Rows:
        """Rows of requests joining a batch whose generated region starts at slot P."""
        n = len(reqs)

        def full(value: int | bool) -> np.ndarray:
            return np.full(n, value, dtype=bool if isinstance(value, bool) else np.int64)

        def each(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64).reshape(n)

        return cls(pad=each([P - r.prompt_len for r in reqs]),
                   end=each([P + r.canvas for r in reqs]), step=full(0), store_block=full(-1),
                   block_seen=full(-1), block_m=full(0), block_step=full(0),
                   steps_per_block=each([r.params.steps_per_block for r in reqs]), nfe=full(0),
                   tok_fw=full(0), decided=full(0), has_preds=full(False), done=full(False),
                   new_entropy=np.full(n, -np.inf, dtype=np.float32),
                   knobs=row_knobs([r.params for r in reqs]))

    def take(self, index: np.ndarray) -> Rows:
        return Rows(*(getattr(self, f.name)[index] for f in fields(self)))

    def cat(self, other: Rows) -> Rows:
        return Rows(*(np.concatenate([getattr(self, f.name), getattr(other, f.name)])
                      for f in fields(self)))

    def shifted(self, front: int) -> Rows:
        """The slot indices of a canvas that gained `front` slots at the front (lost, if < 0)."""
        return replace(self, pad=self.pad + front, end=self.end + front,
                       store_block=np.where(self.store_block >= 0, self.store_block + front, -1),
                       block_seen=np.where(self.block_seen >= 0, self.block_seen + front, -1))


class DecodeBatch:
    def __init__(self, mask_id: int, eos_id: int, device: torch.device,
                 store_shape: tuple[int, int, int, torch.dtype] | None,
                 capacity: tuple[int, int] | None = None) -> None:
        """store_shape: (n_layers, n_kv_heads, head_dim, dtype) when the decoder keeps a K/V
        store, else None. capacity: (rows, positions) of a store allocated once at that size and
        never compacted, so that its tensor stays where a captured CUDA graph reads it
        (unmask.engine.graphs); None: a pool that grows with its rows (`_compact_store`)."""
        self.mask_id, self.eos_id, self.device = mask_id, eos_id, device
        self.store_shape = store_shape
        self.requests: list[Request] = []
        self.P = 0
        self.S = 0
        self._slots = np.arange(0)
        self.x = np.empty((0, 0), dtype=np.int64)
        self.commit_step = np.empty((0, 0), dtype=np.int64)
        # Rows whose specs differ only in per-row knobs share this batch; each policy reads its
        # own row's (rows.knobs).
        self.rows = Rows.joining([], 0)
        self.preds = Predictions(np.empty((0, 0), dtype=np.int64), np.empty((0, 0), dtype=np.float32),
                                 np.empty((0, 0), dtype=np.float32), np.empty((0, 0), dtype=bool))
        # scores of preds left on the device until the next rule step reads them
        # (unmask.engine.commit.DeviceCommit; None: every score is in preds)
        self.pending: Scores | None = None
        self.store: KVStore | None = None
        self.store_row = np.empty(0, dtype=np.int64)  # (R,) the row's store row
        self._free: list[int] = []  # store rows no batch row holds
        self.fixed_store = capacity is not None
        if store_shape is not None:
            n_layers, n_kv, head_dim, dtype = store_shape
            rows, width = capacity or (0, 0)
            self.store = KVStore.empty(n_layers, rows, n_kv, width, head_dim, dtype, device)
            self._free = list(range(rows))

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def slots(self) -> np.ndarray:  # (S,) slot indices, rebuilt only when the width changes
        if self._slots.shape[0] != self.S:
            self._slots = np.arange(self.S)
        return self._slots

    # --- membership --------------------------------------------------------------------------
    def extend(self, reqs: list[Request]) -> None:
        """Add rows for `reqs` (fresh canvases, no predictions yet)."""
        if not reqs:
            return
        P = max([self.P] + [r.prompt_len for r in reqs])
        gen = max([self.S - self.P] + [r.canvas for r in reqs])
        self._resize(P - self.P, (P + gen) - (self.S + (P - self.P)))
        b = len(reqs)
        x = np.full((b, self.S), self.eos_id, dtype=np.int64)
        for i, r in enumerate(reqs):
            x[i, P - r.prompt_len : P] = r.prompt_ids
            x[i, P : P + r.canvas] = self.mask_id
        self.rows = self.rows.cat(Rows.joining(reqs, P))
        self.x = np.concatenate([self.x, x])
        self.commit_step = np.concatenate([self.commit_step, np.full_like(x, -1)])
        pr = self.preds
        self.preds = Predictions(
            np.concatenate([pr.token, np.full_like(x, self.mask_id)]),
            np.concatenate([pr.conf, np.full((b, self.S), -np.inf, dtype=np.float32)]),
            np.concatenate([pr.entropy, np.zeros((b, self.S), dtype=np.float32)]),
            np.concatenate([pr.fresh, np.zeros((b, self.S), dtype=bool)]))
        if self.store is not None:
            n = self.store.shape[0]
            self.store = self.store.grown(n + max(b - len(self._free), 0),
                                          max(r.slots for r in reqs))
            self._free += range(n, self.store.shape[0])
            taken, self._free = self._free[:b], self._free[b:]
            self.store_row = np.concatenate([self.store_row, np.array(taken, dtype=np.int64)])
        self.requests.extend(reqs)

    def filter(self, keep: list[bool]) -> None:
        """Keep the rows flagged True (finished or aborted rows leave the arrays)."""
        if all(keep):
            return
        idx = np.array([i for i, k in enumerate(keep) if k], dtype=np.int64)
        self.requests = [r for r, k in zip(self.requests, keep, strict=True) if k]
        self.rows = self.rows.take(idx)
        self.x, self.commit_step = self.x[idx], self.commit_step[idx]
        pr = self.preds
        self.preds = Predictions(pr.token[idx], pr.conf[idx], pr.entropy[idx], pr.fresh[idx])
        if self.pending is not None:
            self.pending = self.pending.taken(idx)
        if self.store is not None:
            gone = self.store_row[~np.array(keep)]
            self.store.invalidate(gone)
            self._free += gone.tolist()
            self.store_row = self.store_row[idx]
            self._compact_store()
        if not self.requests:
            self._resize(-self.P, -(self.S - self.P))
            return
        P = max(r.prompt_len for r in self.requests)
        gen = max(r.canvas for r in self.requests)
        self._resize(P - self.P, (P + gen) - (self.S + P - self.P))

    def subset(self, rows: np.ndarray) -> DecodeBatch:
        """A batch of rows `rows` (R',) of this one: copies of their state, the same K/V store
        (what a step of the subset writes there is this batch's). `put` writes the rest back."""
        sub = DecodeBatch.__new__(DecodeBatch)
        sub.__dict__.update(self.__dict__)
        sub.requests = [self.requests[i] for i in rows.tolist()]
        sub.rows = self.rows.take(rows)
        sub.x, sub.commit_step = self.x[rows], self.commit_step[rows]
        pr = self.preds
        sub.preds = Predictions(pr.token[rows], pr.conf[rows], pr.entropy[rows], pr.fresh[rows])
        if self.store is not None:
            sub.store_row = self.store_row[rows]
        sub.pending = None if self.pending is None else self.pending.taken(rows)
        if sub.pending is not None and not sub.pending.rows.size:
            sub.pending = None
        return sub

    def put(self, rows: np.ndarray, sub: DecodeBatch) -> None:
        """Rows `rows` (R',) := the state of `sub`, this batch's `subset(rows)` after a step."""
        self.x[rows], self.commit_step[rows] = sub.x, sub.commit_step
        for f in fields(Rows):
            getattr(self.rows, f.name)[rows] = getattr(sub.rows, f.name)
        for f in fields(Predictions):
            getattr(self.preds, f.name)[rows] = getattr(sub.preds, f.name)
        # scores a device commit has not read yet (unmask.engine.commit): the subset's in place
        # of its rows' own, so that the batch's next rule step reads them all in one copy
        theirs = None if sub.pending is None else sub.pending.at(rows)
        self.pending = theirs if self.pending is None else self.pending.replaced(rows, theirs)

    def _compact_store(self) -> None:
        """Give the pool's memory back once it is more than twice as wide as the widest canvas
        its rows use (one copy). Its rows stay while the batch has any: a row that left is
        taken by the next to join, where a pool shrunk and grown again cost each burst of 16
        requests on the shipped SDAR model ~7 ms of copies and allocation, ~25 ms where the
        new pool's memory is faulted in fresh (benchmarks/probe/ttft-anatomy.md). So the pool
        holds at most the most rows the batch has held at once (<= max_running) x twice the
        widest canvas its rows use; an empty batch keeps it until the engine gives it back
        (`release_store`). A preallocated store stays as it is."""
        if self.fixed_store or not self.requests:
            return
        used = max(r.slots for r in self.requests)
        if self.store.shape[1] <= 2 * used:
            return
        self.store = self.store.compacted(self.store_row, used)
        self.store_row = np.arange(len(self.requests))
        self._free = []

    def release_store(self) -> None:
        """An empty batch's pool given back (a preallocated store stays where it is)."""
        if (self.store is not None and self.store.shape[0] and not self.requests
                and not self.fixed_store):
            self.store = self.store.compacted(self.store_row, 0)
            self._free = []

    def stored_tokens(self, rows: np.ndarray) -> np.ndarray:
        """(R', S) the token each slot of batch rows `rows` has K/V from in the store (-1: none)."""
        pos = self.slots[None, :] - self.rows.pad[rows][:, None]
        return self.store.tokens_at(self.store_row[rows], pos)

    def _resize(self, front: int, back: int) -> None:
        """Add (or, when negative, drop) `front` slots before and `back` slots after every row."""
        if front == 0 and back == 0:
            return
        r = self.x.shape[0]

        def pad(t: np.ndarray, fill: float | int | bool) -> np.ndarray:
            t = t[:, max(-front, 0) : t.shape[1] - max(-back, 0)]
            parts = [t]
            if front > 0:
                parts.insert(0, np.full((r, front), fill, dtype=t.dtype))
            if back > 0:
                parts.append(np.full((r, back), fill, dtype=t.dtype))
            return np.concatenate(parts, axis=1) if len(parts) > 1 else np.ascontiguousarray(t)

        self.x = pad(self.x, self.eos_id)
        self.commit_step = pad(self.commit_step, -1)
        pr = self.preds
        self.preds = Predictions(pad(pr.token, self.mask_id), pad(pr.conf, float("-inf")),
                                 pad(pr.entropy, 0.0), pad(pr.fresh, False))
        if self.pending is not None:
            self.pending = self.pending.shifted(front, self.x.shape[1])
        self.rows = self.rows.shifted(front)
        self.P += front
        self.S += front + back
