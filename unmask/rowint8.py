"""w8a8: int8 weights and int8 activations, one activation scale per row, on the CPU (oneDNN).

Weight-only int8 (unmask.quantize, torchao) keeps the activations' dtype and so multiplies in
it: torchao's CPU path writes a float copy of each weight every call, slower than the bfloat16
weights it replaces (BENCHMARKS.md, "Memory-bound calls"). An integer product reads the int8
weights as they are, with the VNNI instructions (AVX512-VNNI / AVX-VNNI), at the few rows of a
block-diffusion step 0.7-0.8x packed bfloat16's time. It needs the activations in int8 too,
which changes the numerics: an opt-in scheme of its own, not `int8`.

Each row of a product's input gets its own scale (its largest magnitude over 127), so a row's
values never depend on the rows beside it, and the product accumulates in int32, exactly, so
neither does the sum: a row's bits are its own in any batch (tests/test_product_rows.py).
Per-call activation scales (torch.ao's dynamic quantization) would make them depend on the batch.

Weights: symmetric, one scale per output row, prepacked for oneDNN at load. Activations go to
oneDNN as uint8 with zero point 128 (its VNNI kernel takes unsigned activations; signed ones take
a reference path 600x slower here). The output is float32 times the row's scale, plus the bias,
rounded once to the activations' dtype. What is converted: the block stack's linear layers
(unmask.weights.block_linears), as unmask.quantize's schemes; the LM head and embeddings stay.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from unmask.errors import InputError
from unmask.weights import block_linears, put_module, release_host_memory, row_slices, trim_heap

SCHEME = "w8a8"
_PACK_HINT = 4  # oneDNN's batch-size hint for the packed layout (any small one: the same)
_ZERO = 128  # the activations' zero point: int8 value v is sent as v + 128


def check_device(device: torch.device) -> None:
    """Refuse, in one line saying what to use instead, a device where w8a8 has no fast kernel."""
    if device.type != "cpu":
        raise InputError(f"quantize {SCHEME} runs on the CPU (oneDNN's int8 product); on "
                         f"{device.type} use quantize int8 or int4")
    if not torch.cpu._is_vnni_supported():
        raise InputError(f"quantize {SCHEME} needs AVX512-VNNI or AVX-VNNI, which this CPU lacks "
                         f"(oneDNN's int8 product would be slower than the float weights): use "
                         f"quantize int8, or int4")


class RowInt8Linear(nn.Module):
    """An nn.Linear as int8 weights prepacked for oneDNN, run on int8 activations with one scale
    per row (module docstring). For inference: the packed weight is opaque to torch."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # a slice of rows at a time (each row's scale is its own: the same bits), so that the
        # float temporaries are a slice's, not the weight's (unmask.weights.SLICE_BYTES)
        rows = [quantize_int8_rows(w) for w in row_slices(linear.weight.detach())]
        q = torch.cat([q for q, _ in rows])  # (out, in) int8
        scale = torch.cat([s for _, s in rows])  # (out,)
        del rows
        self.weight_scale = scale
        self.weight_zero = torch.zeros_like(scale, dtype=torch.int32)
        self.packed = torch.ops.onednn.qlinear_prepack(q, [_PACK_HINT, self.in_features])
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        flat = x.reshape(-1, self.in_features).float()  # (M, in)
        scale = flat.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127  # (M, 1)
        q = (torch.round(flat / scale) + _ZERO).to(torch.uint8)
        acc = torch.ops.onednn.qlinear_pointwise(q, 1.0, _ZERO, self.packed, self.weight_scale,
                                                 self.weight_zero, None, 1.0, 0, torch.float32,
                                                 "none", [], "")  # (M, out) float32
        out = acc * scale if self.bias is None else torch.addcmul(self.bias, acc, scale)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return (self.packed.numel() * self.packed.element_size()
                + self.weight_scale.numel() * 4 * 2
                + (0 if self.bias is None else self.bias.numel() * 4))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {SCHEME}"


def quantize_int8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """(w as int8 (rows, in), one float32 scale per row (rows,)): symmetric, each row's largest
    magnitude to 127."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_rows(model: nn.Module) -> int:
    """Replace the block stack's nn.Linear layers by RowInt8Linear, in place; how many.
    InputError where the device has no fast kernel (check_device)."""
    linears = block_linears(model)
    check_device(next(iter(linears.values())).weight.device)
    for name, lin in linears.items():
        put_module(model, name, RowInt8Linear(lin))
        trim_heap()  # the layer's float32 temporaries, which glibc would keep (weights.trim_heap)
    release_host_memory(model)  # the float weights were views of the mapped checkpoint
    return len(linears)
