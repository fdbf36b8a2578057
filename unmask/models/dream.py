"""Dream (`model_type: Dream`): the Qwen2 layout with bidirectional attention.

Dream predicts position i from the hidden state at i-1. `forward` returns the raw per-token
logits (as Qwen2 does); `logit_shift = 1` tells the decoding runner to read position i's
prediction from token i-1, which stays correct when a forward covers only a subset of positions.
`DreamModel.json_keys` says what each key of Dream's Qwen2-style config.json does here.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from unmask.config import MOE_FIELDS, JsonKeys, ModelConfig
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
    json_keys: JsonKeys  # set below the class


def _prepare(raw: dict[str, Any]) -> dict[str, Any]:
    """The value Qwen2's configuration derives when a key is null."""
    if raw.get("num_key_value_heads") is None:
        raw["num_key_value_heads"] = raw.get("num_attention_heads")
    return raw


# Key names and meanings are those of Qwen2's configuration (Dream's configuration file is a copy).
DreamModel.json_keys = JsonKeys(
    renamed={
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "num_hidden_layers": "n_layers",
        "intermediate_size": "mlp_hidden_size",
        "max_position_embeddings": "max_sequence_length",
        "tie_word_embeddings": "weight_tying",
    },
    variants={
        "hidden_act": (("silu",), "the MLP activation"),
        "use_sliding_window": ((False,), "sliding-window attention"),
    },
    inert=frozenset({
        # read only with use_sliding_window, refused above
        "sliding_window", "max_window_layers",
        # dropout is off at inference in the reference too
        "attention_dropout",
        # training initialisation
        "initializer_range",
        # the tokenizer's and the engine's business; no weight depends on them
        "bos_token_id", "pad_token_id",
        # packaging
        "architectures", "auto_map", "transformers_version", "use_cache", "_name_or_path",
    }),
    omitted=frozenset({"embedding_size", "include_bias", "qkv_bias", "rope_full_precision",
                       "head_size", "block_size", *MOE_FIELDS}),
    written={"architectures": ["DreamModel"]},
    prepare=_prepare,
)
