"""Checkpoint formats: how each family's config.json maps onto ModelConfig (unmask/config.py), one
module per family, named as its model file in unmask/models/, registered here by `model_type`."""

from __future__ import annotations

from unmask.formats.dream import DREAM
from unmask.formats.fast_dllm_v2 import FAST_DLLM_V2
from unmask.formats.keys import JsonKeys
from unmask.formats.llada import LLADA
from unmask.formats.llada2 import LLADA2
from unmask.formats.sdar import SDAR

FORMATS: dict[str, JsonKeys] = {
    "llada": LLADA, "Dream": DREAM, "sdar": SDAR, "llada2_moe": LLADA2, "Fast_dLLM_Qwen": FAST_DLLM_V2,
}
