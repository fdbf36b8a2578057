"""How few rows a model call's matrix products may get without a row's bits depending on its
batch, per kind of product and instruction set.

CPU kernels can round a row of a matrix product differently with the number of rows in the
call (docs/engine.md, "Batch invariance"): a float32 product of 1-3 rows on an AVX2 or AVX-512
EPYC, of fewer than 8 on a Xeon, takes another code path than a larger one. So the runner gives
every product at least a minimum of rows, padding a smaller call with tokens no row attends
with. That padding is most of a block-diffusion step's cost where a call forwards a block of 4
(BENCHMARKS.md, "Memory-bound calls"), and the minimum a product needs depends on its kernel:
so it is kept per kind of product, as measured on each instruction set. A kind or instruction
set not measured gets DEFAULT_MIN_ROWS, the float32 minimum every CPU met so far.
tests/test_product_rows.py finds, for each kind this machine runs, the row counts over which a
row's bits are invariant, and fails where a minimum here is below them.

Kinds: a plain product in a dtype ("float32", "bfloat16"); "bfloat16 packed"
(unmask.packing.PackedLinear); "int8 float32" / "int8 bfloat16" (torchao's weight-only int8,
whose product runs in the activations' dtype); "int4 bfloat16" (torch's int4 CPU kernel);
"w8a8" (unmask.rowint8: an int32 sum of int8 values, exact, with one scale per row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from unmask.packing import PackedLinear
from unmask.quantize import TENSOR_SCHEMES
from unmask.rowint8 import SCHEME as ROW_SCHEME
from unmask.rowint8 import RowInt8Linear

DEFAULT_MIN_ROWS = 16

# AVX512-BF16 without AMX (this project's EPYC; tests/test_product_rows.py): oneDNN's bfloat16
# kernels, packed or not, torch's int4 kernel and torchao's int8 in bfloat16 give a row the
# same bits from 2 rows up. One row is a matrix-vector product, which the bfloat16 kernels
# round differently (a 3072 -> 1024 product; int8 on two threads too; int4 never seen to), and a
# block of 2 or more positions pays nothing for a minimum of 2. float32 products depend on the
# thread count: on one thread 1-3 rows take another path and 4 up agree, so a block of 4 needs
# no padding; on two, 1-3, 5-7 and 9-11 rows differ (the rows split between the threads), so 12;
# on more threads, and on a Xeon (< 8 rows differ on one thread), not measured: the default.
# w8a8 sums integers, exactly: from 1 row up. A kind's entry is its minimum on any thread count,
# or {threads: minimum} where it depends on them (other thread counts: the default).
MEASURED: dict[str, dict[str, int | dict[int, int]]] = {
    "avx512_bf16": {"float32": {1: 4, 2: 12}, "bfloat16": 2, "bfloat16 packed": 2,
                    "int8 bfloat16": 2, "int4 bfloat16": 2, "w8a8": 1},
}


@dataclass(frozen=True)
class ProductRows:
    """The fewest rows a call gives each of its two sets of products."""

    blocks: int  # the transformer blocks' products: every forwarded token of the call
    head: int  # the LM head's: the scored positions

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.head < 1:
            raise ValueError(f"a product needs at least 1 row, got {self}")


def instruction_set() -> str:
    """The name MEASURED knows this CPU by ("" for none it knows)."""
    if torch.cpu._is_amx_tile_supported():
        return "amx"  # oneDNN's AMX kernels tile rows by 16: not measured
    if torch.cpu._is_avx512_bf16_supported():
        return "avx512_bf16"
    return ""


def min_rows(kind: str, device: torch.device, threads: int | None = None) -> int:
    """The fewest rows a product of `kind` gets on `device` (off the CPU: the default) with
    `threads` torch threads (None: torch's current count)."""
    if device.type != "cpu":
        return DEFAULT_MIN_ROWS
    rows = MEASURED.get(instruction_set(), {}).get(kind, DEFAULT_MIN_ROWS)
    if isinstance(rows, dict):
        return rows.get(torch.get_num_threads() if threads is None else threads, DEFAULT_MIN_ROWS)
    return rows


def product_kind(linear: nn.Module) -> str:
    """The kind of product a block linear layer runs (module docstring)."""
    if isinstance(linear, PackedLinear):
        return "bfloat16 packed"
    if isinstance(linear, RowInt8Linear):
        return ROW_SCHEME
    weight = linear.weight
    scheme = TENSOR_SCHEMES.get(type(weight).__name__)
    dtype = str(weight.dtype).removeprefix("torch.")
    return dtype if scheme is None else f"{scheme} {dtype}"


def block_products(model: nn.Module) -> list[nn.Module]:
    """The linear layers of the model's block stacks (its nn.ModuleLists) as they run: plain,
    prepacked or quantized."""
    return [m for stack in model.modules() if isinstance(stack, nn.ModuleList)
            for m in stack.modules() if isinstance(m, nn.Linear | PackedLinear | RowInt8Linear)]


def block_kinds(model: nn.Module) -> set[str]:
    """The kinds of the products the model's block stacks (its nn.ModuleLists) run: their linear
    layers', and "float32" for any other matrix they hold (LLaDA2's router scores in float32)."""
    inside = [m for stack in model.modules() if isinstance(stack, nn.ModuleList)
              for m in stack.modules()]
    linears = block_products(model)
    theirs = {id(p) for m in linears for p in m.parameters()}
    others = [p for m in inside for p in m.parameters(recurse=False)
              if p.ndim == 2 and id(p) not in theirs]
    return {product_kind(m) for m in linears} | ({"float32"} if others else set())


def product_rows(model: nn.Module, threads: int | None = None) -> ProductRows:
    """The fewest rows the runner gives `model`'s block products and LM head (the head stays in
    the model's dtype: unmask.quantize, unmask.packing) with `threads` torch threads (None:
    torch's current count)."""
    first = next(model.parameters())
    kinds = block_kinds(model) or {str(first.dtype).removeprefix("torch.")}
    blocks = max(min_rows(kind, first.device, threads) for kind in kinds)
    return ProductRows(blocks,
                       min_rows(str(first.dtype).removeprefix("torch."), first.device, threads))
