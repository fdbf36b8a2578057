"""Model registry: one module per `model_type`, picked by the checkpoint's config."""

from __future__ import annotations

from torch import nn

from unmask.config import ModelConfig
from unmask.models.dream import DreamModel
from unmask.models.llada import LLaDAModel
from unmask.models.protocol import DiffusionLM
from unmask.models.sdar import SDARModel

REGISTRY: dict[str, type[nn.Module]] = {"llada": LLaDAModel, "Dream": DreamModel, "sdar": SDARModel}


def build_model(config: ModelConfig) -> nn.Module:
    """An (uninitialised-weights) model for `config`; call `init_weights()` to train from scratch."""
    return REGISTRY[config.model_type](config)


__all__ = ["REGISTRY", "build_model", "DiffusionLM", "DreamModel",
           "LLaDAModel", "SDARModel"]
