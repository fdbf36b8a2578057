"""Dream (`model_type: Dream`): the Qwen2 layout with bidirectional attention.

Dream predicts position i from the hidden state at i-1. `forward` returns the raw per-token
logits (as Qwen2 does); `logit_shift = 1` tells the decoding runner to read position i's
prediction from token i-1, which stays correct when a forward covers only a subset of positions.
`DreamModel.json_keys` says what each key of Dream's Qwen2-style config.json does here.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from unmask.config import JsonKeys, ModelConfig
from unmask.kv import Frame
from unmask.models.layers import RMSNorm, attention, embedding, init_weights, rope_cos_sin, swiglu


class DreamAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        kv_dim = c.n_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.d_model, c.d_model, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.d_model, kv_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.d_model, kv_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.d_model, c.d_model, bias=False)


class DreamMLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.mlp_hidden_size, bias=False)
        self.down_proj = nn.Linear(c.mlp_hidden_size, c.d_model, bias=False)


class DreamLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads = c.n_heads, c.n_kv_heads
        self.self_attn = DreamAttention(c)
        self.mlp = DreamMLP(c)
        self.input_layernorm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.d_model, c.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, frame: Frame | None) -> Tensor:
        a, h = self.self_attn, self.input_layernorm(x)
        x = x + a.o_proj(attention(a.q_proj(h), a.k_proj(h), a.v_proj(h), cos, sin,
                                   self.n_heads, self.n_kv_heads, self.layer, frame))
        m = self.mlp
        return x + swiglu(self.post_attention_layernorm(x), m.gate_proj, m.up_proj, m.down_proj)


class DreamModel(nn.Module):
    logit_shift = 1
    json_keys: JsonKeys  # set below the class

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = embedding(config.vocab_size, config.d_model)
        self.model.layers = nn.ModuleList(DreamLayer(config, i) for i in range(config.n_layers))
        self.model.norm = RMSNorm(config.d_model, config.rms_norm_eps)
        if not config.weight_tying:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: Tensor, position_ids: Tensor, frame: Frame | None = None,
                embeds: Tensor | None = None, logits_at: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """input_ids, position_ids: (B, T) -> unshifted logits (B, T, vocab_size).

        logits_at: optional (rows, cols); then only those N positions' logits, (N, vocab_size).
        """
        c = self.config
        x = self.embed(input_ids) if embeds is None else embeds
        # Qwen2 rounds cos/sin to the model dtype and rotates there.
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, x.dtype, c.rope_factor())
        for layer in self.model.layers:
            x = layer(x, cos, sin, frame)
        x = self.model.norm(x if logits_at is None else x[logits_at])
        head = self.model.embed_tokens.weight if self.config.weight_tying else self.lm_head.weight
        return x @ head.T

    def init_weights(self, std: float = 0.02) -> None:
        layers = self.model.layers
        init_weights(self, [lin for ly in layers for lin in (ly.self_attn.o_proj, ly.mlp.down_proj)],
                     self.config.n_layers, std)


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
    omitted=frozenset({"embedding_size", "include_bias", "qkv_bias", "rope_full_precision"}),
    written={"architectures": ["DreamModel"]},
    prepare=_prepare,
)
