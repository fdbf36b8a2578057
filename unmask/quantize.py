"""Weight-only int8 / int4 quantization of the transformer blocks' linear layers, with torchao.

What is quantized: every nn.Linear inside the model's block stack (the nn.ModuleList of blocks:
q/k/v/output projections and the MLP), weight-only: activations, the K/V store, scoring and
every decoder run in the model's dtype as before. What is not, and why:

- embeddings: a row lookup, not a matmul; torchao's weight-only tensors implement F.linear;
- norms: a vector per layer, a negligible share of the bytes;
- the LM head: the models read it as a matrix (``x @ head.T``, the embedding itself when
  tied), not through F.linear, and every decoder's confidence comes from its logits. At the
  published 8B shapes it is 6-7% of the weights (LLaDA-8B: 126,464 x 4,096).

Which torchao tensor holds the weights (torchao 0.18):

- int8: ``Int8WeightOnlyConfig`` (symmetric, one scale per output row): an ``Int8Tensor``; its
  linear is a matmul in the activation dtype, so it runs wherever torch does;
- int4 on the CPU: ``PrototypeInt4WeightOnlyConfig``: an ``Int4OpaqueTensor`` packed for
  torch's own ``_weight_int4pack_mm_for_cpu``;
- int4 on CUDA: ``Int4WeightOnlyConfig`` with the ``tile_packed_to_4d`` packing: an
  ``Int4TilePackedTo4dTensor`` for torch's own tinygemm kernel ``_weight_int4pack_mm``, which
  needs a GPU of compute capability 8.0 or newer. (torchao's default int4 packing calls
  kernels of the separate ``mslk`` package.)

int4 needs a model in bfloat16, on both: the CUDA packing takes nothing else, and the CPU
kernel's float32 and float16 paths are 50-70x slower than a float32 linear (measured on this
project's CPU, a 1024 x 2816 layer, 16 and 256 rows; bfloat16: 0.6-2.4x the time of a bfloat16 linear).

int4 groups: one scale and zero point per group of input features, the largest of 128, 64
and 32 that divides every quantized layer's input width (torchao's default is 128; it skips a
layer whose width its group size does not divide, which here is an error instead).

A quantized model is saved as torchao documents for its tensors (its "Serialization" page):
``torch.save`` of the state dict, loaded into a model built on the meta device with
``load_state_dict(assign=True)``. ``save_checkpoint`` of a quantized model writes
QUANTIZED_FILE beside config.json; ``load_model`` (and so ``LLM(folder)``) reads it back.

Importing this module imports torch, not torchao: torchao loads on first use.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from unmask.errors import CheckpointError, InputError
from unmask.memory import mib  # noqa: F401  (re-exported: the scripts' sizes)
from unmask.packing import PackedLinear
from unmask.rowint8 import SCHEME as ROW_SCHEME
from unmask.rowint8 import RowInt8Linear, check_device, quantize_rows
from unmask.weights import (
    LayerLoader,
    block_linears,
    release_host_memory,
    row_slices,
    slice_rows,
    trim_heap,
)

SCHEMES = ("int8", "int4", ROW_SCHEME)  # w8a8: unmask.rowint8 (int8 activations too), opt-in
INSTALL = "pip install 'unmask[quant]'"
MIN_TORCHAO = (0, 18)  # PrototypeInt4WeightOnlyConfig (0.17 names it otherwise)
INT4_GROUP_SIZES = (128, 64, 32)  # what both int4 packings accept, largest first
QUANTIZED_FILE = "model.torchao.pt"
# torch's int4 CPU packing (_convert_weight_to_int4pack_for_cpu) lays rows out in blocks of 64:
# slices of 32 or 96 rows pack to other bytes than the whole weight, slices of 64k rows to the same
INT4_CPU_ROW_BLOCK = 64
# Inner tensors of torchao's CPU tensors whose rows (the weight's output rows) are not dim 0:
# Int4OpaqueTensor's scale_and_zero is (in / group, out, 2).
_ROW_DIMS = {"Int4OpaqueTensor": {"scale_and_zero": 1}}

# The torchao tensor types this module creates, by class name (no torchao import needed to ask).
TENSOR_SCHEMES = {"Int8Tensor": "int8", "Int4OpaqueTensor": "int4",
                  "Int4TilePackedTo4dTensor": "int4"}


def check_quantize(scheme: str, device: torch.device) -> None:
    """Refuse, in one line saying what works instead, a scheme this install cannot run on
    `device`: an unknown name, torchao missing or too old, int4 where no int4 kernel runs,
    w8a8 where no int8 product is fast (unmask.rowint8.check_device)."""
    if scheme not in SCHEMES:
        raise InputError(f"quantize {scheme!r} is not a quantization scheme; valid: "
                         f"{', '.join(SCHEMES)} (or none, for the checkpoint's dtype)")
    if scheme == ROW_SCHEME:
        check_device(torch.device(device))
        return
    torchao_version()
    if scheme == "int4":
        _check_int4_device(torch.device(device))


def torchao_version() -> str:
    """torchao's version, importing it (quietly) on first use; InputError when it is missing
    or older than this module needs."""
    try:
        # torchao logs a warning for each of its CUDA extensions a CPU torch cannot load, and
        # torch one for an enum torchao registers: noise on every load, about nothing used here
        with _quiet("torchao", "torch.utils._pytree"):
            import torchao
            import torchao.prototype.quantization.int4  # noqa: F401  (registers Int4OpaqueTensor)
    except ImportError as e:
        raise InputError(f"quantization needs torchao, which is not installed ({e}): "
                         f"{INSTALL}") from None
    version = torchao.__version__
    found = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    if found < MIN_TORCHAO:
        raise InputError(f"quantization needs torchao >= {'.'.join(map(str, MIN_TORCHAO))}, "
                         f"found {version}: pip install -U 'unmask[quant]'")
    return version


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """The named loggers at ERROR while the block runs."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _check_int4_device(device: torch.device) -> None:
    if device.type == "cpu":
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
            raise InputError(f"int4 on the CPU needs torch's _weight_int4pack_mm_for_cpu, which "
                             f"torch {torch.__version__} lacks; use quantize int8")
        if platform.machine() in ("x86_64", "AMD64") and \
                torch.backends.cpu.get_cpu_capability() == "DEFAULT":
            # the kernel's scalar fallback, slower than the bfloat16 weights it replaces
            raise InputError("int4 on this CPU runs torch's scalar int4 kernel (it has neither "
                             "AVX2 nor AVX-512): use quantize int8")
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            raise InputError(f"int4 on {device} needs a GPU of compute capability 8.0 or newer "
                             f"(torch's tinygemm kernel); this one is {capability[0]}."
                             f"{capability[1]}: use quantize int8")
        return
    raise InputError(f"int4 runs on cpu and cuda, not {device.type}: use quantize int8 there, "
                     f"or int4 with device cpu")


def quantize_model(model: nn.Module, scheme: str) -> None:
    """Quantize `model`'s transformer-block linear weights to `scheme` in place (module
    docstring: what and how). InputError as check_quantize does, and for a model already
    quantized, int4 on a model not in bfloat16, an int4 layer width no group size divides."""
    linears = block_linears(model)
    weight = next(iter(linears.values())).weight
    check_quantize(scheme, weight.device)
    found = quantized_scheme(model)
    if found is not None:
        raise InputError(f"the model is already quantized ({found}); load its float "
                         f"checkpoint to quantize it as {scheme}")
    if scheme == ROW_SCHEME:
        quantize_rows(model)
        return
    from torchao.quantization import quantize_

    targets = {id(m) for m in linears.values()}
    quantize_(model, _torchao_config(scheme, linears, weight.dtype, weight.device),
              filter_fn=lambda module, fqn: id(module) in targets)
    skipped = [name for name, m in linears.items() if not _is_torchao(m.weight)]
    if skipped:  # torchao leaves a layer it cannot quantize as it was, with only a log line
        raise InputError(f"torchao left {skipped[0]} unquantized ({scheme}); its weight is "
                         f"{tuple(linears[skipped[0]].weight.shape)}")
    if weight.device.type == "cpu":
        release_host_memory(model)


def load_quantizer(model: nn.Module, scheme: str, dtype: torch.dtype,
                   device: torch.device) -> LoadQuantizer | LayerLoader:
    """What converts `model`'s block linear weights to `scheme` as load_model reads them:
    torchao's schemes a tensor at a time (LoadQuantizer), w8a8 a layer at a time (LayerLoader)."""
    check_quantize(scheme, device)
    if scheme == ROW_SCHEME:
        return LayerLoader(model, RowInt8Linear)
    return LoadQuantizer(model, scheme, dtype, device)


class LoadQuantizer:
    """Quantizes the block linear weights one at a time as load_model reads them, on the CPU a
    slice of rows at a time (`slice_rows`, `join`), so that a load holds the float rows of one
    slice besides the quantized weights (quantize_model on a loaded model holds them all).
    `model` is the model load_model builds on the meta device; the weights come in `dtype` on
    `device`."""

    def __init__(self, model: nn.Module, scheme: str, dtype: torch.dtype,
                 device: torch.device) -> None:
        linears = block_linears(model)
        self.scheme = scheme
        self.targets = {f"{name}.weight": m for name, m in linears.items()}
        self.config = _torchao_config(scheme, linears, dtype, device)

    def __call__(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """The tensor load_model assigns for `key`: quantized for a block linear's weight, `t`
        for another. load_model reads a quantizing load's tensors into buffers of their own (not
        views of a mapped file: unmask.checkpoint.READ_BACKEND), so a float weight's memory
        goes once it is quantized."""
        if key not in self.targets:
            return t
        if t.device.type != "cpu":
            return self._quantize(key, t)
        return self.join(key, row_slices(t, INT4_CPU_ROW_BLOCK))

    def slice_rows(self, key: str, dtype: torch.dtype, device: torch.device) -> int | None:
        """How many rows at a time load_model may hand `key` over in (to `join`), None to hand
        it whole (to `__call__`): a block linear's weight on the CPU comes in slices of about
        unmask.weights.SLICE_BYTES in `dtype`, so that no float copy of the whole weight is
        made (torch's CUDA int4 packing takes a whole weight)."""
        if key not in self.targets or torch.device(device).type != "cpu":
            return None
        return slice_rows(self.targets[key].in_features, dtype.itemsize, INT4_CPU_ROW_BLOCK)

    def join(self, key: str, slices: Iterable[torch.Tensor]) -> torch.Tensor:
        """Block linear weight `key` quantized from its consecutive row slices, each quantized
        as it comes and its float temporaries released before the next (the same bytes as
        quantizing the whole weight: join_rows)."""
        parts = []
        for rows in slices:
            parts.append(self._quantize(key, rows))
            trim_heap()  # the slice's float temporaries, which glibc would keep (trim_heap)
        weight = join_rows(parts, self.targets[key].weight.shape)
        parts.clear()  # the slices' own copies, now joined
        trim_heap()
        return weight

    def _quantize(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """`t` (out, in) as torchao's tensor for this scheme."""
        from torchao.quantization import quantize_

        with torch.device("meta"):
            layer = nn.Linear(t.shape[1], t.shape[0], bias=False)
        layer.weight = nn.Parameter(t, requires_grad=False)
        quantize_(layer, self.config)
        if not _is_torchao(layer.weight):  # torchao leaves a layer it cannot quantize as it was
            raise InputError(f"torchao left {key} unquantized ({self.scheme}); its weight is "
                             f"{tuple(self.targets[key].weight.shape)}")
        return layer.weight

    def finish(self, model: nn.Module) -> None:
        """After the load: the host memory the quantizing left behind released. The tensors kept
        as read are in buffers of their own already (unmask.checkpoint.READ_BACKEND), not views
        of a mapped file: copying them, as release_host_memory does, would only add a copy of
        each to the load's peak (~170M: the float32 embedding and head, 8 MiB each)."""
        trim_heap()


def join_rows(parts: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """One torchao CPU tensor of `shape` from those of its consecutive row slices, made of
    their inner tensors concatenated (the same bytes as quantizing the whole weight: each row's
    scales are its own, and int4 slices start at a multiple of INT4_CPU_ROW_BLOCK rows:
    tests/test_quantize.py)."""
    if len(parts) == 1:
        return parts[0]
    names, attributes = parts[0].__tensor_flatten__()
    dims = _ROW_DIMS.get(type(parts[0]).__name__, {})
    inner = {n: torch.cat([getattr(p, n) for p in parts], dim=dims.get(n, 0)) for n in names}
    if "shape" in attributes:  # Int4OpaqueTensor holds its logical shape
        attributes = {**attributes, "shape": shape}
    return type(parts[0]).__tensor_unflatten__(inner, attributes, shape, None)


def _torchao_config(scheme: str, linears: dict[str, nn.Linear], dtype: torch.dtype,
                    device: torch.device):
    """The torchao config for `scheme` on weights of `dtype` on `device`.
    set_inductor_config=False: torchao's default changes torch._inductor's global settings,
    which quantizing the weights has no business doing."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    if scheme == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if dtype != torch.bfloat16:
        raise InputError(f"int4 needs a model in bfloat16, this one is in "
                         f"{str(dtype).removeprefix('torch.')} (torch's int4 kernels run "
                         f"bfloat16; on the CPU other dtypes take a path 50-70x slower): load it "
                         f"with dtype bfloat16, or use quantize int8")
    group_size = _int4_group_size(linears)
    if device.type == "cpu":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
    return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                set_inductor_config=False)


def _int4_group_size(linears: dict[str, nn.Linear]) -> int:
    for size in INT4_GROUP_SIZES:
        if all(m.in_features % size == 0 for m in linears.values()):
            return size
    name, m = next((n, m) for n, m in linears.items()
                   if any(m.in_features % s for s in INT4_GROUP_SIZES))
    raise InputError(f"int4 groups input features by {', '.join(map(str, INT4_GROUP_SIZES))}; "
                     f"{name} has {m.in_features}, which none divides: use quantize int8")





def _is_torchao(t: torch.Tensor) -> bool:
    return type(t).__name__ in TENSOR_SCHEMES


def quantized_scheme(model: nn.Module) -> str | None:
    """The scheme `model`'s weights are quantized with, None for plain tensors."""
    if any(isinstance(m, RowInt8Linear) for m in model.modules()):
        return ROW_SCHEME
    for p in model.parameters():
        if _is_torchao(p):
            return TENSOR_SCHEMES[type(p).__name__]
    return None


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers hold: a torchao tensor counts the tensors it
    is made of (packed values, scales, zero points), not its logical shape times its dtype;
    a PackedLinear (unmask.packing) its packed weight."""
    packed = sum(m.nbytes() for m in model.modules()
                 if isinstance(m, PackedLinear | RowInt8Linear))
    return packed + sum(_tensor_bytes(t) for t in (*model.parameters(), *model.buffers()))


def float_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters and buffers would hold unquantized: each tensor's logical
    shape times its dtype (a torchao tensor's dtype is the float one it stands for)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _tensor_bytes(t: torch.Tensor) -> int:
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


# --- saved quantized folders ----------------------------------------------------------------------
def check_saveable(model: nn.Module) -> None:
    """CheckpointError for a model whose weights are not saved: w8a8's packed layers."""
    if quantized_scheme(model) == ROW_SCHEME:
        raise CheckpointError(f"a {ROW_SCHEME} model is not saved (its weights are packed for "
                              f"oneDNN): save the float checkpoint and load it with quantize "
                              f"{ROW_SCHEME}")


def save_quantized(state: dict[str, torch.Tensor], scheme: str, out: Path) -> None:
    """Write a quantized model's state dict to out/QUANTIZED_FILE, with what loading checks."""
    device = next(iter(state.values())).device.type
    torch.save({"scheme": scheme, "device": device, "torchao": torchao_version(),
                "state_dict": state}, out / QUANTIZED_FILE)


def load_quantized(folder: Path, model: nn.Module, device: torch.device,
                   dtype: torch.dtype) -> nn.Module:
    """`model` (built on the meta device) with the quantized weights of folder/QUANTIZED_FILE
    assigned on `device`. The weights run as saved: int4 on the device type it was packed for,
    every tensor in the dtype it was saved in."""
    file = folder / QUANTIZED_FILE
    if any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{folder} holds both {QUANTIZED_FILE} and *.safetensors weights; "
                              f"keep one set")
    try:
        torchao_version()
    except InputError as e:
        raise CheckpointError(f"{file} holds torchao-quantized weights: {e}") from None
    try:
        saved = torch.load(file, map_location=device, weights_only=True, mmap=True)
        scheme, packed_for, state = saved["scheme"], saved["device"], saved["state_dict"]
    # torch.load raises many types for a damaged or foreign file (pickle, zip, runtime errors)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{file} is not a quantized state dict saved by unmask "
                              f"({type(e).__name__}: {str(e).strip()[:200]})") from None
    if scheme == "int4" and packed_for != device.type:
        raise CheckpointError(f"{file}: int4 weights packed for {packed_for} cannot run on "
                              f"{device.type}; quantize the float checkpoint on {device.type}")
    _check_state(file, state, model, dtype)
    model.load_state_dict(state, assign=True)
    return model.eval()


def _check_state(file: Path, state: dict, model: nn.Module, dtype: torch.dtype) -> None:
    expected = model.state_dict()
    for key, t in state.items():
        if key not in expected:
            raise CheckpointError(f"{file.name}: unexpected tensor {key!r}")
        if tuple(t.shape) != tuple(expected[key].shape):
            raise CheckpointError(f"tensor {key!r} has shape {tuple(t.shape)}, config expects "
                                  f"{tuple(expected[key].shape)}")
        if t.dtype != dtype:
            raise CheckpointError(f"{file.name}: tensor {key!r} is {t.dtype}; a quantized folder "
                                  f"runs in the dtype it was saved in, {dtype}")
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{file.name}: missing tensor {missing[0]!r}")
