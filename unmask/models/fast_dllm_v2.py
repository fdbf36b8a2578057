"""Fast-dLLM v2 (`model_type: Fast_dLLM_Qwen`): Qwen2.5 layers attending block-causally.

The published folders (Efficient-Large-Model/Fast_dLLM_v2_1.5B and _7B: modeling.py,
configuration.py) hold Qwen2's layers under Qwen2's tensor names, q/k/v biases included, so the
layers are Dream's. Two things differ. Attention at inference is block-causal over blocks of
`bd_size` positions (its eval_block_diff_mask: a query's block, index // bd_size, sees its own
and earlier blocks), as SDAR's is. And it predicts position i from the hidden state at i - 1 (its
generate() shifts the logits right by one), as Dream does: `logit_shift` 1. The folders name no
mask token; the published generate() and batch_sample default to 151665 (`|<MASK>|` in the
tokenizer), which stands for it (`JsonKeys.fixed`). `FAST_DLLM_V2`
(unmask/formats/fast_dllm_v2.py) says what each config.json key does here.
"""

from __future__ import annotations

from torch import Tensor

from unmask.models.dream import DreamModel
from unmask.models.sdar import block_causal_mask


class FastDLLMV2Model(DreamModel):
    """Dream's layers and logit shift; without a frame a position attends to its own block and
    earlier ones."""


    def attention_mask(self, position_ids: Tensor) -> Tensor:
        return block_causal_mask(position_ids, self.config.block_size)
