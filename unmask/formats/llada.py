"""How LLaDA (`model_type: llada`) config.json keys map onto ModelConfig (`JsonKeys`);
the model itself is `LLaDAModel` in `unmask/models/llada.py`."""

from __future__ import annotations

from typing import Any

from unmask.errors import ConfigError
from unmask.formats.keys import MOE_FIELDS, JsonKeys


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
LLADA = JsonKeys(
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
