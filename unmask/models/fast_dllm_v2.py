"""Fast-dLLM v2 (`model_type: Fast_dLLM_Qwen`): Qwen2.5 layers attending block-causally.

The published folders (Efficient-Large-Model/Fast_dLLM_v2_1.5B and _7B: modeling.py,
configuration.py) hold Qwen2's layers under Qwen2's tensor names, q/k/v biases included, so the
layers are Dream's. Two things differ. Attention at inference is block-causal over blocks of
`bd_size` positions (its eval_block_diff_mask: a query's block, index // bd_size, sees its own
and earlier blocks), as SDAR's is. And it predicts position i from the hidden state at i - 1 (its
generate() shifts the logits right by one), as Dream does: `logit_shift` 1. The folders name no
mask token; the published generate() and batch_sample default to 151665 (`|<MASK>|` in the
tokenizer), which stands for it (`JsonKeys.fixed`). `FastDLLMV2Model.json_keys` says what each
config.json key does here.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from unmask.config import ConfigError, JsonKeys, _show
from unmask.models.dream import DreamModel
from unmask.models.sdar import block_causal_mask


class FastDLLMV2Model(DreamModel):
    """Dream's layers and logit shift; without a frame a position attends to its own block and
    earlier ones."""

    json_keys: JsonKeys  # set below the class

    def attention_mask(self, position_ids: Tensor) -> Tensor:
        return block_causal_mask(position_ids, self.config.block_size)


def _prepare(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's null key_value heads, and layer_types refused unless every layer attends fully
    (its modeling code gives a "sliding_attention" layer a window)."""
    kinds = raw.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list)
                              or any(k != "full_attention" for k in kinds)):
        raise ConfigError(f"config key 'layer_types' = {_show(kinds)} is not supported; unmask "
                          "builds every layer as \"full_attention\"")
    return DreamModel.json_keys.prepare(raw)


# Key names and meanings are those of the published configuration.py: Qwen2's (as Dream reads
# them) plus bd_size, the block size it was trained with.
_QWEN = DreamModel.json_keys
FastDLLMV2Model.json_keys = JsonKeys(
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
