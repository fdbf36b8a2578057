"""unmask: a fast, exact inference engine for diffusion language models."""

__version__ = "0.1.0"

from unmask.api import LLM, Generation  # noqa: E402
from unmask.decoding.params import DecodeParams, SpecError  # noqa: E402

__all__ = ["LLM", "Generation", "DecodeParams", "SpecError", "__version__"]
