"""How SDAR (`model_type: sdar`) config.json keys map onto ModelConfig (`JsonKeys`);
the model itself is `SDARModel` in `unmask/models/sdar.py`."""

from __future__ import annotations

from unmask.formats.dream import DREAM
from unmask.formats.keys import MOE_FIELDS, JsonKeys

# Key names and meanings are those of SDAR's configuration file (JetAstra/SDAR,
# training/model/SDAR-*-Chat/configuration_sdar.py): Qwen3's keys, which are Qwen2's as Dream reads
# them plus head_dim and attention_bias, and SDAR's block_size and mask_token_id.
_QWEN = DREAM
SDAR = JsonKeys(
    renamed={**_QWEN.renamed, "head_dim": "head_size"},
    variants={**_QWEN.variants, "attention_bias": ((False,), "biases on the q/k/v/o projections")},
    inert=_QWEN.inert | {
        # training: the training attention kernel (inference attends by the mask it is given,
        # whatever this says), the fused training loss, expert parallelism (MoE variants only),
        # and settings SDAR's modeling file never reads
        "attn_implementation", "fuse_cross_entropy", "ep_size", "use_deepep", "debug",
        "micro_forward", "skip_checkpoint",
    },
    omitted=frozenset({"embedding_size", "include_bias", "qkv_bias", "rope_full_precision",
                       *MOE_FIELDS}),
    written={"architectures": ["SDARForCausalLM"]},
    prepare=_QWEN.prepare,  # Qwen's: null num_key_value_heads = num_attention_heads
)
