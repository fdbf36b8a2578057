"""bfloat16 linear weights prepacked for oneDNN on the CPU, so that a call of a few positions
reads each weight once instead of reordering it first.

``F.linear`` in bfloat16 on the CPU goes to oneDNN, which reorders the (out, in) weight into its
blocked layout on every call: at the few positions of a block-diffusion step (4 per row) that
reorder costs as much as the product. Packing once at load (``torch.ops.mkldnn``'s
``_reorder_linear_weight``, the packing torch.compile's CPU backend uses when it freezes
weights) halves the transformer blocks' linear time at 4 rows and matches it at 256 (one
thread, a 1024 -> 3072 layer; BENCHMARKS.md, "Memory-bound calls"), with the same bits: the
same oneDNN kernel runs on the same values.

What is packed: the block stack's nn.Linear layers (unmask.weights.block_linears) of a model in
bfloat16 on the CPU, where oneDNN has a bfloat16 kernel (AVX512-BF16 or AMX). The module keeps
its state_dict keys and tensors (the packed weight unpacked on save), so saving and reading its
weights work as before; the LM head and embeddings stay as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from unmask.weights import block_linears, put_module, release_host_memory

# oneDNN picks the packed layout for a batch size hint; any small one gives the same layout here
_PACK_HINT = 4


def bf16_kernel() -> bool:
    """Whether oneDNN has a native bfloat16 matrix product on this CPU (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model's block linears in `dtype` on `device` are packed (module docstring)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and bf16_kernel()


def slow_bf16_note(model: nn.Module) -> str | None:
    """One line for a bfloat16 model on a CPU where oneDNN has no bfloat16 kernel, saying what
    to use instead; None otherwise."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or bf16_kernel():
        return None
    return ("bfloat16 matrix products on this CPU have no native kernel (it has neither "
            "AVX512-BF16 nor AMX), so each one converts its weights: load with dtype float32 "
            "(--dtype float32), or quantize int8")


class PackedLinear(nn.Module):
    """An nn.Linear's bfloat16 weight (out, in) held in oneDNN's blocked layout; forward runs
    oneDNN's product on it. The packed tensor is opaque to torch (no views, no autograd): this
    module is for inference, and its state_dict gives the plain weight back."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()  # (out, in) bfloat16
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: Tensor) -> Tensor:  # (..., in) -> (..., out)
        if x.dtype != torch.bfloat16:
            raise TypeError(f"PackedLinear runs bfloat16 activations, got {x.dtype}")
        # the bias goes into the product, as F.linear's does: added before the one rounding
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @property
    def weight(self) -> Tensor:
        """The plain (out, in) weight, unpacked (a copy)."""
        return self.packed.to_dense()

    def nbytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.packed.numel() * self.packed.element_size() + bias

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(model: nn.Module) -> int:
    """Replace the block stack's bfloat16 nn.Linear layers of a CPU model by PackedLinear, in
    place; returns how many. Nothing happens (0) off the CPU, in another dtype, or where oneDNN
    has no bfloat16 kernel."""
    linears = block_linears(model)
    first = next(iter(linears.values())).weight
    if not packs(torch.bfloat16, first.device):  # each layer's dtype is checked below
        return 0
    packed = 0
    for name, lin in linears.items():
        if type(lin) is not nn.Linear or type(lin.weight) is not nn.Parameter \
                or lin.weight.dtype != torch.bfloat16:
            continue
        put_module(model, name, PackedLinear(lin))
        packed += 1
    if packed:  # the plain weights were views of the mapped checkpoint, whose pages stay resident
        release_host_memory(model)
    return packed

