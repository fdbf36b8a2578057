"""Model registry: one module per `model_type`, picked by the checkpoint's config."""

from __future__ import annotations

from torch import nn

from unmask.config import ModelConfig
from unmask.errors import InputError
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


def refuse_block_diffusion(model: nn.Module) -> None:
    """An InputError for a block-diffusion model (SDAR, LLaDA2, Fast-dLLM v2: config.block_size
    set). It loads and runs
    forwards, but the engine decodes bidirectional canvases only: decoding one block-causally
    trained would run it on attention it never saw, so generation is refused, not approximated."""
    c = getattr(model, "config", None)
    if getattr(c, "block_size", None) is not None:
        raise InputError(f"model_type {c.model_type} is a block-diffusion model (block_size "
                         f"{c.block_size}): block-diffusion decoding is not implemented yet, so "
                         "unmask cannot generate with it (it loads and runs forwards only)")


__all__ = ["REGISTRY", "build_model", "refuse_block_diffusion", "DiffusionLM", "DreamModel",
           "FastDLLMV2Model", "LLaDAModel", "LLaDA2Model", "SDARModel"]
