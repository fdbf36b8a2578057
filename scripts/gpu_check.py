"""The GPU check: what unmask does on an accelerator, in one command (docs/checkpoints.md § GPU).

    python scripts/gpu_check.py --out DIR [--tiny] [--device cuda] [--budget 330]
        [--reference .ref/fast_dllm_llada] [--models llada,dream]

Random-weight models of the published LLaDA-8B-Instruct, Dream-v0-Instruct-7B and SDAR-8B-Chat
shapes (their config.json files are tests/data/*.config.json; `--tiny` shrinks the widths and depths but keeps
the vocabularies) are built on the device, and each section below writes its rows to
DIR/gpu_check.json and DIR/gpu_check.md as soon as they are measured, so a run stopped at its
time limit still reports what it measured. Random weights: these are speed and numerics
numbers, not accuracy.

0. norm and rule, once: RMSNorm on the device against the references' formula (torch's fused
   rms_norm's max |diff| from it; whether the models' norm gives its bits), and a step's commit
   rule (`threshold`, `static-1`) over 1, 16 and 64 canvases on the host's numpy arrays and as
   tensors on the device: median microseconds and the device's device reads.
1. logits: bfloat16 logits against float32 logits of the same weights (max and mean |diff|,
   the float32 logits' standard deviation for scale, top-1 agreement); with `--reference DIR`
   (a folder holding Fast-dLLM's LLaDA modeling files, carried in the working tree, never part
   of the package), ours against that `LLaDAModelLM` on the same weights, in each dtype.
2. forward: one bfloat16 forward's time against rows and canvas width (the last 32 positions of
   each row scored, as a block decoder does), median of 5 after warm-up; `x rows=1` is the time
   relative to one row of the same width, so K FreeDave drafts (K rows of one canvas) cost about
   one forward where it stays near 1.
3. decode: the engine (unmask.engine.Engine) decoding random prompts with each decoder at batch
   1 and 16, the family's main decoders (`WIDE`: LLaDA `fast` and `threshold`, SDAR
   `threshold` in blocks of 4) also at batch 4 and 64 (eager only), in bfloat16, and where available
   compiled (unmask.compiling) and int8/int4 weight-only (unmask.quantize). Columns:
   `canvas tok/s` = generated positions (requests x gen_length, EOS fill included: random
   weights rarely stop) per second of wall time; `nfe` = model calls per request (mean);
   `host ms/step` = the wall time of engine steps spent outside `model.forward` (scoring, K/V
   store, bookkeeping; the forward is timed with a device synchronisation at its end), per
   engine step; `model ms/call`; `floor ms` = the weights' bytes over the device's copy
   bandwidth (`copy GB/s` in the header, measured in the same run: bytes read plus written by
   a device-to-device copy, per second), the least time a call that reads every weight once can
   take; `x floor` = model ms/call over it; `host syncs/step` = device-to-host reads per engine
   step (`unmask.syncs.SyncCounter`; on the CPU, the reads the same step would make on a GPU);
   `rule on` = where the commit rule ran (`device` for `static`, `static-1` and `threshold`
   off the CPU, unmask/engine/commit.py; else `host`);
   `peak GiB` = peak device memory allocated during the decode (CUDA only). A `batch
   invariance` row per model and variant: the first prompt's tokens decoded alone against the
   same prompt as the first row of the batch-16 decode (on --tiny: of 2), identical or the
   first position that differs. The `graphs` variant (`--cuda-graphs on`: one CUDA graph per
   shape bucket, docs/engine.md "CUDA graphs") runs for every model listed, with the family's
   main decoders (`WIDE`: LLaDA and Dream `threshold` and `fast`, whose bidirectional canvas
   is bucketed with its padding keys masked; SDAR `threshold`) at every batch of the eager
   variant: `model ms/call` is then a bucket call that replays a
   graph (inputs copied into its buffers included, captures taken out), `graphs` and `capture
   s` the captures a cell made and their time, `tokens vs eager` the first prompt's tokens
   against the eager cell's. Without a CUDA device (`--tiny` on the CPU) a skipped row gives
   the reason; an error in a graphs cell is reported in its row and the rest still runs.

The graphs check in one command, under 6 minutes on one H100 or H200 (`--budget` skips the
cells that would start past 300 s; LLaDA2-mini's shape, last, runs in what is left):

    python scripts/gpu_check.py --out benchmarks/gpu/DATE-graphs --models sdar,llada,dream,llada2 \
        --variants eager,graphs --sections norm,rule,decode --budget 300

It reports, besides the decode table (`host syncs/step` per cell: at most 1 for `threshold`,
`static-1` and `static`, whose rule runs on the device and reads the scores with its counts,
unmask/engine/commit.py), the `norm` section (torch's fused rms_norm against
the references' formula on the device, and whether the models' norm gives the formula's bits)
and the `rule` section (a step's commit rule on the host and on the device: microseconds and
device reads, unmask/decoding/rules.py), which decide whether the rule belongs in the graph.
4. load: a bfloat16 checkpoint of the LLaDA shape written to disk and loaded onto the device
   by `unmask.checkpoint.load_model` in a fresh process: seconds and the process's peak host
   memory (ru_maxrss), against the weights' size.

`--budget` seconds: a cell that would start after it is skipped (reported as skipped), so the
whole run fits a time limit. Exit status 0 when every cell that ran succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import importlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from unmask.config import ModelConfig  # noqa: E402
from unmask.decoding.methods import METHODS  # noqa: E402
from unmask.decoding.params import DecodeParams, row_knobs  # noqa: E402
from unmask.decoding.rules import select_top  # noqa: E402
from unmask.engine import Engine, SchedulerConfig  # noqa: E402
from unmask.engine import graphs as graphs_mod  # noqa: E402
from unmask.engine.buckets import Buckets  # noqa: E402
from unmask.engine.graphs import CudaGraphs  # noqa: E402
from unmask.models import build_model, layers  # noqa: E402
from unmask.models.layers import RMSNorm, reference_rms  # noqa: E402
from unmask.syncs import SyncCounter  # noqa: E402

PUBLISHED = {"llada": "llada-8b-instruct", "dream": "dream-v0-instruct-7b", "sdar": "sdar-8b-chat",
             "llada2": "llada2-mini"}
TINY = {  # the published architecture shrunk: same key set, head/kv-head ratio and vocabulary
    "llada": {"d_model": 64, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2, "mlp_hidden_size": 128},
    "dream": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 128},
    "sdar": {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
             "num_hidden_layers": 2, "intermediate_size": 192},
    "llada2": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "num_hidden_layers": 2, "intermediate_size": 128, "moe_intermediate_size": 32,
               "num_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4},
}
DECODERS = ("static-1", "threshold", "exact", "balanced", "fast")
# each family's main decoders, also measured at Sizes.wide_batches (a block-diffusion family
# decodes in its own blocks: Sizes.block_length does not apply)
WIDE = {"llada": ("threshold", "fast"), "dream": ("threshold", "fast"), "sdar": ("threshold",),
        "llada2": ("threshold",)}


@dataclass(frozen=True)
class Sizes:
    """The shapes each section runs at (full or --tiny)."""

    logit_rows: int
    logit_width: int
    rows: tuple[int, ...]
    widths: tuple[int, ...]
    prompt: int
    gen_length: int
    block_length: int
    batches: tuple[int, ...]
    wide_batches: tuple[int, ...]
    reps: int
    copy_mib: int  # the buffer the copy bandwidth is measured on

    @classmethod
    def of(cls, tiny: bool) -> Sizes:
        if tiny:
            return cls(2, 32, (1, 2), (32, 64), 8, 16, 8, (1, 2), (4,), 1, 64)
        return cls(4, 256, (1, 2, 4, 8, 16, 32), (256, 512, 1024), 64, 64, 32, (1, 16), (4, 64), 5,
                   1024)


@dataclass
class Report:
    """Rows by section, written to DIR as JSON and markdown after every row."""

    out: Path
    meta: dict[str, Any]
    sections: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    failed: int = 0

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.sections.setdefault(section, []).append(row)
        self.failed += "error" in row
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        data = {"meta": self.meta, "sections": self.sections}
        (self.out / "gpu_check.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(self.markdown())

    def markdown(self) -> str:
        lines = ["# unmask GPU check", ""]
        lines += [f"- {k}: {v}" for k, v in self.meta.items()]
        for name, rows in self.sections.items():
            lines += ["", f"## {name}", ""] + table(rows)
        return "\n".join(lines) + "\n"


def table(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |")
    return out


def cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "/").replace("\n", " ")[:160]


class Clock:
    """The run's time budget."""

    def __init__(self, budget: float) -> None:
        self.start, self.budget = time.perf_counter(), budget

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)


@contextlib.contextmanager
def cell_guard(report: Report, section: str, clock: Clock, row: dict[str, Any],
               need: float = 0.0) -> Iterator[dict[str, Any] | None]:
    """Run one cell: skipped past the budget; an exception is reported in its row, not raised,
    so one failing cell (an unsupported kernel, memory) leaves the others measured."""
    if clock.left() < need:
        report.add(section, {**row, "skipped": f"budget ({clock.left():.0f} s left)"})
        yield None
        return
    try:
        yield row
    except Exception as e:  # noqa: BLE001  (any failure is a reported result here)
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        traceback.print_exc()
    report.add(section, row)


# --- models -------------------------------------------------------------------------------------
def published_raw(family: str, tiny: bool) -> dict[str, Any]:
    """The published config.json of `family` (shrunk with --tiny)."""
    raw = json.loads((ROOT / "tests" / "data" / f"{PUBLISHED[family]}.config.json").read_text())
    if tiny:
        raw.update(TINY[family])
    return raw


def published_config(family: str, tiny: bool) -> ModelConfig:
    return ModelConfig.from_dict(published_raw(family, tiny))


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> nn.Module:
    """A model with seeded random weights, allocated on `device` in `dtype` directly (an 8B model
    in float32 first would take 32 GB more)."""
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(config)
            model.init_weights()
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- 1. logits ----------------------------------------------------------------------------------
def canvas(config: ModelConfig, rows: int, width: int, device: torch.device,
           seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, width) token ids: random text, its second half masked (a canvas mid-decode), and
    the mask of those positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(config.vocab_size, config.mask_token_id), (rows, width), generator=g)
    masked = torch.zeros(rows, width, dtype=torch.bool)
    masked[:, width // 2:] = True
    ids[masked] = config.mask_token_id
    return ids.to(device), masked.to(device)


def compare(a: torch.Tensor, b: torch.Tensor, at: torch.Tensor) -> dict[str, Any]:
    """a, b: (B, T, V) logits; scores over all positions, top-1 over the masked ones `at`."""
    d = (a.float() - b.float()).abs()
    return {"max |diff|": d.max().item(), "mean |diff|": d.mean().item(),
            "logit std": b.float().std().item(),
            "top-1 agree": (a[at].argmax(-1) == b[at].argmax(-1)).float().mean().item(),
            "bit-identical": bool(torch.equal(a.float(), b.float()))}


def ours_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos)


def reference_model(folder: Path, ours: nn.Module, raw: dict[str, Any]) -> nn.Module:
    """Fast-dLLM's LLaDAModelLM sharing `ours`'s weight tensors (no copy): built on the meta
    device, then given our tensors with assign=True (the parameter names are the same)."""
    sys.path.insert(0, str(folder.parent))
    pkg = importlib.import_module(folder.name)
    modeling = importlib.import_module(f"{folder.name}.modeling_llada")
    config = pkg.LLaDAConfig(**raw)
    inner = modeling.create_model_config_from_pretrained_config(config)
    inner.init_device = "meta"
    with sdp_backends_kept():
        ref = pkg.LLaDAModelLM(config, model=modeling.LLaDAModel(inner, init_params=False))
    ref.load_state_dict(ours.state_dict(), assign=True)
    return ref.eval()


@contextlib.contextmanager
def sdp_backends_kept() -> Iterator[None]:
    """Restore torch's process-wide attention-backend switches afterwards: Fast-dLLM's LLaDAModel
    turns the memory-efficient SDPA kernel off when it is built, which would have changed the
    kernels of every later cell (masked attention falls back to the math kernel). The first two
    H200 runs (benchmarks/gpu/h200-2026-12-04-*.md) were measured after it."""
    cuda = torch.backends.cuda
    switches = [(cuda.enable_flash_sdp, cuda.flash_sdp_enabled()),
                (cuda.enable_mem_efficient_sdp, cuda.mem_efficient_sdp_enabled()),
                (cuda.enable_math_sdp, cuda.math_sdp_enabled())]
    try:
        yield
    finally:
        for enable, was in switches:
            enable(was)


def reference_logits(ref: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # transformers 5 configs lack use_cache: pass what the forward reads
        return ref(ids, use_cache=False, return_dict=True).logits


def divergence(ours: nn.Module, ref: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """Where ours and the reference part: the first block whose output differs, and whether
    the ops that could round differently on this device (the RMSNorm, the LM head's product)
    give the same bits on the same input."""
    got: dict[str, list[torch.Tensor]] = {"ours": [], "ref": []}
    hooks = [b.register_forward_hook(lambda m, i, o: got["ours"].append(o))
             for b in ours.model.transformer.blocks]
    hooks += [b.register_forward_hook(lambda m, i, o: got["ref"].append(o[0]))
              for b in ref.model.transformer.blocks]
    try:
        ours_logits(ours, ids)
        reference_logits(ref, ids)
    finally:
        for h in hooks:
            h.remove()
    pairs = enumerate(zip(got["ours"], got["ref"], strict=True))
    first = next((i for i, (a, b) in pairs if not torch.equal(a, b)), None)
    t, rt = ours.model.transformer, ref.model.transformer
    with torch.no_grad():
        x = t.wte(ids)
        h = t.blocks[0].attn_norm(x)
        head = t.wte.weight if ours.config.weight_tying else t.ff_out.weight
        return {"first block differing": first,
                "rmsnorm same": bool(torch.equal(h, rt.blocks[0].attn_norm(x))),
                "q_proj same": bool(torch.equal(t.blocks[0].q_proj(h), rt.blocks[0].q_proj(h))),
                "x@W.T == linear": bool(torch.equal(h @ head.T, torch.nn.functional.linear(h, head)))}


def section_logits(report: Report, clock: Clock, family: str, device: torch.device, sz: Sizes,
                   reference: Path | None, tiny: bool) -> None:
    config = published_config(family, tiny)
    ids, masked = canvas(config, sz.logit_rows, sz.logit_width, device)
    fp32 = bf16 = None
    with cell_guard(report, "logits", clock, {"model": family, "compare": "bf16 vs fp32"},
                    need=30) as row:
        if row is None:
            return
        fp32 = random_model(config, device, torch.float32)
        bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
        ref32 = ours_logits(fp32, ids)
        row.update(compare(ours_logits(bf16, ids), ref32, masked))
        row["params"] = n_params(fp32)
    if reference is not None and family == "llada" and row is not None and "error" not in row:
        raw = published_raw(family, tiny)
        for name, ours in (("fp32", fp32), ("bf16", bf16)):
            with cell_guard(report, "logits", clock,
                            {"model": family, "compare": f"ours vs Fast-dLLM, {name}"}) as r:
                if r is None:
                    break
                ref = reference_model(reference, ours, raw)
                r.update(compare(ours_logits(ours, ids), reference_logits(ref, ids), masked))
                if not r["bit-identical"]:
                    r.update(divergence(ours, ref, ids))
                del ref
    fp32 = bf16 = None  # noqa: F841  (free the weights before the next section)
    free(device)


# --- 2. forward ---------------------------------------------------------------------------------
def time_call(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds of fn() after two warm-up calls, each timed to a device synchronisation."""
    for _ in range(2):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def scored_forward(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor,
                   at: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, pos, logits_at=at)


def section_forward(report: Report, clock: Clock, family: str, device: torch.device, sz: Sizes,
                    model: nn.Module) -> None:
    config = model.config
    base: dict[int, float] = {}
    for width in sz.widths:
        for rows in sz.rows:
            with cell_guard(report, "forward", clock,
                            {"model": family, "rows": rows, "width": width}, need=5) as row:
                if row is None:
                    return
                ids, _ = canvas(config, rows, width, device)
                pos = torch.arange(width, device=device).expand(rows, width)
                block = width - 32 + torch.arange(32, device=device)
                at = (torch.arange(rows, device=device).repeat_interleave(32), block.repeat(rows))

                s = time_call(functools.partial(scored_forward, model, ids, pos, at), device, sz.reps)
                base.setdefault(width, s)
                row.update({"ms": s * 1e3, "tokens/s": rows * width / s,
                            "x rows=1": s / base[width]})


# --- 3. decode ----------------------------------------------------------------------------------
class CallTimer:
    """Wraps owner.name (model.forward; with graphs, `Buckets.call`, which replays them):
    seconds inside it, each call ended by a device synchronisation. Calls made while a graph
    is being captured are left alone (a capture cannot synchronise); the captures' own time is
    `graphs.capture`'s (`capture s`), taken out of the calls that made them."""

    def __init__(self, owner: Any, name: str, device: torch.device) -> None:
        self.seconds, self.calls = 0.0, 0
        self.owner, self.name, self.inner, self.device = owner, name, getattr(owner, name), device

        def timed(*args: Any, **kwargs: Any) -> Any:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return self.inner(*args, **kwargs)
            t = time.perf_counter()
            out = self.inner(*args, **kwargs)
            sync(self.device)
            self.seconds += time.perf_counter() - t
            self.calls += 1
            return out
        # an instance's attribute shadows its class's method (nn.Module.__call__ looks up
        # forward on the instance first); a class's is a plain function, bound as a method
        setattr(owner, name, timed)

    def remove(self) -> None:
        setattr(self.owner, self.name, self.inner)


# --- norm and rule: numerics and the commit rule on the device ------------------------------
def section_norm(report: Report, clock: Clock, device: torch.device, sz: Sizes) -> None:
    """RMSNorm on the device against the references' formula (unmask.models.layers): torch's
    fused rms_norm's max |diff| from the formula, and whether the norm the models call gives
    the formula's bits (it calls the fused op only where `FUSED_RMS_EXACT` says it does)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for width in (128, 4096):  # a head's q/k norm, a LLaDA-8B layer's
            row = {"dtype": str(dtype).removeprefix("torch."), "width": width}
            with cell_guard(report, "norm", clock, row) as r:
                if r is None:
                    continue
                x = (torch.randn(sz.logit_width, width, generator=g) * 3).to(device, dtype)
                norm = RMSNorm(width, 1e-5).to(device, dtype)
                with torch.no_grad():
                    norm.weight.copy_(torch.randn(width, generator=g) * 2)
                    h = x.float()
                    formula = norm.weight * reference_rms(h, 1e-5).to(dtype)
                    fused = F.rms_norm(h, (width,), eps=1e-5)
                    r["fused vs formula max |diff|"] = (fused - reference_rms(h, 1e-5)).abs().max().item()
                    r["RMSNorm is the formula"] = torch.equal(norm(x), formula)
                    r["kernel"] = layers.rms_kernel(device).__name__


def commits(rule: Any, conf: Any, cand: Any, knobs: Any) -> Any:
    """(R, S) the commit mask of one step of `rule` (arrays or tensors alike)."""
    return select_top(conf, cand, rule.count(conf, cand, None, knobs))


def section_rule(report: Report, clock: Clock, device: torch.device, sz: Sizes) -> None:
    """A step's commit rule (count and selection, unmask.decoding.rules) over R canvases of the
    decode section's width, on the host's numpy arrays (what the engine runs) and as tensors on
    the device: median microseconds a step, and the device reads the device's path made."""
    width = sz.prompt + sz.gen_length
    for rows in (1, 16, 64):
        gen = np.random.default_rng(rows)
        conf = gen.random((rows, width), dtype=np.float32)
        cand = gen.random((rows, width)) < 0.1
        knobs = row_knobs([DecodeParams.parse("threshold", gen_length=sz.gen_length,
                                              block_length=sz.block_length)] * rows)
        for name in ("threshold", "static-1"):
            row = {"rows": rows, "width": width, "rule": name}
            with cell_guard(report, "rule", clock, row) as r:
                if r is None:
                    continue
                rule = METHODS[name].impl()
                conf_t, cand_t = torch.from_numpy(conf).to(device), torch.from_numpy(cand).to(device)
                knobs_t = {"threshold": torch.from_numpy(knobs["threshold"].copy()).to(device)}
                host = functools.partial(commits, rule, conf, cand, knobs)
                on_device = functools.partial(commits, rule, conf_t, cand_t, knobs_t)
                r["host us"] = 1e6 * time_call(host, torch.device("cpu"), 50)
                r["device us"] = 1e6 * time_call(on_device, device, 50)
                with SyncCounter(cpu_is_device=device.type == "cpu").counting() as c:
                    same = on_device()
                r["device reads"] = c.total
                r["same commits"] = bool((same.cpu().numpy() == host()).all())


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes per second a device-to-device copy moves (read plus written), median of 5."""
    src = torch.empty(mib << 18, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    s = time_call(lambda: dst.copy_(src), device, 5)
    return 2 * src.numel() * 4 / s


def run_decode(model: nn.Module, spec: str, batch: int, sz: Sizes, device: torch.device,
               seed: int = 0, graphs: bool = False) -> tuple[dict[str, Any], list[int]]:
    """One decode of `batch` random prompts through the engine: its metrics and the first
    prompt's tokens (the same prompt at every batch). graphs: with `--cuda-graphs on`, the
    model's calls timed as the bucket calls that replay them, captures taken out."""
    c = model.config
    block = c.block_size or sz.block_length
    # whole blocks (--tiny's 16 positions are half of LLaDA2's fixed block of 32)
    params = DecodeParams.parse(spec, gen_length=-(-sz.gen_length // block) * block,
                                block_length=block)
    g = torch.Generator().manual_seed(seed)
    high = min(c.vocab_size, c.mask_token_id)
    prompts = [torch.randint(0, high, (sz.prompt,), generator=g).tolist() for _ in range(batch)]
    # graphs preallocate the K/V store: as wide as the canvas, not the model's context (4,096
    # positions of LLaDA-8B's 32 K/V heads for 64 rows would be 137 GB)
    engine = Engine(model, SchedulerConfig(max_running=batch),
                    graphs=CudaGraphs("on", max_keys=sz.prompt + params.gen_length)
                    if graphs else None)
    timer = CallTimer(Buckets, "call", device) if graphs else CallTimer(model, "forward", device)
    capture_timer = CallTimer(graphs_mod, "capture", device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # on the CPU, count the reads the same decode would make on a GPU
    syncs = SyncCounter(cpu_is_device=device.type == "cpu")
    try:
        reqs = [engine.add_request(p, params) for p in prompts]
        steps, t = 0, time.perf_counter()
        with syncs.counting():
            while engine.has_unfinished:
                engine.step()
                steps += 1
        sync(device)
        wall = time.perf_counter() - t
    finally:
        for t in (timer, capture_timer):
            t.remove()
    failed = [r.error for r in reqs if r.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"request failed in the engine: {failed[0]}")
    row = {"canvas tok/s": batch * sz.gen_length / wall, "wall s": wall,
           "nfe": statistics.mean(r.nfe for r in reqs), "steps": steps,
           "host ms/step": (wall - timer.seconds) / steps * 1e3,
           "model ms/call": (timer.seconds - capture_timer.seconds) / max(timer.calls, 1) * 1e3,
           "host syncs/step": syncs.total / steps,
           # where the commit rule ran (unmask.engine.commit: the device's for static,
           # static-1 and threshold off the CPU)
           "rule on": ",".join(sorted({type(d.commit).__name__.removesuffix("Commit").lower()
                                       for d in engine.decoders.values()}))}
    if graphs:
        row |= {"graphs": capture_timer.calls, "capture s": capture_timer.seconds}
    if device.type == "cuda":
        row["peak GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row, reqs[0].token_ids


def variant_model(family: str, variant: str, device: torch.device, sz: Sizes,
                  tiny: bool) -> tuple[nn.Module, dict[str, Any]]:
    """The bfloat16 model of `variant` (eager, compile, int8, int4) and what preparing it cost."""
    config = published_config(family, tiny)
    model = random_model(config, device, torch.bfloat16)
    info: dict[str, Any] = {}
    if variant in ("int8", "int4"):
        quantize = importlib.import_module("unmask.quantize")
        quantize.check_quantize(variant, device)
        before = quantize.weight_bytes(model)
        t = time.perf_counter()
        quantize.quantize_model(model, variant)
        sync(device)
        info = {"prepare s": time.perf_counter() - t,
                "weights GiB": quantize.weight_bytes(model) / 2**30, "bf16 GiB": before / 2**30}
    elif variant.startswith("compile"):
        compiling = importlib.import_module("unmask.compiling")
        compiling.check_compile(device)
        mode = variant.partition(":")[2] or "default"
        compiling.compile_model(model, mode=mode)
    return model, info


def invariance(alone: list[int], inside: list[int]) -> str:
    """'identical', or the first position where the row's tokens differ."""
    if alone == inside:
        return "identical"
    n = min(len(alone), len(inside))
    first = next((i for i in range(n) if alone[i] != inside[i]), n)
    return f"differ from position {first}"


def graphs_skip(device: torch.device) -> str | None:
    """Why the graphs variant cannot run here, known before the model is built, or None (once
    built, graphs.unsupported says the rest: an error row)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this run is on {device.type}"
    return None


def section_decode(report: Report, clock: Clock, family: str, device: torch.device, sz: Sizes,
                   variants: list[str], tiny: bool) -> None:
    block = published_config(family, tiny).block_size is not None
    eager_tokens: dict[tuple[int, str], list[int]] = {}
    for variant in variants:
        head = {"model": family, "variant": variant}
        graphs = variant == "graphs"
        why = graphs_skip(device) if graphs else None
        if why is not None:
            report.add("decode", {**head, "skipped": why})
            continue
        row0 = {**head, "decoder": "(warm-up: threshold)", "batch": sz.batches[0]}
        with cell_guard(report, "decode", clock, row0, need=20) as row:
            if row is None:
                return
            model, info = variant_model(family, "eager" if graphs else variant, device, sz, tiny)
            row.update(info)
            if graphs and graphs_mod.unsupported(model) is not None:
                raise RuntimeError(graphs_mod.unsupported(model))
            compiled = variant.startswith("compile")
            counter = importlib.import_module("unmask.compiling").recompile_count if compiled else None
            before, t = counter() if counter else 0, time.perf_counter()
            # warm-up (kernel selection, allocator; compilation): the first cell would pay it
            run_decode(model, "threshold", sz.batches[0], sz, device, graphs=graphs)
            row["warm-up s"] = time.perf_counter() - t
            if counter:
                row["recompiles"] = counter() - before
            # quantized weights at their packed size
            floor = importlib.import_module("unmask.quantize").weight_bytes(model) \
                / report.meta["copy GB/s"] / 1e9
        if row is None or "error" in row:
            continue
        # graphs: the main decoders only, to keep the run within its budget
        cells = [(b, spec) for b in sz.batches
                 for spec in (WIDE[family] if block or graphs else DECODERS)]
        if variant in ("eager", "graphs"):  # (compiled, each new batch would compile again)
            cells += [(b, spec) for b in sz.wide_batches for spec in WIDE[family]]
        tokens: dict[tuple[int, str], list[int]] = {}
        for batch, spec in sorted(cells):
            with cell_guard(report, "decode", clock,
                            {**head, "decoder": spec, "batch": batch}, need=5) as r:
                if r is None:
                    break
                measured, tokens[batch, spec] = run_decode(model, spec, batch, sz, device,
                                                           graphs=graphs)
                r.update(measured)
                r.update({"floor ms": floor * 1e3, "x floor": measured["model ms/call"] / 1e3 / floor})
                if graphs and (batch, spec) in eager_tokens:
                    r["tokens vs eager"] = invariance(eager_tokens[batch, spec], tokens[batch, spec])
        if variant == "eager":
            eager_tokens = tokens
        wide = max(sz.batches)
        for spec in WIDE[family]:
            if (1, spec) in tokens and (wide, spec) in tokens:
                report.add("decode", {**head, "decoder": spec, "batch": f"1 vs {wide}",
                                      "batch invariance": invariance(tokens[1, spec], tokens[wide, spec])})
        del model
        free(device)


# --- 4. load ------------------------------------------------------------------------------------
LOAD_CHILD = """
import json, resource, sys, time, torch
sys.path.insert(0, sys.argv[3])
from unmask.checkpoint import load_model
t = time.perf_counter()
m = load_model(sys.argv[1], sys.argv[2])
if sys.argv[2].startswith("cuda"):
    torch.cuda.synchronize()
print(json.dumps({"load s": time.perf_counter() - t,
                  "peak host GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def section_load(report: Report, clock: Clock, device: torch.device, tiny: bool) -> None:
    from unmask.checkpoint import save_checkpoint

    with cell_guard(report, "load", clock, {"model": "llada", "dtype": "bfloat16"},
                    need=5 if tiny else 90) as row:
        if row is None:
            return
        model = random_model(published_config("llada", tiny), device, torch.bfloat16)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        with tempfile.TemporaryDirectory() as tmp:
            t = time.perf_counter()
            save_checkpoint(model, tmp, max_shard_size=5 << 30)
            del model
            free(device)
            row["save s"] = time.perf_counter() - t
            out = subprocess.run([sys.executable, "-c", LOAD_CHILD, tmp, str(device), str(ROOT)],
                                 capture_output=True, text=True, check=True)
            row.update(json.loads(out.stdout.strip().splitlines()[-1]))
        row["weights GiB"] = size / 2**30


# --- the run ------------------------------------------------------------------------------------
def meta(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    m = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
         "unmask commit": commit, "torch": torch.__version__, "python": platform.python_version(),
         "device": str(device), "tiny": args.tiny, "budget s": args.budget}
    if device.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(device)
        m["cuda"] = torch.version.cuda
    else:
        m["cpu"] = platform.processor() or platform.machine()
        m["threads"] = torch.get_num_threads()
    return m


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and .md")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run, < 2 minutes)")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--budget", type=float, default=330.0,
                   help="seconds; cells that would start later are skipped")
    p.add_argument("--reference", type=Path, default=None,
                   help="folder of Fast-dLLM's LLaDA modeling files (configuration_llada.py, "
                        "modeling_llada.py, __init__.py) to compare LLaDA logits against")
    p.add_argument("--models", default="llada,dream,sdar",
                   help=f"comma-separated: {', '.join(PUBLISHED)} (llada2: LLaDA2.0-mini's shape, "
                        "16B parameters, 32 GB in bfloat16)")
    p.add_argument("--variants", default="eager,graphs,int8,int4,compile",
                   help="decode variants for the first model (the others run eager only): eager, "
                        "int8, int4, compile[:MODE] (torch.compile mode, e.g. max-autotune-no-cudagraphs; "
                        "CUDA-graph modes are refused, an error row), graphs (--cuda-graphs on: "
                        "every model listed, its main decoders; a skipped row without CUDA, with "
                        "the reason)")
    p.add_argument("--sections", default="norm,rule,logits,forward,decode,load",
                   help=f"comma-separated, run in this order: {', '.join(SECTIONS)}")
    args = p.parse_args(argv)
    for name in args.models.split(","):
        if name not in PUBLISHED:
            p.error(f"--models: unknown model {name!r}; valid: {', '.join(PUBLISHED)}")
    for name in args.sections.split(","):
        if name not in SECTIONS:
            p.error(f"--sections: unknown section {name!r}; valid: {', '.join(SECTIONS)}")
    if args.reference is not None and not (args.reference / "modeling_llada.py").is_file():
        p.error(f"--reference {args.reference}: no modeling_llada.py there")
    return args


def run_section(section: str, report: Report, clock: Clock, family: str, device: torch.device,
                sz: Sizes, args: argparse.Namespace, first: bool) -> None:
    if section == "logits":
        section_logits(report, clock, family, device, sz, args.reference, args.tiny)
    elif section == "forward":
        model = random_model(published_config(family, args.tiny), device, torch.bfloat16)
        section_forward(report, clock, family, device, sz, model)
        del model
        free(device)
    elif section == "decode":
        asked = args.variants.split(",")
        # graphs run for every model, the rest on the first
        variants = asked if first else ["eager"] + [v for v in asked if v == "graphs"]
        section_decode(report, clock, family, device, sz, variants, args.tiny)


# the sections run once, not per model
ONCE: dict[str, Callable[[Report, Clock, torch.device, Sizes, argparse.Namespace], None]] = {
    "norm": lambda report, clock, device, sz, args: section_norm(report, clock, device, sz),
    "rule": lambda report, clock, device, sz, args: section_rule(report, clock, device, sz),
    "load": lambda report, clock, device, sz, args: section_load(report, clock, device, args.tiny),
}
SECTIONS = ("norm", "rule", "logits", "forward", "decode", "load")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sz, clock = Sizes.of(args.tiny), Clock(args.budget)
    sections = args.sections.split(",")
    report = Report(args.out, meta(device, args))
    report.meta["copy GB/s"] = copy_bandwidth(device, sz.copy_mib) / 1e9
    report.write()
    families = args.models.split(",")
    for section in sections:  # in the order given: a tight --budget keeps the first ones
        if section in ONCE:
            ONCE[section](report, clock, device, sz, args)
            continue
        for i, family in enumerate(families):
            run_section(section, report, clock, family, device, sz, args, first=i == 0)
    report.meta["seconds"] = round(time.perf_counter() - clock.start, 1)
    report.write()
    print(report.markdown())
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
