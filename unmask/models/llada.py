"""LLaDA (`model_type: llada`): a LLaMA block stack with bidirectional attention.

Module names mirror the public checkpoint's tensor names (model.transformer.blocks.N.q_proj...),
so state_dict() keys are the safetensors keys with no renaming table. `LLaDAModel.json_keys`
says what each key of LLaDA's OLMo-style config.json does here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from unmask.config import MOE_FIELDS, ConfigError, JsonKeys, ModelConfig
from unmask.kv import Frame
from unmask.models.layers import RMSNorm, attention, embedding, init_weights, rope_cos_sin, swiglu


class LLaDABlock(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = c.n_heads, c.n_kv_heads
        kv_dim = c.n_kv_heads * c.head_dim
        bias, qkv_bias = c.include_bias, c.include_bias or c.qkv_bias
        self.attn_norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.q_proj = nn.Linear(c.d_model, c.d_model, bias=qkv_bias)
        self.k_proj = nn.Linear(c.d_model, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(c.d_model, kv_dim, bias=qkv_bias)
        self.attn_out = nn.Linear(c.d_model, c.d_model, bias=bias)
        self.ff_norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.ff_proj = nn.Linear(c.d_model, c.mlp_hidden_size, bias=bias)  # SiLU-gated branch
        self.up_proj = nn.Linear(c.d_model, c.mlp_hidden_size, bias=bias)
        self.ff_out = nn.Linear(c.mlp_hidden_size, c.d_model, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, frame: Frame | None) -> Tensor:
        h = self.attn_norm(x)
        x = x + self.attn_out(attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), cos, sin,
                                        self.n_heads, self.n_kv_heads, frame))
        return x + swiglu(self.ff_norm(x), self.ff_proj, self.up_proj, self.ff_out)


class LLaDAModel(nn.Module):
    logit_shift = 0  # position i is predicted from the hidden state at i
    json_keys: JsonKeys  # set below the class

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        t = nn.ModuleDict({
            "wte": embedding(config.embedding_size, config.d_model),
            "blocks": nn.ModuleList(LLaDABlock(config) for _ in range(config.n_layers)),
            "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
        })
        if not config.weight_tying:
            t["ff_out"] = nn.Linear(config.d_model, config.embedding_size, bias=False)
        self.model = nn.Module()
        self.model.transformer = t

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.transformer.wte(input_ids)

    def forward(self, input_ids: Tensor, position_ids: Tensor, frame: Frame | None = None,
                embeds: Tensor | None = None, logits_at: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """input_ids, position_ids: (B, T) -> logits (B, T, vocab_size).

        embeds: optional (B, T, d_model) input embeddings replacing the lookup of input_ids.
        logits_at: optional (rows, cols) index tensors; then only those N positions get the
        LM head and the result is (N, vocab_size) — decoders score a few positions of many.
        """
        t = self.model.transformer
        c = self.config
        x = self.embed(input_ids) if embeds is None else embeds
        rope_dtype = torch.float32 if c.rope_full_precision else x.dtype
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, rope_dtype)
        for block in t.blocks:
            x = block(x, cos, sin, frame)
        x = t.ln_f(x if logits_at is None else x[logits_at])
        head = t.wte.weight if self.config.weight_tying else t.ff_out.weight
        return (x @ head.T)[..., : self.config.vocab_size]

    def init_weights(self, std: float = 0.02) -> None:
        blocks = self.model.transformer.blocks
        init_weights(self, [lin for b in blocks for lin in (b.attn_out, b.ff_out)],
                     self.config.n_layers, std)


def _prepare(raw: dict[str, Any]) -> dict[str, Any]:
    """The values LLaDA's configuration file derives when a key is null or absent."""
    if raw.get("n_kv_heads") is None and raw.get("multi_query_attention") is None:
        raw["n_kv_heads"] = raw.get("n_heads")
    if raw.get("mlp_hidden_size") is None and "d_model" in raw:
        ratio, width = raw.get("mlp_ratio") or 4, raw["d_model"]
        if not _is_number(ratio):
            raise ConfigError(f"config key 'mlp_ratio' must be a number, got {ratio!r}")
        # a bad d_model is named by ModelConfig's type check; "abc" * 4 would hide it
        raw["mlp_hidden_size"] = ratio * width if _is_number(width) else None
    for key in ("embedding_size", "include_qkv_bias", "rope_full_precision"):
        if raw.get(key) is None:
            raw.pop(key, None)  # ModelConfig's None: the reference default
    return raw


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Key names and meanings are those of the public LLaDA configuration file (OLMo's config).
LLaDAModel.json_keys = JsonKeys(
    renamed={"include_qkv_bias": "qkv_bias"},
    variants={
        "activation_type": (("silu",), "the MLP activation"),
        "alibi": ((False,), "ALiBi attention biases"),
        "attention_layer_norm": ((False,), "layer norms on q and k"),
        # null: follow include_bias, which is false
        "bias_for_layer_norm": ((False, None), "biases in the layer norms"),
        "block_group_size": ((1,), "blocks grouped under other tensor names"),
        "block_type": (("llama",), "the transformer block"),
        "clip_qkv": ((None,), "clipping of q, k and v"),
        "input_emb_norm": ((False,), "scaling the input embeddings by sqrt(d_model)"),
        "layer_norm_type": (("rms",), "the layer norm"),
        "layer_norm_with_affine": ((True,), "layer norm weights"),
        # null: n_kv_heads decides the K/V heads
        "multi_query_attention": ((None,), "K/V heads set apart from n_kv_heads"),
        "rope": ((True,), "rotary position embeddings"),
        "scale_logits": ((False,), "logits scaled by 1/sqrt(d_model)"),
    },
    inert=frozenset({
        # read only by variants refused above (alibi, attention_layer_norm)
        "alibi_bias_max", "attention_layer_norm_with_affine",
        # mlp_hidden_size wins when set; _prepare derives it from mlp_ratio otherwise
        "mlp_ratio",
        # dropout is off at inference in the reference too
        "attention_dropout", "embedding_dropout", "residual_dropout",
        # training: initialisation and mixed precision (torch_dtype sets the dtype we run in)
        "init_cutoff_factor", "init_device", "init_fn", "init_std", "precision",
        # which attention kernel computes the same attention
        "flash_attention",
        # padding is the tokenizer's and the engine's business; no weight depends on it
        "pad_token_id",
        # packaging
        "architectures", "auto_map", "transformers_version", "use_cache", "_name_or_path",
    }),
    omitted=frozenset({"rope_scaling", "head_size", "block_size", *MOE_FIELDS}),
    written={"architectures": ["LLaDAModelLM"]},
    prepare=_prepare,
)
