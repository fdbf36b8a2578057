"""int4 block linears on the CPU calling torch's int4 kernel straight, not through torchao's
tensor subclass.

torchao's ``Int4OpaqueTensor`` (unmask.quantize) runs a linear by intercepting ``F.linear`` on
its weight (``__torch_function__``) and calling torch's ``_weight_int4pack_mm_for_cpu`` on the
tensors it holds. The interception costs ~40-50 us of host time per call (one thread, this
project's EPYC): a few-row call's whole product takes ~180-310 us on a 1024 -> 3072 layer, so
12 such layers ran in 4.2-4.5 ms through torchao and 3.7 ms calling the kernel straight
(benchmarks/bench/linear-kernels.md). `Int4Linear` keeps torchao's tensor as its weight (so the
state dict, saving, unmask.quantize's byte counts and the product kind stay as they are) and
calls the same kernel on the same packed values, scales and zero points that torchao passes it:
the same bits (tests/test_int4call.py).

What is converted: a CPU model's block linears whose weight is an ``Int4OpaqueTensor`` of
torchao's weight-only int4 (no activation scaling or quantization), after the load (`LLM`),
whether the model was quantized while loading or saved quantized. A compiled model keeps
torchao's layers: torch.compile traces through the subclass.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from unmask.weights import block_linears, put_module

OPAQUE = "Int4OpaqueTensor"  # torchao's CPU int4 weight (unmask.quantize.TENSOR_SCHEMES)


class Int4Linear(nn.Linear):
    """An nn.Linear whose torchao int4 CPU weight runs torch's kernel without torchao's dispatch.
    An nn.Linear still (unmask.weights.block_linears finds it, unmask.engine.product_rows reads its
    weight's kind), holding the same weight and bias Parameters."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        weight = linear.weight
        if not direct(weight):
            raise ValueError(f"Int4Linear takes torchao's weight-only {OPAQUE}, got "
                             f"{type(weight).__name__}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = weight
        self.bias = linear.bias
        self.group_size = weight.block_size[1]

    def forward(self, x: Tensor) -> Tensor:  # (..., in) bfloat16 -> (..., out)
        w = self.weight
        flat = x.reshape(-1, self.in_features).contiguous()  # (M, in)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, w.qdata, self.group_size,
                                                       w.scale_and_zero)  # (M, out, padded)
        y = y[:, :self.out_features].reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias  # torchao adds it after, in bfloat16


def direct(weight: Tensor) -> bool:
    """Whether `weight` is torchao's weight-only CPU int4 tensor, whose product Int4Linear runs."""
    return (type(weight).__name__ == OPAQUE and weight.block_size[0] == 1
            and weight.act_pre_scale is None and weight.act_mapping_type is None)


def call_int4_directly(model: nn.Module) -> int:
    """Replace the block stack's int4 CPU linears (torchao's weight-only ``Int4OpaqueTensor``)
    by Int4Linear, in place; how many."""
    replaced = 0
    for name, lin in block_linears(model).items():
        if type(lin) is not nn.Linear or not direct(lin.weight):
            continue
        put_module(model, name, Int4Linear(lin))
        replaced += 1
    return replaced
