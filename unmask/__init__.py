"""unmask: a fast, exact inference engine for diffusion language models."""

__version__ = "0.1.0"
