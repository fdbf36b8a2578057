"""Hugging Face checkpoint folders: config.json, *.safetensors and tokenizer files.

Loading builds the model on the meta device and assigns memory-mapped tensors straight into it,
so a checkpoint never needs twice its size in RAM.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from unmask.config import ConfigError, ModelConfig
from unmask.errors import CheckpointError  # noqa: F401  (re-exported)
from unmask.models import build_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save_checkpoint(model: nn.Module, out_dir: str | Path,
                    tokenizer_dir: str | Path | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files copied from tokenizer_dir)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save(out)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copy(src, out / name)
    return out


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None) -> nn.Module:
    """The model in folder `path`, weights memory-mapped and moved to `device` in `dtype`.

    dtype None means the config's torch_dtype; raises CheckpointError naming what is wrong.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    try:
        config = ModelConfig.load(folder)
    except ConfigError as e:
        raise CheckpointError(f"{folder}: {e}") from e
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"dtype {dtype!r} is not supported; valid: {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype = dtype or DTYPES.get(config.torch_dtype, torch.float32)

    with torch.device("meta"):
        model = build_model(config)
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error type for corrupt files
            raise CheckpointError(f"{file.name} is not a readable safetensors file: {e}") from e
        with handle as f:
            for key in f.keys():
                if key not in expected:
                    raise CheckpointError(f"{file.name}: unexpected tensor {key!r} for "
                                          f"model_type {config.model_type}")
                t = f.get_tensor(key)
                if tuple(t.shape) != tuple(expected[key].shape):
                    raise CheckpointError(f"tensor {key!r} has shape {tuple(t.shape)}, config "
                                          f"expects {tuple(expected[key].shape)}")
                state[key] = t.to(device=device, dtype=dtype)
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{folder}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    model.load_state_dict(state, assign=True)
    return model.eval()
