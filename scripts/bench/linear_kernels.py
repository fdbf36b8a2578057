"""CPU matrix-product kernels by weight format, at the few-row calls of block decoding and at a
canvas-sized call: which kernel reads the weights fastest (BENCHMARKS.md, "Memory-bound calls").

Each candidate runs a stack of distinct layers whose weights together exceed the last-level
cache (so every call reads its weights from memory, as a model's forward does), round-robin
across candidates, and reports the median ms per pass over the stack and the GB/s of weight
bytes it read.

    .venv/bin/python scripts/bench/linear_kernels.py [--rows 1,4,32,256] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from memory_floor import bandwidth

Kernel = Callable[[torch.Tensor], torch.Tensor]


def bf16_linear(w: torch.Tensor) -> tuple[Kernel, int]:
    wb = w.to(torch.bfloat16)
    return (lambda x: F.linear(x.to(torch.bfloat16), wb)), wb.numel() * 2


def bf16_colmajor(w: torch.Tensor) -> tuple[Kernel, int]:
    wb = w.to(torch.bfloat16).t().contiguous().t()  # (N, K) with K-major storage: w.T contiguous
    return (lambda x: F.linear(x.to(torch.bfloat16), wb)), wb.numel() * 2


def f32_colmajor(w: torch.Tensor) -> tuple[Kernel, int]:
    wt = w.t().contiguous().t()
    return (lambda x: F.linear(x, wt)), w.numel() * 4


def f32_linear(w: torch.Tensor) -> tuple[Kernel, int]:
    return (lambda x: F.linear(x, w)), w.numel() * 4


def int8_scales(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)  # (N, K)
    return q, scale


def int8pack(dtype: torch.dtype) -> Callable[[torch.Tensor], tuple[Kernel, int]]:
    def make(w: torch.Tensor) -> tuple[Kernel, int]:
        q, scale = int8_scales(w)
        s = scale.to(dtype)
        nbytes = q.numel() + s.numel() * s.element_size()
        return (lambda x: torch.ops.aten._weight_int8pack_mm(x.to(dtype), q, s)), nbytes
    return make


def int4pack(group: int = 128) -> Callable[[torch.Tensor], tuple[Kernel, int]]:
    def make(w: torch.Tensor) -> tuple[Kernel, int]:
        n, k = w.shape
        g = w.view(n, k // group, group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)  # (N, K/G, 1)
        zero = lo + 8 * scale  # value of code 8
        q = torch.round((g - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], dim=-1)  # (K/G, N, 2)
        sz = sz.to(torch.bfloat16).contiguous()
        nbytes = packed.numel() * packed.element_size() + sz.numel() * 2
        return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), packed, group, sz)), nbytes
    return make


def quantized_layer(w: torch.Tensor, scheme: str) -> tuple[torch.nn.Module, int]:
    """A bfloat16 layer of weight `w` quantized by unmask.quantize.quantize_model (torchao's int8
    / int4, or w8a8), and its bytes."""
    from unmask.quantize import quantize_model, weight_bytes  # noqa: PLC0415

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(w.shape[1], w.shape[0], bias=False)])

    m = M().to(torch.bfloat16)
    with torch.no_grad():
        m.layers[0].weight.copy_(w)
    quantize_model(m, scheme)
    return m.layers[0], weight_bytes(m)


def quantized(scheme: str) -> Callable[[torch.Tensor], tuple[Kernel, int]]:
    """A layer quantized by unmask.quantize.quantize_model, called as the model calls it."""
    def make(w: torch.Tensor) -> tuple[Kernel, int]:
        lin, nbytes = quantized_layer(w, scheme)
        return (lambda x: lin(x.to(torch.bfloat16))), nbytes
    return make


def int4_direct(w: torch.Tensor) -> tuple[Kernel, int]:
    """torchao's int4 weights (as `int4 torchao`), torch's kernel called on them directly."""
    lin, nbytes = quantized_layer(w, "int4")
    t = lin.weight
    return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), t.qdata, t.block_size[1], t.scale_and_zero)), nbytes


def dynamic_int8(w: torch.Tensor) -> tuple[Kernel, int]:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, torch.qint8)[0]
    return (lambda x: q(x.float())), w.numel()


def da8w4(w: torch.Tensor) -> tuple[Kernel, int]:
    """torchao's int4 weights with int8 activations quantized per row (token), its CPU kernel
    (Int8DynamicActivationInt4WeightConfig: Int4OpaqueTensor's da8w4 layout), groups of 128."""
    from torchao.prototype.quantization.int4 import (  # noqa: PLC0415
        Int8DynamicActivationInt4WeightConfig,
    )
    from torchao.quantization import quantize_  # noqa: PLC0415

    from unmask.quantize import torchao_version, weight_bytes  # noqa: PLC0415

    torchao_version()
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    quantize_(lin, Int8DynamicActivationInt4WeightConfig(group_size=128,
                                                         set_inductor_config=False))
    return (lambda x: lin(x.to(torch.bfloat16))), weight_bytes(lin)


def mkldnn_bf16(w: torch.Tensor) -> tuple[Kernel, int]:
    wb = w.to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, 4)
    return (lambda x: torch.ops.mkldnn._linear_pointwise(
        x.to(torch.bfloat16), packed, None, "none", [], "")), wb.numel() * 2


CANDIDATES = {
    "bf16 F.linear": bf16_linear,
    "bf16 F.linear K-major": bf16_colmajor,
    "f32 F.linear": f32_linear,
    "f32 F.linear K-major": f32_colmajor,
    "bf16 mkldnn packed": mkldnn_bf16,
    "int8 torchao": quantized("int8"),
    "int8pack bf16": int8pack(torch.bfloat16),
    "int8pack f32": int8pack(torch.float32),
    "int8 dynamic (fbgemm)": dynamic_int8,
    "int4 torchao": quantized("int4"),
    "int4 torchao direct": int4_direct,
    "w8a8 per row (oneDNN)": quantized("w8a8"),
    "da8w4 per row (torchao)": da8w4,
    "int4pack bf16": int4pack(),
    **{f"int4pack bf16 g{g}": int4pack(g) for g in (32, 64, 256)},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4,32,256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--n", type=int, default=3072)
    p.add_argument("--layers", type=int, default=24, help="distinct weights, > last-level cache")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--only", default=None, help="comma-separated candidate names")
    p.add_argument("--merge", type=int, default=1,
                   help="also each candidate on the layers concatenated G at a time along their "
                        "outputs (the same bytes in 1/G the products: q/k/v as one, gate/up as one)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: this process's CPU time (one thread: others' load does not count)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    names = args.only.split(",") if args.only else list(CANDIDATES)
    weights = [torch.randn(args.n, args.k) * 0.02 for _ in range(args.layers)]
    stacks: dict[str, tuple[list[Kernel], int]] = {}
    g = args.merge
    sets = {"": weights}
    if g > 1:  # the same weights, G layers' outputs concatenated into one
        sets[f", {g} merged"] = [torch.cat(weights[i:i + g]) for i in range(0, len(weights), g)]
    for name in names:
        for tag, ws in sets.items():
            try:
                made = [CANDIDATES[name](w) for w in ws]
            except Exception as e:  # noqa: BLE001  (a probe: report the candidate that cannot run)
                print(f"{name}{tag}: cannot run ({type(e).__name__}: {str(e)[:120]})")
                continue
            stacks[name + tag] = ([f for f, _ in made], sum(b for _, b in made))
    read = bandwidth(args.threads) / 1e9  # this run's reading speed, to read the GB/s against
    torch.set_num_threads(args.threads)
    print(f"K {args.k} -> N {args.n}, {args.layers} layers, {args.threads} thread(s), "
          f"{args.clock} clock, load average {os.getloadavg()[0]:.1f}; ms per pass "
          f"(weight GB/s), median of {args.repeat}; read bandwidth {read:.1f} GB/s "
          f"(scripts/bench/memory_floor.py)\n")
    rows = [int(r) for r in args.rows.split(",")]
    print("| kernel | MiB | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|:---|---:|" + "---:|" * len(rows))
    results: dict[tuple[str, int], list[float]] = {}
    for m in rows:
        x = torch.randn(m, args.k)
        for f, _ in stacks.values():  # warm up
            for g in f:
                g(x)
        for _ in range(args.repeat):
            for name, (fs, _) in stacks.items():  # round-robin: drift hits every kernel alike
                t = clock()
                for g in fs:
                    g(x)
                results.setdefault((name, m), []).append(clock() - t)
    for name, (_, nbytes) in stacks.items():
        cells = []
        for m in rows:
            ms = statistics.median(results[name, m]) * 1e3
            cells.append(f"{ms:.2f} ({nbytes / ms / 1e6:.0f})")
        print(f"| {name} | {nbytes / 2**20:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
