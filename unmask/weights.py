"""What the weight conversions (unmask/quantize.py, unmask/packing.py) touch, and the host memory
a conversion leaves behind."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from unmask.errors import InputError

# A weight is converted a slice of rows at a time where its rows convert independently (each
# output row's scale is its own): the float temporaries of converting a slice are a few times
# SLICE_BYTES, where converting the whole weight at once held a few times the weight (~170M in
# float32: 24-39 MiB of temporaries for a 12 MiB weight; BENCHMARKS.md "Memory-bound calls").
SLICE_BYTES = 1 << 20


def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The nn.Linear layers inside the model's block stacks (its nn.ModuleLists), by name."""
    inside = {id(m) for stack in model.modules() if isinstance(stack, nn.ModuleList)
              for m in stack.modules()}
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and id(m) in inside}
    if not found:
        raise InputError(f"{type(model).__name__} has no linear layers in a block stack to "
                         f"quantize")
    return found


def slice_rows(width: int, element_size: int, align: int = 1) -> int:
    """Rows of `width` elements of `element_size` bytes that make a slice of about SLICE_BYTES:
    a multiple of `align`, at least one."""
    return max(align, SLICE_BYTES // max(1, width * element_size) // align * align)


def row_slices(t: torch.Tensor, align: int = 1) -> Iterator[torch.Tensor]:
    """Views of consecutive rows of 2-D `t`, each of about SLICE_BYTES (at least `align` rows,
    and a multiple of `align` rows but the last)."""
    rows = slice_rows(t.shape[1], t.element_size(), align)
    for start in range(0, t.shape[0], rows):
        yield t[start:start + rows]


def put_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` in `model` in place of the submodule named `name` (dotted)."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


class LayerLoader:
    """Converts the block linears one at a time as load_model reads them (`convert`: an
    nn.Linear to the module that replaces it, e.g. packed or quantized), so that a load holds
    the float weights of one layer at a time besides the converted ones (converting a loaded
    model holds them all). A layer converts once its weight (and bias, if it has one) are read;
    the state dict gets meta placeholders for them, and `finish` puts the converted layers in.
    The interface of unmask.quantize's LoadQuantizer: called with each tensor read, then finish."""

    def __init__(self, model: nn.Module, convert: Callable[[nn.Linear], nn.Module]) -> None:
        self.convert = convert
        self.layers = block_linears(model)
        self.keys = {f"{name}.{part}": (name, part) for name, m in self.layers.items()
                     for part, _ in m.named_parameters()}
        self.read: dict[str, dict[str, torch.Tensor]] = {}
        self.converted: dict[str, nn.Module] = {}

    def __call__(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """`t` for a tensor not of a block linear; a meta placeholder for one, whose layer is
        converted once all its tensors are read."""
        if key not in self.keys:
            return t
        name, part = self.keys[key]
        parts = self.read.setdefault(name, {})
        parts[part] = t
        layer = self.layers[name]
        if len(parts) == len(dict(layer.named_parameters())):
            with torch.device("meta"):
                plain = nn.Linear(layer.in_features, layer.out_features, bias="bias" in parts)
            for n, v in self.read.pop(name).items():
                setattr(plain, n, nn.Parameter(v, requires_grad=False))
            self.converted[name] = self.convert(plain)
            trim_heap()  # the layer's float temporaries (trim_heap)
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def slice_rows(self, key: str, dtype: torch.dtype, device: torch.device) -> None:
        """None: every tensor is handed over whole (a layer converts its whole weight at once;
        unmask.quantize.LoadQuantizer takes some in slices)."""
        return None

    def finish(self, model: nn.Module) -> None:
        """After the load: the converted layers in place of the block linears; the host memory
        the converting left behind released."""
        for name, layer in self.converted.items():
            put_module(model, name, layer)
        trim_heap()  # no copy of the tensors kept as read: not mapped (LoadQuantizer.finish)


def release_host_memory(model: nn.Module) -> None:
    """Hand back what quantizing on the CPU leaves held but unused (measured on a 197M-parameter
    float32 folder, int8, 285 MiB of weights: the process's resident memory was 1,936 MiB after
    quantizing, 600 MiB with this; 221 MiB before the load):

    - load_model leaves the weights as views of the memory-mapped checkpoint file, which stays
      mapped, with the replaced float weights' pages resident, while any view of it lives: the
      tensors kept as they were (embeddings, norms, head) are copied out of it;
    - torchao computes each layer's scales and values through float temporaries of a few times
      the layer's size, which glibc keeps in the heap once freed: malloc_trim returns them.
    """
    with torch.no_grad():
        for p in model.parameters():
            if not is_traceable_wrapper_subclass(p.data):  # a torchao tensor is not mapped
                p.data = p.data.clone()
    trim_heap()


def trim_heap() -> None:
    """Hand the free memory at glibc's heap top back to the system (malloc_trim); nothing
    elsewhere. Quantizing one layer frees float temporaries of a few times its size, which
    glibc keeps for reuse: a load that quantizes layer after layer piled them up to 3.5x the
    int8 weights (a 110 MB float32 folder in shards: 100 MB of heap for 28 MB of weights)."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)
