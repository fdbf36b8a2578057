"""The decode state of the rows one decoder runs together, with `extend` and `filter`.

Canvas layout, per row: left padding (never attended to), the prompt, then the row's generated
positions, then right padding up to the batch's width S (rows may generate different lengths):

    slot:  0 .. pad-1 | pad .. P-1 | P .. end-1 | end .. S-1
           padding    | prompt     | generated  | padding

Every generated region starts at slot P, so blocks line up across rows. A row's positions
(RoPE ids) are slot - pad, so neither padding changes what a row computes. Joining rows with a
longer prompt or generation widen every array (a copy when membership changes, never per
step); leaving rows are dropped and the width shrinks back to what the remaining rows need.
The K/V store is a pool indexed by (store row, position), so none of this copies it: a joining
row takes a free store row, a leaving row frees its own (KVStore).

The decode state lives on the host, as numpy arrays, whatever the model's device: a step's
bookkeeping (drafts, blocks, cache and suffix plans, verification) is a few hundred operations
on arrays of a few hundred entries, where a numpy call costs ~1 us and a torch call 3-5 us
(BENCHMARKS.md, "Host overhead"). Only the K/V store's tensors are on the model's device; a
model call copies its inputs there and its scores back (unmask.engine.runner).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from unmask.decoding.params import ROW_DTYPE, row_knobs
from unmask.engine.request import Request
from unmask.kv import KVStore


@dataclass
class Predictions:
    """The last forward's predictions of each row, by slot (valid where `fresh`)."""

    token: np.ndarray  # (R, S) long
    conf: np.ndarray  # (R, S) float
    entropy: np.ndarray  # (R, S) float
    fresh: np.ndarray  # (R, S) bool


# Per-slot arrays and the value a new slot holds; `x` is filled separately (EOS padding).
_SLOT_FILL = {"commit_step": -1}
_PRED_FILL = {"token": None, "conf": float("-inf"), "entropy": 0.0, "fresh": False}
# Per-row arrays holding a slot index (-1: none), shifted with the slots.
_SLOT_INDEX_ROWS = ("pad", "end", "store_block", "block_seen")
_ROWS = ("pad", "end", "step", "store_block", "block_seen", "block_m", "block_step",
         "steps_per_block", "nfe", "tok_fw", "decided", "has_preds", "done")


class DecodeBatch:
    def __init__(self, mask_id: int, eos_id: int, device: torch.device,
                 store_shape: tuple[int, int, int, torch.dtype] | None) -> None:
        """store_shape: (n_layers, n_kv_heads, head_dim, dtype) when the decoder keeps a K/V
        store, else None."""
        self.mask_id, self.eos_id, self.device = mask_id, eos_id, device
        self.store_shape = store_shape
        self.requests: list[Request] = []
        self.P = 0
        self.S = 0
        self._slots = np.arange(0)
        self.x = np.empty((0, 0), dtype=np.int64)
        self.commit_step = np.empty((0, 0), dtype=np.int64)
        # (R,) ROW_DTYPE: each row's per-row knobs (temperature, threshold, ...): rows whose
        # specs differ only in these share this batch, and each policy reads its own row's
        self.knobs = np.empty(0, dtype=ROW_DTYPE)
        for name in _ROWS:
            setattr(self, name, np.empty(0, dtype=bool if name in ("has_preds", "done") else np.int64))
        self.preds = Predictions(np.empty((0, 0), dtype=np.int64), np.empty((0, 0), dtype=np.float32),
                                 np.empty((0, 0), dtype=np.float32), np.empty((0, 0), dtype=bool))
        self.store: KVStore | None = None
        self.store_row = np.empty(0, dtype=np.int64)  # (R,) the row's store row
        self._free: list[int] = []  # store rows no batch row holds
        if store_shape is not None:
            n_layers, n_kv, head_dim, dtype = store_shape
            self.store = KVStore.empty(n_layers, 0, n_kv, 0, head_dim, dtype, device)

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
        gen = max([self.S - self.P] + [r.gen_length for r in reqs])
        self._resize(P - self.P, (P + gen) - (self.S + (P - self.P)))
        b = len(reqs)
        x = np.full((b, self.S), self.eos_id, dtype=np.int64)
        for i, r in enumerate(reqs):
            x[i, P - r.prompt_len : P] = r.prompt_ids
            x[i, P : P + r.gen_length] = self.mask_id
        new_rows = {
            "pad": [P - r.prompt_len for r in reqs], "end": [P + r.gen_length for r in reqs],
            "step": 0, "store_block": -1, "block_seen": -1, "block_m": 0, "block_step": 0,
            "steps_per_block": [r.params.steps_per_block for r in reqs], "nfe": 0, "tok_fw": 0,
            "decided": 0, "has_preds": False, "done": False,
        }
        for name in _ROWS:
            old = getattr(self, name)
            val = new_rows[name]
            add = (np.array(val, dtype=old.dtype) if isinstance(val, list)
                   else np.full(b, val, dtype=old.dtype))
            setattr(self, name, np.concatenate([old, add]))
        self.x = np.concatenate([self.x, x])
        self.commit_step = np.concatenate([self.commit_step, np.full_like(x, -1)])
        self.knobs = np.concatenate([self.knobs, row_knobs([r.params for r in reqs])])
        pr = self.preds
        self.preds = Predictions(
            np.concatenate([pr.token, np.full_like(x, self.mask_id)]),
            np.concatenate([pr.conf, np.full((b, self.S), -np.inf, dtype=np.float32)]),
            np.concatenate([pr.entropy, np.zeros((b, self.S), dtype=np.float32)]),
            np.concatenate([pr.fresh, np.zeros((b, self.S), dtype=bool)]))
        if self.store is not None:
            n = self.store.shape[0]
            self.store = self.store.grown(n + max(b - len(self._free), 0),
                                          max(r.prompt_len + r.gen_length for r in reqs))
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
        for name in _ROWS:
            setattr(self, name, getattr(self, name)[idx])
        self.x, self.commit_step, self.knobs = self.x[idx], self.commit_step[idx], self.knobs[idx]
        pr = self.preds
        self.preds = Predictions(pr.token[idx], pr.conf[idx], pr.entropy[idx], pr.fresh[idx])
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
        gen = max(r.gen_length for r in self.requests)
        self._resize(P - self.P, (P + gen) - (self.S + P - self.P))

    def _compact_store(self) -> None:
        """Give the pool's memory back once it holds more than twice what the rows use (one copy;
        so the store never holds more than twice the canvas area the scheduler budgets)."""
        n, width = self.store.shape
        used = max((r.prompt_len + r.gen_length for r in self.requests), default=0)
        if n * width <= 2 * len(self.requests) * used:
            return
        self.store = self.store.compacted(self.store_row, used)
        self.store_row = np.arange(len(self.requests))
        self._free = []

    def stored_tokens(self, rows: np.ndarray) -> np.ndarray:
        """(R', S) the token each slot of batch rows `rows` has K/V from in the store (-1: none)."""
        pos = self.slots[None, :] - self.pad[rows][:, None]
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
        for name in _SLOT_INDEX_ROWS:
            t = getattr(self, name)
            setattr(self, name, np.where(t >= 0, t + front, t) if name not in ("pad", "end")
                    else t + front)
        self.P += front
        self.S += front + back
