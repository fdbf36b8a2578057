"""How Fast-dLLM v2 (`model_type: Fast_dLLM_Qwen`) config.json keys map onto ModelConfig (`JsonKeys`);
the model itself is `FastDLLMV2Model` in `unmask/models/fast_dllm_v2.py`."""

from __future__ import annotations

from typing import Any

from unmask.errors import ConfigError
from unmask.formats.dream import DREAM
from unmask.formats.keys import JsonKeys, show


def _prepare(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's null key_value heads, and layer_types refused unless every layer attends fully
    (its modeling code gives a "sliding_attention" layer a window)."""
    kinds = raw.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list)
                              or any(k != "full_attention" for k in kinds)):
        raise ConfigError(f"config key 'layer_types' = {show(kinds)} is not supported; unmask "
                          "builds every layer as \"full_attention\"")
    return DREAM.prepare(raw)


# Key names and meanings are those of the published configuration.py: Qwen2's (as Dream reads
# them) plus bd_size, the block size it was trained with.
_QWEN = DREAM
FAST_DLLM_V2 = JsonKeys(
    renamed={**_QWEN.renamed, "bd_size": "block_size"},
    variants=_QWEN.variants,
    inert=_QWEN.inert | {
        # checked by _prepare: every layer full attention
        "layer_types",
        # training: the complementary-mask objective
        "conplemenrary_mask",
    },
    omitted=_QWEN.omitted - {"block_size"},
    fixed={"mask_token_id": 151665},
    written={"architectures": ["Fast_dLLM_QwenForCausalLM"]},
    prepare=_prepare,
)
