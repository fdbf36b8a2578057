"""Dream (`model_type: Dream`): the Qwen2 layout with bidirectional attention.

Dream predicts position i from the hidden state at i-1. `forward` returns the raw per-token
logits (as Qwen2 does); `logit_shift = 1` tells the decoding runner to read position i's
prediction from token i-1, which stays correct when a forward covers only a subset of positions.
`DREAM` (unmask/formats/dream.py) says what each key of Dream's Qwen2-style config.json does here.
"""

from __future__ import annotations

from torch import Tensor, nn

from unmask.config import ModelConfig
from unmask.models.qwen import QwenLayer, QwenLM


class DreamAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        kv_dim = c.n_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.d_model, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.d_model, kv_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.d_model, kv_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.d_model, c.d_model, bias=False)

    def queries_keys(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.q_proj(h), self.k_proj(h)


class DreamLayer(QwenLayer):
    attention_class = DreamAttention


class DreamModel(QwenLM):
    """Bidirectional: without a frame every position attends to every other."""

    logit_shift = 1
    layer_class = DreamLayer
