"""Hugging Face checkpoint folders: config.json, *.safetensors (one file, or shards listed in
model.safetensors.index.json) and tokenizer files.

Loading builds the model on the meta device and assigns memory-mapped tensors straight into it,
one shard at a time, so a checkpoint never needs twice its size in RAM: in the file's dtype on
the CPU the weights stay mapped; otherwise each tensor is converted as it is read, and the peak
is about one copy in the target dtype plus the shard being read. A load that quantizes reads
each tensor into its own buffer instead (safetensors' "pread" backend, `READ_BACKEND`): a mapped
file's pages stay resident in the process until its last tensor is read, which made a
single-file load's peak the whole float file plus the quantized weights; on the CPU it reads a
block linear's weight a slice of rows at a time (`Stored.slices`), each quantized before the next
is read, so that no float copy of a whole weight is made.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from unmask.config import TORCH_DTYPES, ConfigError, ModelConfig
from unmask.errors import CheckpointError  # noqa: F401  (re-exported)
from unmask.models import build_model
from unmask.packing import PackedLinear, packs
from unmask.quantize import (
    QUANTIZED_FILE,
    LoadQuantizer,
    check_saveable,
    load_quantized,
    load_quantizer,
    quantized_scheme,
    save_quantized,
)
from unmask.weights import LayerLoader

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DTYPES = {name: getattr(torch, name) for name in TORCH_DTYPES}
INDEX = "model.safetensors.index.json"
# How a load reads a file's tensors: mapped when the tensors are kept as they are read, read
# into buffers freed once converted (quantized, packed) when they are not (module docstring).
# Measured on a 640 MiB float32 single file loaded as int8 (scripts/probe/load_memory.py): peak
# 840 MiB mapped, 240-252 MiB read.
READ_BACKEND = {False: "mmap", True: "pread"}  # by whether the load converts the weights


def save_checkpoint(model: nn.Module, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                    max_shard_size: int | None = None) -> Path:
    """Write config.json + the weights (+ tokenizer files copied from tokenizer_dir).

    max_shard_size (bytes): None writes one model.safetensors; otherwise shards of at most that
    many bytes of tensor data (a larger tensor gets a shard of its own), named
    model-0000i-of-0000n.safetensors and listed in model.safetensors.index.json. A model
    quantized with torchao is written as one unmask.quantize.QUANTIZED_FILE instead. Weight
    files of an earlier save to the same folder are removed first, so the folder has one set.
    """
    if max_shard_size is not None and (isinstance(max_shard_size, bool)
                                       or not isinstance(max_shard_size, int) or max_shard_size <= 0):
        raise CheckpointError(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    check_saveable(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX, out / QUANTIZED_FILE]:
        old.unlink(missing_ok=True)
    scheme = quantized_scheme(model)
    if scheme is not None:  # torchao tensors: torch.save, as torchao documents (unmask.quantize)
        if max_shard_size is not None:
            raise CheckpointError("a quantized model is saved as one file; leave max_shard_size unset")
        state = model.state_dict()
        _written_config(model.config, state).save(out)
        save_quantized(state, scheme, out)
    else:
        _save_safetensors(model, out, max_shard_size)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file() and src.resolve() != (out / name).resolve():
                shutil.copy(src, out / name)
    return out


def _save_safetensors(model: nn.Module, out: Path, max_shard_size: int | None) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    _written_config(model.config, state).save(out)
    shards = _split(state, max_shard_size)
    if max_shard_size is None:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map: dict[str, str] = {}
        for i, names in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: state[k] for k in names}, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, name))
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _written_config(config: ModelConfig, state: dict[str, torch.Tensor]) -> ModelConfig:
    """config with torch_dtype set to the dtype of the weights saved. A model loaded in bfloat16
    from a float32 folder was saved with torch_dtype float32, and so reloaded in float32: twice
    the memory, no more precision. Weights in several dtypes, or in one no config can name
    (float64), keep the config's torch_dtype; loading casts them to it."""
    names = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    if len(names) == 1 and (name := names.pop()) in TORCH_DTYPES and name != config.torch_dtype:
        return dataclasses.replace(config, torch_dtype=name)
    return config


def _split(state: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    """Tensor names in state order, cut into runs of at most max_bytes (None: one run)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def load_model(path: str | Path, device: str | torch.device = "cpu",
               dtype: str | torch.dtype | None = None, quantize: str | None = None,
               pack: bool = False) -> nn.Module:
    """The model in folder `path`, weights memory-mapped and moved to `device` in `dtype`.

    dtype None means the config's torch_dtype, on every device; bfloat16 or float16 on the CPU
    warns once, naming the dtype it runs in. quantize: "int8" / "int4" / "w8a8" converts the
    block linear weights as they are read (unmask.quantize.load_quantizer), so the float weights
    of one tensor (on the CPU: a slice of its rows; w8a8: one layer) are held at a time; a folder
    saved quantized loads as saved
    whatever it says (LLM checks the two agree). pack: a load in bfloat16 on a CPU with oneDNN's
    bfloat16 kernel packs the block linears for it (unmask.packing) as they are read, a layer at
    a time (elsewhere, and with quantize, nothing). Raises CheckpointError naming what is wrong.
    """
    folder = Path(path)
    if not folder.is_dir():
        from unmask.hub import SHIPPED

        what = "is not a folder" if folder.exists() else "does not exist"
        raise CheckpointError(f"model folder {folder} {what} (a model name is a folder, a hub id "
                              f"org/name, or a shipped model: {', '.join(SHIPPED)})")
    try:
        config = ModelConfig.load(folder)
    except ConfigError as e:  # its message names the folder already
        raise CheckpointError(str(e)) from e
    quantized = (folder / QUANTIZED_FILE).is_file()
    # a quantized folder runs in the dtype it was saved in: no advice to load it in another
    dtype = _resolve_dtype(config, torch.device(device), dtype, advise=not quantized)
    with torch.device("meta"):
        model = build_model(config)
    try:
        if quantized:
            return load_quantized(folder, model, torch.device(device), dtype)
        return _load_weights(folder, model, config, device, dtype,
                             _converter(model, quantize, pack, dtype, torch.device(device)))
    except CheckpointError as e:  # which folder: a command may name several, or a hub id
        if str(folder) in str(e):
            raise
        raise CheckpointError(f"{folder}: {e}") from e


def _converter(model: nn.Module, quantize: str | None, pack: bool, dtype: torch.dtype,
               device: torch.device) -> LoadQuantizer | LayerLoader | None:
    """What converts the block linear weights as load_model reads them, if anything."""
    if quantize is not None:
        return load_quantizer(model, quantize, dtype, device)
    if pack and packs(dtype, device):
        return LayerLoader(model, PackedLinear)
    return None


def _load_weights(folder: Path, model: nn.Module, config: ModelConfig,
                  device: str | torch.device, dtype: torch.dtype,
                  quantizer: LoadQuantizer | LayerLoader | None) -> nn.Module:
    """`model` (on the meta device) with the folder's safetensors weights assigned, each
    checked against the config's names and shapes (a CheckpointError naming the file or tensor),
    and its block linear weights converted as they are read by `quantizer`, if any."""
    files = weight_files(folder)
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file, names in files.items():
        for key, stored in _read(file, names, READ_BACKEND[quantizer is not None]):
            if key in origin:
                raise CheckpointError(f"tensor {key!r} is in both {origin[key]} and {file.name}")
            origin[key] = file.name
            if key not in expected:
                raise CheckpointError(f"{file.name}: unexpected tensor {key!r} for "
                                      f"model_type {config.model_type}")
            if stored.shape != tuple(expected[key].shape):
                raise CheckpointError(f"tensor {key!r} has shape {stored.shape}, config "
                                      f"expects {tuple(expected[key].shape)}")
            rows = None if quantizer is None else quantizer.slice_rows(key, dtype, device)
            if rows is not None:  # never read whole: converted a slice of rows at a time
                state[key] = quantizer.join(key, (_convert(file, key, t, device, dtype)
                                                  for t in stored.slices(rows)))
                continue
            state[key] = _convert(file, key, stored.read(), device, dtype)
            if quantizer is not None:
                state[key] = quantizer(key, state[key])
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    model.load_state_dict(state, assign=True)
    if quantizer is not None:
        quantizer.finish(model)
    return model.eval()


def _convert(file: Path, key: str, t: torch.Tensor, device: str | torch.device,
             dtype: torch.dtype) -> torch.Tensor:
    """Tensor `key` of `file` (or a slice of its rows) on `device` in `dtype`; CheckpointError
    for a dtype that is not floating point, and for values not finite in `dtype`."""
    if not t.is_floating_point():  # casting int/bool/complex weights gives silent garbage
        raise CheckpointError(f"{file.name}: tensor {key!r} has dtype {t.dtype}; weights "
                              "must be floating point (float32, bfloat16, float16, ...)")
    out = t.to(device=device, dtype=dtype)
    if not _finite(out):
        if t.dtype != dtype and _finite(t):
            raise CheckpointError(
                f"{file.name}: tensor {key!r} holds values that overflow {dtype} (as large as "
                f"{t.abs().max().item():.4g} in {t.dtype}); load it in a dtype with a wider "
                "range")
        raise CheckpointError(f"{file.name}: tensor {key!r} holds NaN or infinite values "
                              f"(in {dtype}); the checkpoint is damaged")
    return out


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of t is finite. The sum (accumulated in float32, in t's dtype, no
    copy of t) is NaN or inf whenever a value is; only then, or if a float16 sum overflows, is
    the exact test run, which allocates a bool per value."""
    return bool(t.sum().isfinite()) or bool(t.isfinite().all())


def _resolve_dtype(config: ModelConfig, device: torch.device,
                   dtype: str | torch.dtype | None, advise: bool = True) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"dtype {dtype!r} is not supported; valid: {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if dtype is not None:
        if dtype not in DTYPES.values():
            raise CheckpointError(f"dtype {dtype} is not supported; valid: {', '.join(DTYPES)}")
        return dtype
    if advise and device.type == "cpu" and config.torch_dtype != "float32":
        warnings.warn(f"running in {config.torch_dtype} (the checkpoint's torch_dtype) on the CPU, "
                      "where it is slower than float32 on most machines; dtype='float32' "
                      "(--dtype float32) trades twice the memory for speed", stacklevel=3)
    return DTYPES[config.torch_dtype]


def weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """The safetensors files to read, each with the tensor names its index lists (None: no index).

    With model.safetensors.index.json, every listed file must exist and every .safetensors file
    in the folder must be listed; the files' contents are checked against the index as they are
    read. Without one, every *.safetensors file is read.
    """
    index = folder / INDEX
    present = sorted(folder.glob("*.safetensors"))
    if not index.is_file():
        if not present:
            raise CheckpointError(f"{folder} has no *.safetensors weights")
        return dict.fromkeys(present)
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    # ValueError: bad JSON or UTF-8; RecursionError: absurd nesting
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index.name} is not a safetensors index (a JSON object with a "
                              f"weight_map): {e}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index.name}: weight_map must map tensor names to file names")
    files: dict[Path, list[str]] = {}
    for name, file in weight_map.items():
        if Path(file).name != file:
            raise CheckpointError(f"{index.name} lists {file!r} for {name!r}: not a file in the folder")
        files.setdefault(folder / file, []).append(name)
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{index.name} lists {file.name}, which is not in {folder}")
    for file in present:
        if file not in files:
            raise CheckpointError(f"{file.name} is not listed in {index.name}; remove it or the index")
    return dict(sorted(files.items()))


def _read(file: Path, listed: list[str] | None, backend: str):
    """(name, Stored) of one file, checked against the names the index lists; `backend` is
    safetensors': "mmap" (views of the mapped file) or "pread" (each tensor in its own buffer)."""
    try:
        handle = safe_open(str(file), framework="pt", device="cpu", backend=backend)
    except Exception as e:  # safetensors raises its own error type for corrupt files
        raise CheckpointError(f"{file.name} is not a readable safetensors file: {e}") from e
    with handle as f:
        names = list(f.keys())
        if listed is not None:
            unlisted = sorted(set(names) - set(listed))
            if unlisted:
                raise CheckpointError(f"{file.name} holds tensor {unlisted[0]!r}, which "
                                      f"{INDEX} does not list in this file")
            absent = sorted(set(listed) - set(names))
            if absent:
                raise CheckpointError(f"{INDEX} lists tensor {absent[0]!r} in {file.name}, "
                                      "which does not hold it")
        layout = functools.cache(lambda: _layout(file))  # read once a file, if a slice needs it
        for name in names:
            yield name, Stored(f, file, name, layout)


# The dtypes of safetensors' format (its header's names) a block weight is read in slices of
# rows in (Stored.slices); a weight in another is read whole.
FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
               "BF16": torch.bfloat16}


class Stored:
    """One tensor of an open safetensors file, read whole or a slice of rows at a time; a read
    that fails is a CheckpointError naming the file and tensor."""

    def __init__(self, handle, file: Path, name: str,
                 layout: Callable[[], tuple[int, dict]]) -> None:
        self.handle, self.file, self.name, self.layout = handle, file, name, layout

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._reading(lambda: self.handle.get_slice(self.name).get_shape()))

    def read(self) -> torch.Tensor:
        return self._reading(lambda: self.handle.get_tensor(self.name))

    def slices(self, rows: int) -> Iterator[torch.Tensor]:
        """The tensor's rows (dim 0), `rows` at a time, each read from the file on its own.
        Not through safetensors' get_slice, which reads the whole tensor into a buffer to take
        a slice of it (its pread backend: a 64-row slice of a 12 MiB weight peaked at 13 MiB):
        each slice is read at its offset in the file (the format: an 8-byte little-endian
        header size, a JSON header giving each tensor's dtype, shape and data_offsets from the
        header's end; the data row-major). Whole, in one slice, where that is not possible."""
        start, entry = self.layout()
        dtype = FILE_DTYPES.get(entry[self.name]["dtype"])
        if dtype is None or not hasattr(os, "preadv"):
            yield self.read()
            return
        n, rest = self.shape[0], self.shape[1:]
        row_bytes = math.prod(rest) * dtype.itemsize
        offset = start + entry[self.name]["data_offsets"][0]
        with open(self.file, "rb", buffering=0) as f:
            for first in range(0, n, rows):
                t = torch.empty((min(rows, n - first), *rest), dtype=dtype)
                want = t.numel() * dtype.itemsize
                got = os.preadv(f.fileno(), [t.view(-1).view(torch.uint8).numpy()],
                                offset + first * row_bytes)
                if got != want:
                    raise CheckpointError(f"{self.file.name}: tensor {self.name!r} cannot be "
                                          f"read: its data ends past the file's end")
                yield t

    def _reading(self, read):
        try:
            return read()
        # safetensors' own error type: a dtype this safetensors/torch build cannot hold
        # (FP6/FP4 formats), or data past the file's end
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.file.name}: tensor {self.name!r} cannot be read"
                                  f"{_dtype_note(self.handle, self.name)}: {e}") from None


def _layout(file: Path) -> tuple[int, dict]:
    """(where the data starts, the header by tensor name) of safetensors file `file`, whose
    header safe_open has read and checked already."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def _dtype_note(f, name: str) -> str:
    """' (dtype X in the file)' for tensor `name` of open file f, or '' if even that fails."""
    try:
        return f" (dtype {f.get_slice(name).get_dtype()} in the file)"
    except Exception:  # noqa: BLE001
        return ""
