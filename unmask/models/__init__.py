"""Model registry: one module per `model_type`, picked by the checkpoint's config."""

from __future__ import annotations

from torch import nn

from unmask.config import ModelConfig
from unmask.models.dream import DreamModel
from unmask.models.fast_dllm_v2 import FastDLLMV2Model
from unmask.models.llada import LLaDAModel
from unmask.models.llada2 import LLaDA2Model
from unmask.models.protocol import DiffusionLM
from unmask.models.sdar import SDARModel

REGISTRY: dict[str, type[nn.Module]] = {
    "llada": LLaDAModel, "Dream": DreamModel, "sdar": SDARModel, "llada2_moe": LLaDA2Model,
    "Fast_dLLM_Qwen": FastDLLMV2Model,
}


def build_model(config: ModelConfig) -> nn.Module:
    """An (uninitialised-weights) model for `config`; call `init_weights()` to train from scratch."""
    return REGISTRY[config.model_type](config)


__all__ = ["REGISTRY", "build_model", "DiffusionLM", "DreamModel", "FastDLLMV2Model", "LLaDAModel",
           "LLaDA2Model", "SDARModel"]
