"""unmask: a fast, exact inference engine for diffusion language models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unmask._lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:
    from unmask.api import LLM, Generation
    from unmask.decoding.params import DecodeParams, SpecError

__all__ = ["LLM", "Generation", "DecodeParams", "SpecError", "__version__"]

# Imported on first use, so that `import unmask.cli` (and `unmask --help`) does not load torch.
__getattr__ = lazy_exports(__name__, {"LLM": "unmask.api", "Generation": "unmask.api",
                                      "DecodeParams": "unmask.decoding.params",
                                      "SpecError": "unmask.decoding.params"})
