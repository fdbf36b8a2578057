"""The model contract, written once: what the engine, the trainer and the evaluators may call.

A model is a plain forward over token ids at explicit positions; it knows nothing of masks,
steps, decoders or caching policies. What a call attends to beyond its own tokens is the
`Frame` (unmask.kv), passed per call.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from unmask.config import ModelConfig
from unmask.kv import Frame


@runtime_checkable
class DiffusionLM(Protocol):
    config: ModelConfig
    # Position i's prediction is read from the hidden state at i - logit_shift (Dream: 1).
    logit_shift: int

    def __call__(self, input_ids: Tensor, position_ids: Tensor, frame: Frame | None = None,
                 embeds: Tensor | None = None,
                 logits_at: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """input_ids, position_ids (B, T) -> logits (B, T, vocab_size), or (N, vocab_size) at
        the N (row, column) pairs of `logits_at`. frame: the per-call attention context (keys
        beyond the forwarded tokens, padding mask; it records the fresh K/V of every layer).
        embeds: (B, T, d_model) input embeddings replacing the lookup of input_ids."""
        ...

    def embed(self, input_ids: Tensor) -> Tensor:
        """(B, T) -> (B, T, d_model) input embeddings."""
        ...
