"""How LLaDA2 (`model_type: llada2_moe`) config.json keys map onto ModelConfig (`JsonKeys`);
the model itself is `LLaDA2Model` in `unmask/models/llada2.py`."""

from __future__ import annotations

from unmask.formats.keys import JsonKeys
from unmask.formats.sdar import SDAR

# Key names and meanings are those of the published configuration_llada2_moe.py. The variant
# keys below are ones the published modeling code does not read: it always computes the value
# listed, so a config asking for another is refused rather than run as that.
LLADA2 = JsonKeys(
    renamed=SDAR.renamed,  # Qwen3's names, head_dim included
    variants={
        "hidden_act": (("silu",), "the MLP activation"),
        "use_qkv_bias": ((False,), "biases on the q/k/v projection"),
        "use_bias": ((False,), "biases on the attention output projection"),
        "use_qk_norm": ((True,), "RMSNorm of each q and k head"),
        "use_rmsnorm": ((True,), "RMSNorm layer norms"),
        "norm_head": ((False,), "a normalised LM head"),
        "norm_softmax": ((False,), "a normalised softmax"),
        "use_sliding_window": ((False,), "sliding-window attention"),
        "using_split_qkv_in_self_attention": ((False,), "separate q/k/v projections"),
        "score_function": (("sigmoid",), "the router's expert scores"),
        "norm_topk_prob": ((True,), "the chosen experts' weights renormalised to sum 1"),
        "moe_router_enable_expert_bias": ((True,), "the router's selection bias"),
        "router_dtype": (("fp32",), "the router's dtype"),
    },
    inert=frozenset({
        # read only with use_sliding_window, refused above
        "sliding_window", "max_window_layers",
        # the rotated width is head_dim * partial_rotary_factor; the modeling code never reads this
        "rotary_dim",
        # dropout is off at inference in the reference too
        "attention_dropout", "embedding_dropout", "output_dropout",
        # training: initialisation, the router's auxiliary outputs
        "initializer_range", "output_router_logits",
        # the tokenizer's and the engine's business; no weight depends on them
        "bos_token_id", "pad_token_id",
        # packaging
        "architectures", "auto_map", "transformers_version", "use_cache", "_name_or_path",
    }),
    omitted=frozenset({"embedding_size", "include_bias", "qkv_bias", "rope_full_precision"}),
    fixed={"mask_token_id": 156895, "eos_token_id": 156892, "block_size": 32},
    # the first published configuration file applies q/k norm without a key; the later one
    # reads use_qk_norm, default true
    implied=frozenset({"use_qk_norm"}),
    written={"architectures": ["LLaDA2MoeModelLM"]},
)
