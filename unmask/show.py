"""`unmask show MODEL`: a checkpoint's architecture, parameters, tokens and chat template, and
whether it fits this machine: the memory its weights take (by dtype and --quantize), plus the
K/V store and the logits of a batch of canvases, against this machine's RAM and GPU memory.

The weight bytes are exact for the safetensors loader and torchao 0.18's tensors (checked
against loaded models in tests/test_show.py):
- float: every parameter at the dtype's width;
- int8 (``Int8Tensor``): one byte per block-linear weight, plus a float32 scale and an int8
  zero point per output row;
- w8a8 (unmask.rowint8.RowInt8Linear): one byte per block-linear weight as oneDNN packs it,
  plus a float32 scale and an int32 zero point per output row, the bias in float32;
- int4 (``Int4OpaqueTensor`` on the CPU): half a byte per block-linear weight, plus a bfloat16
  scale and zero point per group of input features (the largest of unmask.quantize's group
  sizes that divides every width); the CUDA packing differs by a few bytes per row.
Working memory is an estimate, not a measurement: the K/V store holds every position of the
batch (``KVStore``: 2 x layers x K/V heads x head width, in the dtype), the logits are those of
every generated position in the dtype plus the float32 copy scoring makes (`unmask/decoding/scoring.py`),
and one layer's activations are the MLP's three hidden-width tensors per position. A
block-causal model adds its prefix store's budget (`--prefix-cache-gib`, default PREFIX_SHARE of
the RAM available: unmask.engine.prefix_store), which it may fill. On a CUDA device every
family's calls replay CUDA graphs (`--cuda-graphs auto`, the default; shape buckets, a
bidirectional canvas's padding keys masked: unmask.engine.buckets), which read a
K/V store allocated once for every row at its full width (unmask.engine.graphs,
`store_width`): there the K/V term is the batch's rows at that width (the canvas's own where it
is longer). The graphs' own memory is one pool holding one call's activations (the activations
term); what each capture adds is in the start-up log of a GPU run.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from unmask.catalog import (
    active_parameters,
    config_of,
    count_parameters,
    gib,
    has_chat_template,
    human,
    meta_model,
    weights_dtype,
)
from unmask.cli_args import CUDA_GRAPH_MODES, positive
from unmask.cli_args import gib as gib_budget
from unmask.decoding.params import DecodeParams
from unmask.errors import InputError
from unmask.memory import GIB, PREFIX_SHARE, available_ram

WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}
SCHEMES = ("int8", "int4", "w8a8")
GEN_LENGTH = DecodeParams().gen_length


@dataclass(frozen=True)
class Workload:
    """What to size: the weights' dtype and scheme, and the canvases decoded at once."""

    dtype: str
    quantize: str | None = None
    gen_length: int = GEN_LENGTH
    prompt_length: int = 128
    batch: int = 1
    prefix_bytes: int = 0  # the prefix store's budget (block-causal models)
    cuda_graphs: str = "auto"  # whether a CUDA device preallocates the K/V store (module docstring)

    def __post_init__(self) -> None:
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise InputError(f"cuda_graphs {self.cuda_graphs!r}: valid {', '.join(CUDA_GRAPH_MODES)}")
        if self.dtype not in WIDTH:
            raise InputError(f"dtype {self.dtype!r}: valid {', '.join(WIDTH)}")
        if self.quantize not in (None, *SCHEMES):
            raise InputError(f"quantize {self.quantize!r}: valid {', '.join(SCHEMES)}")
        if self.quantize == "int4" and self.dtype != "bfloat16":
            raise InputError("int4 needs the model in bfloat16 (docs/checkpoints.md, "
                             "\"Quantized weights\"): add --dtype bfloat16")


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv: int
    logits: int
    activations: int
    prefix: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.logits + self.activations + self.prefix


def weight_bytes(config, work: Workload) -> int:
    """Bytes the loaded weights hold (module docstring: the formula per scheme)."""
    from unmask.quantize import INT4_GROUP_SIZES, block_linears

    model = meta_model(config)
    total = sum(p.numel() for p in model.parameters())
    width = WIDTH[work.dtype]
    if work.quantize is None:
        return total * width
    linears = block_linears(model).values()
    linear = sum(m.weight.numel() for m in linears)
    rest = (total - linear) * width
    if work.quantize == "int8":
        return rest + linear + sum(m.out_features for m in linears) * (4 + 1)
    if work.quantize == "w8a8":
        bias = sum(m.bias.numel() for m in linears if m.bias is not None)
        return (rest + bias * (4 - width) + linear
                + sum(m.out_features for m in linears) * (4 + 4))
    group = next((g for g in INT4_GROUP_SIZES if all(m.in_features % g == 0 for m in linears)),
                 None)
    if group is None:
        raise InputError(f"int4 groups input features by {INT4_GROUP_SIZES}; this model has a "
                         f"width none divides: use --quantize int8")
    return rest + linear // 2 + (linear // group) * 2 * WIDTH["bfloat16"]


def estimate(config, work: Workload, device: str = "cpu") -> MemoryEstimate:
    """The memory `work` takes on `device` ("cpu", "cuda:N")."""
    width = WIDTH[work.dtype]
    positions = work.batch * (work.prompt_length + work.gen_length)
    kv = (work.batch * max(work.prompt_length + work.gen_length, graph_store_width(config, work, device))
          * config.n_layers * 2 * config.n_kv_heads * config.head_dim * width)
    logits = work.batch * work.gen_length * config.vocab_size * (width + 4)
    activations = positions * config.mlp_hidden_size * 3 * width
    prefix = work.prefix_bytes if config.block_size is not None else 0
    return MemoryEstimate(weight_bytes(config, work), kv, logits, activations, prefix)


def graph_store_width(config, work: Workload, device: str) -> int:
    """Positions a row of the K/V store takes when CUDA graphs preallocate it on `device`, else
    0: a CUDA device, graphs not off (`CudaGraphs.store_capacity`)."""
    if device == "cpu" or work.cuda_graphs == "off":
        return 0
    from unmask.engine.graphs import CudaGraphs, store_width  # loads torch: not at `--help`

    return store_width(config, CudaGraphs().max_keys)


# --- the machine ------------------------------------------------------------------------------
def machine_memory() -> dict[str, int]:
    """Free bytes by device: 'cpu' (RAM available now) and each 'cuda:N' torch can see."""
    out = {"cpu": available_ram()}
    import torch

    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            out[f"cuda:{i}"] = torch.cuda.mem_get_info(i)[0]
    return out



def verdict(config, work: Workload, free: int, device: str = "cpu") -> str:
    """'fits', or why not and the nearest setting that fits: first the model's context, then
    memory. The batch's canvases (K/V, logits, activations) grow with the batch and the weights
    do not, so a smaller batch is tried before cheaper weights (`cheaper`), each at the largest
    batch that fits with it."""
    canvas = context_needed(config, work)
    if canvas > config.max_sequence_length:
        return (f"does not fit the model's context: {work.prompt_length} prompt + "
                f"{work.gen_length} generated need {canvas:,} positions, max_sequence_length is "
                f"{config.max_sequence_length:,}; shorten --prompt-length or --gen-length")
    if estimate(config, work, device).total <= free:
        return "fits"
    for change, tried in [("", work), *cheaper(work)]:
        try:
            n = largest_batch(config, tried, free, device)
        except InputError:  # a scheme this model's widths do not allow
            continue
        if n >= 1:
            return "does not fit, try " + " ".join(
                ([f"--batch {n}"] if n < work.batch else []) + ([change] if change else []))
    return "does not fit, even quantized int4 with batch 1: use a machine with more memory"


def context_needed(config, work: Workload) -> int:
    """Positions one canvas takes: the prompt and generated ones, for a block-causal model up
    to the end of the last block (unmask.engine.layout.canvas_length)."""
    from unmask.engine.layout import canvas_length

    block = config.block_size
    return work.prompt_length + canvas_length(work.prompt_length, work.gen_length, block)


def largest_batch(config, work: Workload, free: int, device: str = "cpu") -> int:
    """The most canvases that fit in `free` bytes of `device` beside `work`'s weights (at most
    its batch): everything but the weights grows with the batch (`estimate`)."""
    one = estimate(config, replace(work, batch=1), device)
    per_canvas = one.total - one.weights
    return max(0, min(work.batch, (free - one.weights) // per_canvas))


def cheaper(work: Workload) -> list[tuple[str, Workload]]:
    """Cheaper weights than `work`'s, cheapest last."""
    options = [("--dtype bfloat16", replace(work, dtype="bfloat16", quantize=None)),
               ("--quantize int8", replace(work, quantize="int8")),
               ("--dtype bfloat16 --quantize int4", replace(work, dtype="bfloat16", quantize="int4"))]
    return [(c, w) for c, w in options if w != work]


# --- the command ------------------------------------------------------------------------------
def add_show_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="model folder or hub id org/name (default: the embedded model)")
    p.add_argument("--dtype", default=None, choices=list(WIDTH),
                   help="the dtype to size (default: the config's torch_dtype)")
    p.add_argument("--quantize", default=None, choices=list(SCHEMES),
                   help="size the weights quantized (int4 needs --dtype bfloat16)")
    # None by default, as every flag named after a decoder key (unmask.cli_args.DECODER_FLAGS)
    p.add_argument("--gen-length", type=positive, default=None,
                   help=f"generated positions (default: {GEN_LENGTH}, the decoders')")
    p.add_argument("--prompt-length", type=positive, default=128, help="prompt tokens (128)")
    p.add_argument("--batch", type=positive, default=1, help="canvases decoded at once (1)")
    p.add_argument("--prefix-cache-gib", type=gib_budget, default=None, metavar="GIB",
                   help="the prefix store's budget, for a block-causal model (default: "
                        f"{PREFIX_SHARE:.0%} of the RAM available)")
    p.add_argument("--cuda-graphs", choices=CUDA_GRAPH_MODES, default="auto",
                   help="size a CUDA device's K/V store as CUDA graphs preallocate it, for a "
                        "block-causal model (auto, on; off: as the canvases need; default: auto)")
    p.add_argument("--json", action="store_true", help="one JSON object")


def run_show(args: argparse.Namespace) -> int:
    from unmask.api import DEFAULT_MODEL
    from unmask.hub import DESCRIPTION_PATTERNS, resolve_model

    # a hub id: its config and tokenizer files only; whether it fits is asked before downloading
    folder = DEFAULT_MODEL if args.model is None else resolve_model(args.model, DESCRIPTION_PATTERNS)
    if not folder.is_dir():
        raise InputError(f"model folder {folder} does not exist")
    config = config_of(folder)
    prefix = (int(args.prefix_cache_gib * GIB) if args.prefix_cache_gib is not None
              else int(PREFIX_SHARE * available_ram()))
    work = Workload(dtype=args.dtype or config.torch_dtype, quantize=args.quantize,
                    gen_length=args.gen_length or GEN_LENGTH, prompt_length=args.prompt_length,
                    batch=args.batch, prefix_bytes=prefix, cuda_graphs=args.cuda_graphs)
    report = describe(folder, config, work)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0


def describe(folder: Path, config, work: Workload) -> dict:
    mem = estimate(config, work)
    return {
        "path": str(folder), "family": config.model_type, "layers": config.n_layers,
        "d_model": config.d_model, "heads": config.n_heads, "kv_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "mlp_hidden_size": config.mlp_hidden_size,
        "vocab_size": config.vocab_size, "max_sequence_length": config.max_sequence_length,
        "parameters": count_parameters(config), "active_parameters": active_parameters(config),
        "experts": experts(config), "dtype": weights_dtype(folder, config),
        "weights_by_dtype": {d: weight_bytes(config, Workload(dtype=d)) for d in WIDTH},
        "chat_template": has_chat_template(folder), "mask_token_id": config.mask_token_id,
        "eos_token_id": config.eos_token_id, "workload": asdict(work),
        "memory": {**asdict(mem), "total": mem.total},
        "fits": {dev: {"free": free, "total": estimate(config, work, dev).total,
                       "graph_store_width": graph_store_width(config, work, dev),
                       "verdict": verdict(config, work, free, dev)}
                 for dev, free in machine_memory().items()},
    }


def experts(config) -> str | None:
    """A mixture of experts in words; None for a dense model."""
    if config.num_experts is None:
        return None
    shared = f" + {config.num_shared_experts} shared" if config.num_shared_experts else ""
    return (f"{config.num_experts_per_tok} of {config.num_experts} routed{shared} per token in "
            f"{config.n_layers - config.first_k_dense_replace} of {config.n_layers} layers "
            f"(groups: {config.topk_group} of {config.n_group})")


def print_report(r: dict) -> None:
    w, m = r["workload"], r["memory"]
    scheme = f", quantized {w['quantize']}" if w["quantize"] else ""
    lines = [
        f"model        {r['path']}",
        f"family       {r['family']}: {r['layers']} layers, d_model {r['d_model']}, {r['heads']} "
        f"heads ({r['kv_heads']} K/V) of {r['head_dim']}, MLP {r['mlp_hidden_size']}",
        f"vocabulary   {r['vocab_size']:,} tokens; mask id {r['mask_token_id']}, EOS id "
        f"{r['eos_token_id']}; context {r['max_sequence_length']:,}",
        f"parameters   {human(r['parameters'])} ({r['parameters']:,}), weights in {r['dtype']}",
        *([f"experts      {r['experts']}; {human(r['active_parameters'])} parameters active per "
           f"token ({r['active_parameters']:,})"] if r["experts"] else []),
        "weights      " + ", ".join(f"{d} {gib(b)}" for d, b in r["weights_by_dtype"].items()),
        f"chat         {'chat template present' if r['chat_template'] else 'no chat template'}",
        f"memory       {w['dtype']}{scheme}, batch {w['batch']} x ({w['prompt_length']} prompt + "
        f"{w['gen_length']} generated): weights {gib(m['weights'])} + K/V {gib(m['kv'])} + "
        f"logits {gib(m['logits'])} + activations {gib(m['activations'])}"
        + (f" + prefix store {gib(m['prefix'])}" if m["prefix"] else "") + f" = {gib(m['total'])}",
    ]
    for dev, f in r["fits"].items():
        what = "RAM available" if dev == "cpu" else "free"
        store = (f" (CUDA graphs, calls in shape buckets: the K/V store "
                 f"preallocated, {w['batch']} rows x "
                 f"{f['graph_store_width']:,} positions; {gib(f['total'])} in all)"
                 if f["graph_store_width"] else "")
        lines.append(f"{dev:<12} {gib(f['free'])} {what}{store}: {f['verdict']}")
    print("\n".join(lines), file=sys.stdout)
