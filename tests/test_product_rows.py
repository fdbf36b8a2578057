"""The fewest rows a call's matrix products get, per kind of product (unmask.engine.product_rows):
each kind this machine runs gives a row the same bits in any call of at least its minimum, the
minimum follows the model's weights, and the runner pads a call to it, no further."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK_FAMILIES, tiny_model
from torch import nn

from unmask.decoding.params import DecodeParams
from unmask.engine import decode, product_rows
from unmask.engine.product_rows import DEFAULT_MIN_ROWS, ProductRows, min_rows, product_kind
from unmask.engine.product_rows import product_rows as rows_of
from unmask.int4call import Int4Linear
from unmask.packing import PackedLinear, bf16_kernel, pack_linears
from unmask.quantize import quantize_model

CPU = torch.device("cpu")
# row counts tried: every small one (where kernels switch paths) and some large
SIZES = [*range(1, 21), 23, 64, 100, 255, 513]
OFFSETS = (0, 5, 130)


def layer_of(kind: str, n_in: int, n_out: int) -> nn.Module:
    """A (n_in -> n_out) block linear layer running products of `kind`."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if "bfloat16" in kind else torch.float32
    linear = nn.Linear(n_in, n_out, bias=False).to(dtype)
    if kind == "bfloat16 packed":
        if not bf16_kernel():
            pytest.skip("oneDNN has no bfloat16 kernel here")
        return PackedLinear(linear)
    if kind.startswith(("int", "w8a8")):
        holder = nn.Sequential(nn.ModuleList([linear]))  # quantize_model takes the block stack's
        quantize_model(holder, kind.split()[0])
        # int4 on the CPU runs as LLM converts it: torch's kernel called directly (unmask.int4call)
        return Int4Linear(holder[0][0]) if kind == "int4 bfloat16" else holder[0][0]
    return linear


def varying_rows(f, xs: torch.Tensor) -> list[int]:
    """The row counts (of SIZES) at which some row's product differs from its bits in a call of
    all xs's rows."""
    with torch.no_grad():
        whole = f(xs)
        return [m for m in SIZES
                if not all(torch.equal(f(xs[at:at + m]), whole[at:at + m]) for at in OFFSETS)]


KINDS = ["float32", "bfloat16", "bfloat16 packed", "int8 float32", "int8 bfloat16",
         "int4 bfloat16", "w8a8"]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_gives_a_row_its_bits_from_its_minimum_up(kind: str, threads: int) -> None:
    """A product of `kind` gives a row the same bits in any call of at least min_rows(kind)
    rows, wherever the row sits (if this fails on a machine, its minimum there must grow)."""
    floor = min_rows(kind, CPU, threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n_in, n_out in ((256, 768), (1024, 3072), (3072, 1024)):
            layer = layer_of(kind, n_in, n_out)
            assert product_kind(layer) == kind
            xs = torch.randn(700, n_in, generator=torch.Generator().manual_seed(1))
            dtype = torch.float32 if kind.endswith("float32") else torch.bfloat16
            varying = varying_rows(layer, xs.to(dtype))
            assert all(m < floor for m in varying), (kind, n_in, n_out, floor, varying)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lm_head_gives_a_row_its_bits_from_its_minimum_up(dtype: torch.dtype) -> None:
    """The LM head (`x @ head.T` in the model's dtype) keeps the plain product's minimum."""
    g = torch.Generator().manual_seed(2)
    head = torch.randn(2048, 1024, generator=g).to(dtype)  # (V, d)
    xs = torch.randn(700, 1024, generator=g).to(dtype)
    floor = min_rows(str(dtype).removeprefix("torch."), CPU)
    assert all(m < floor for m in varying_rows(lambda x: x @ head.T, xs))


def _model(weights: str) -> nn.Module:
    m = tiny_model("sdar", d_model=128, n_heads=4, n_kv_heads=2, mlp_hidden_size=256)
    if weights == "float32":
        return m
    m = m.to(torch.bfloat16)
    if weights == "bfloat16 packed":
        assert pack_linears(m)
    elif weights.startswith("int"):
        quantize_model(m, weights.split()[0])
    return m


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "bfloat16 packed", "int8 bfloat16",
                                     "int4 bfloat16"])
def test_a_models_minimum_is_its_block_products_and_its_head(weights: str, monkeypatch) -> None:
    """The block products' minimum is the largest of their kinds', the head's its dtype's."""
    if weights == "bfloat16 packed" and not bf16_kernel():
        pytest.skip("oneDNN has no bfloat16 kernel here")
    monkeypatch.setattr(product_rows, "instruction_set", lambda: "test")
    monkeypatch.setitem(product_rows.MEASURED, "test", {
        "float32": 8, "bfloat16": 3, "bfloat16 packed": 1, "int8 bfloat16": 2, "int4 bfloat16": 5})
    head = 8 if weights == "float32" else 3
    blocks = {"float32": 8, "bfloat16": 3, "bfloat16 packed": 1, "int8 bfloat16": 2,
              "int4 bfloat16": 5}[weights]
    assert rows_of(_model(weights)) == ProductRows(blocks, head)


def test_an_unmeasured_machine_or_device_gets_the_default(monkeypatch) -> None:
    monkeypatch.setattr(product_rows, "instruction_set", lambda: "amx")
    assert min_rows("bfloat16 packed", CPU) == DEFAULT_MIN_ROWS
    monkeypatch.setattr(product_rows, "instruction_set", lambda: "avx512_bf16")
    assert min_rows("bfloat16 packed", CPU) == product_rows.MEASURED["avx512_bf16"]["bfloat16 packed"]
    assert min_rows("bfloat16 packed", torch.device("cuda")) == DEFAULT_MIN_ROWS
    assert min_rows("float32", CPU, threads=3) == DEFAULT_MIN_ROWS  # not measured on 3 threads
    assert [min_rows("float32", CPU, threads=n) for n in (1, 2)] == [4, 12]
    with pytest.raises(ValueError, match="at least 1 row"):
        ProductRows(0, 1)


def test_a_matrix_beside_the_linears_counts_as_float32(monkeypatch) -> None:
    """LLaDA2's router scores in float32 whatever the model's dtype: its model keeps the float32
    minimum for its block products."""
    monkeypatch.setattr(product_rows, "instruction_set", lambda: "test")
    monkeypatch.setitem(product_rows.MEASURED, "test", {"float32": 8, "bfloat16": 1})
    m = tiny_model("llada2_moe", **BLOCK_FAMILIES["llada2_moe"]).to(torch.bfloat16)
    assert rows_of(m) == ProductRows(8, 1)


def test_the_runner_pads_a_call_to_the_models_minimum_only(monkeypatch) -> None:
    """A block of 4 positions runs its block products on the model's minimum of rows: 4 where
    the minimum is 4 or fewer, not the 16 a float32 product needs; the LM head on its own."""
    monkeypatch.setattr(product_rows, "instruction_set", lambda: "test")
    m = tiny_model("sdar", d_model=128, n_heads=4, n_kv_heads=2, mlp_hidden_size=256)
    block = m.config.block_size
    seen: list[int] = []
    linear = next(x for x in m.modules() if isinstance(x, nn.Linear))
    linear.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[:-1].numel()))
    p = DecodeParams.parse("static-1", gen_length=2 * block, block_length=block)
    for measured, want in (({"float32": 2}, block), ({"float32": 6}, 6), ({}, 16)):
        monkeypatch.setitem(product_rows.MEASURED, "test", measured)
        seen.clear()
        decode(m, p, [[5, 6, 7, 8]])
        assert np.median(seen) == want, (measured, seen)


def test_the_runner_follows_the_thread_count(monkeypatch) -> None:
    """A float32 product's minimum follows torch's thread count (4 rows on one thread, 12 on
    two here), so the runner reads it again when the count changes: a block of 4 runs on 4
    rows on one thread and is padded to 12 on two, never left at a count whose bits differ."""
    monkeypatch.setattr(product_rows, "instruction_set", lambda: "avx512_bf16")
    m = tiny_model("sdar", d_model=128, n_heads=4, n_kv_heads=2, mlp_hidden_size=256)
    seen: list[int] = []
    linear = next(x for x in m.modules() if isinstance(x, nn.Linear))
    linear.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[:-1].numel()))
    block = m.config.block_size
    p = DecodeParams.parse("static-1", gen_length=2 * block, block_length=block)
    before = torch.get_num_threads()
    try:
        for threads, want in ((1, 4), (2, 12), (1, 4)):
            torch.set_num_threads(threads)
            seen.clear()
            decode(m, p, [[5, 6, 7, 8]])
            assert np.median(seen) == want, (threads, seen)
    finally:
        torch.set_num_threads(before)
