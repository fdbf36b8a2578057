"""K/V state that a forward may attend to, written and read by canvas slot.

The model knows nothing of caching policies: every attention layer hands its fresh K/V to the
`Frame` and gets back the keys to attend over. A policy (``unmask.caching``) decides which slots
are forwarded and which are read from the store; the model code is the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class KVStore:
    """Per-layer K/V of every canvas slot from the last time it was forwarded.

    k[layer], v[layer]: (B, H_kv, S, D). token: (B, S) the token each slot's K/V was computed
    from, -1 where the slot holds none (never forwarded, or dropped by `invalidate`). A slot
    committed since its forward holds K/V of its old [MASK], which a policy may recompute.
    """

    k: list[Tensor]  # or a per-layer row view (`rows`)
    v: list[Tensor]
    token: Tensor

    @property
    def valid(self) -> Tensor:
        """(B, S) bool: the slot holds K/V."""
        return self.token >= 0

    @classmethod
    def empty(cls, n_layers: int, batch: int, n_kv_heads: int, slots: int, head_dim: int,
              dtype: torch.dtype, device: torch.device) -> KVStore:
        shape = (batch, n_kv_heads, slots, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)],
            token=torch.full((batch, slots), -1, dtype=torch.long, device=device),
        )

    def rows(self, index: Tensor) -> KVStore:
        """The store as seen by a gathered set of rows (e.g. FreeDave's drafts, several per
        row). K/V are gathered one layer at a time when attention reads them, so no copy of the
        whole store is ever made; the per-layer gather lives as long as that layer's attention."""
        return KVStore(_Gathered(self.k, index), _Gathered(self.v, index), self.token[index])

    # --- membership (batch rows join and leave; not per step) ---------------------------------
    def cat_rows(self, n: int) -> KVStore:
        """This store with `n` empty rows appended."""
        def grow(t: Tensor, fill: float) -> Tensor:
            return torch.cat([t, torch.full((n, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)])
        return KVStore([grow(k, 0) for k in self.k], [grow(v, 0) for v in self.v],
                       grow(self.token, -1))

    def select_rows(self, index: Tensor) -> KVStore:
        """A compacted store of `index`'s rows (finished rows leave)."""
        return KVStore([k[index] for k in self.k], [v[index] for v in self.v], self.token[index])

    def resize_slots(self, front: int, back: int) -> KVStore:
        """Add (negative: drop) `front` empty slots before and `back` after every row."""
        def pad(t: Tensor, dim: int, fill: float) -> Tensor:
            t = t.narrow(dim, max(-front, 0), t.shape[dim] - max(-front, 0) - max(-back, 0))
            parts = [t]
            for n, at in ((front, 0), (back, 1)):
                if n > 0:
                    shape = list(t.shape)
                    shape[dim] = n
                    part = torch.full(shape, fill, dtype=t.dtype, device=t.device)
                    parts.insert(len(parts) * at, part)
            return torch.cat(parts, dim=dim) if len(parts) > 1 else t.contiguous()
        return KVStore([pad(k, 2, 0) for k in self.k], [pad(v, 2, 0) for v in self.v],
                       pad(self.token, 1, -1))

    def invalidate(self, rows: Tensor) -> None:
        """Forget every slot of ``rows`` (a refresh rebuilds them)."""
        self.token[rows] = -1

    def write(self, rows: Tensor, slots: Tensor, fresh: list[tuple[Tensor, Tensor]],
              ok: Tensor, tokens: Tensor) -> None:
        """Store fresh K/V (one (k, v) per layer, each (R, H_kv, T, D)) at `slots` (R, T) of
        `rows` (R,), computed from `tokens` (R, T); entries with ok=False (padding queries) are
        skipped."""
        r_idx, t_idx = ok.nonzero(as_tuple=True)
        if r_idx.numel() == 0:
            return
        b = rows[r_idx]
        s = slots[r_idx, t_idx]
        for layer, (k, v) in enumerate(fresh):
            # k[r_idx, :, t_idx] is (N, H_kv, D): advanced indices go first.
            self.k[layer][b, :, s] = k[r_idx, :, t_idx]
            self.v[layer][b, :, s] = v[r_idx, :, t_idx]
        self.token[b, s] = tokens[r_idx, t_idx]


class _Gathered:
    """Per-layer tensors (B, ...) read through a row index: layer i is gathered on access."""

    def __init__(self, layers: list[Tensor], index: Tensor) -> None:
        self.layers, self.index = layers, index

    def __getitem__(self, layer: int) -> Tensor:
        return self.layers[layer][self.index]

    def __len__(self) -> int:
        return len(self.layers)


@dataclass
class Frame:
    """What the T forwarded tokens of one call attend to.

    key_mask: (B, T) bool, which forwarded tokens are keys (False: batch padding).
    past / past_mask: optional store and (B, S) bool of its slots to attend to in addition.
    attn_mask: optional (B, 1, T, K) bool overriding everything (tests use it for causal masks).
    After the forward, `fresh` holds each layer's (k, v) of the forwarded tokens.
    """

    key_mask: Tensor | None = None
    past: KVStore | None = None
    past_mask: Tensor | None = None
    attn_mask: Tensor | None = None
    fresh: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def keys(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Record the layer's fresh K/V; return keys, values and the (B,1,T|1,K) mask."""
        self.fresh.append((k, v))
        if self.attn_mask is not None:
            return k, v, self.attn_mask
        mask = self.key_mask
        if self.past is not None:
            k = torch.cat([self.past.k[layer], k], dim=2)
            v = torch.cat([self.past.v[layer], v], dim=2)
            new = mask if mask is not None else torch.ones(
                k.shape[0], k.shape[2] - self.past_mask.shape[1], dtype=torch.bool, device=k.device)
            mask = torch.cat([self.past_mask, new], dim=1)
        if mask is None:
            return k, v, None
        return k, v, mask[:, None, None, :]  # (B, 1, 1, K): same keys for every query
