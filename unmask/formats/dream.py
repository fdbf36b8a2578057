"""How Dream (`model_type: Dream`) config.json keys map onto ModelConfig (`JsonKeys`);
the model itself is `DreamModel` in `unmask/models/dream.py`."""

from __future__ import annotations

from typing import Any

from unmask.formats.keys import MOE_FIELDS, JsonKeys


def _prepare(raw: dict[str, Any]) -> dict[str, Any]:
    """The value Qwen2's configuration derives when a key is null."""
    if raw.get("num_key_value_heads") is None:
        raw["num_key_value_heads"] = raw.get("num_attention_heads")
    return raw


# Key names and meanings are those of Qwen2's configuration (Dream's configuration file is a copy).
DREAM = JsonKeys(
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
