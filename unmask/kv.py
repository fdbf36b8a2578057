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

    k: list[Tensor]
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
        """The store for a gathered set of rows (e.g. one copy per FreeDave draft)."""
        return KVStore([k[index] for k in self.k], [v[index] for v in self.v], self.token[index])

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
