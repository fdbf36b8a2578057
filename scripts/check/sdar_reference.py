"""Our SDAR forward against SDAR's own modeling code (JetAstra/SDAR), on the same random weights.

    python scripts/check/sdar_reference.py /path/to/JetAstra/SDAR [--out benchmarks/check/sdar-reference.md]

The path is the repository, a checkout or a bare git directory (the `fetch` tool's mirror). Its
training/model/SDAR-*-Chat/ modeling_sdar.py and configuration_sdar.py are imported as a scratch
package from a temporary folder; nothing of it enters unmask. What that code needs and the CPU
lacks is stood in for, each with the semantics the reference runs on the GPU:

- flash-attn's rms_norm_fn (a Triton kernel): x * rstd * weight in float32, stored in x's dtype,
  as flash-attn's own reference function for that kernel computes it;
- flash-attn's flash_attn_func, which the reference calls only when a call's mask is all true
  (a block attending to the cached blocks and itself): plain attention over all keys;
- einops.rearrange, for the two head-merging patterns the file uses;
- the fused training loss module (Triton; training only) is not imported;
- transformers 5 dropped `LossKwargs` (a typing class), the "default" RoPE initialiser (the
  transformers 4.52 one stands in: inv_freq = theta ** -(2i / head_dim)), configs' default
  pad_token_id (None is passed) and DynamicCache's cache[layer] (a subclass gives it back).

For tiny random configs with the published key set (each published config.json with small
dimensions, the real 151,936-token vocabulary), both models get the same weights and read:

- the canvas forward: prompt + masks up to whole blocks, under the block-causal mask built as
  generate.py builds it (tril over blocks, repeat_interleave by block_length), position ids 0..;
  and again with that mask given as (1, 1, L, L), the shape ours hands to SDPA;
- the cached decode forward: generate.py's prefill of the prompt's whole blocks into a
  DynamicCache (store_kv=True), then the first decode block attending to it (store_kv=False);
  ours is one forward of prompt blocks + that block without any cache (block-causal by position).

It prints and writes max |diff| of logits in float32 and bfloat16, and how far the reference's
own bfloat16 logits are from its float32 ones (the yardstick for bfloat16).
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import TypedDict

import torch
import torch.nn.functional as F

from unmask.config import ModelConfig
from unmask.models import build_model

MODELS = ("SDAR-4B-Chat", "SDAR-8B-Chat")
# Small dimensions, the published head/kv-head ratio (32:8); head_dim 16 is set apart from
# hidden_size / heads (8), as SDAR-4B's 128 is from 2560 / 32.
TINY = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "intermediate_size": 128, "head_dim": 16}
PROMPT_LENGTHS = (3, 4, 7, 9, 12, 16, 21, 30, 37, 45)  # within a block, on edges, many blocks
GEN_LENGTH = 8
CHECKS = ("canvas", "canvas, 4-D mask", "cached")


def repo_file(repo: Path, path: str, commit: str = "HEAD") -> bytes:
    """A file of a checkout (as it is) or a bare git directory (at `commit`)."""
    if (repo / path).is_file():
        return (repo / path).read_bytes()
    return subprocess.check_output(["git", "--git-dir", str(repo), "show", f"{commit}:{path}"])


def read_reference(repo: Path, model: str, name: str) -> bytes:
    """A file of training/model/<model>/."""
    return repo_file(repo, f"training/model/{model}/{name}")


def reference_commit(repo: Path) -> str:
    git = ["git", "--git-dir", str(repo)] if (repo / "HEAD").is_file() else ["git", "-C", str(repo)]
    return subprocess.check_output([*git, "rev-parse", "HEAD"], text=True).strip()


# --- stand-ins for what the reference imports and the CPU lacks ---------------------------------
def flash_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias=None, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    rstd = 1 / torch.sqrt(h.square().mean(dim=-1, keepdim=True) + eps)
    return (h * rstd * weight.float()).to(x.dtype)


def flash_attn_func(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """(B, L, H, D) layout, grouped K/V heads, no mask (the reference's all-true case)."""
    assert not causal
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def rearrange(x: torch.Tensor, pattern: str) -> torch.Tensor:
    if pattern == "b h l d -> b l (h d)":
        return x.transpose(1, 2).flatten(2)
    if pattern == "b l h d -> b l (h d)":
        return x.flatten(2)
    raise NotImplementedError(pattern)


def default_rope(config, device=None) -> tuple[torch.Tensor, float]:
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim
    return 1.0 / (config.rope_theta ** exponent), 1.0


def load_reference(repo: Path, model: str) -> types.ModuleType:
    """The reference's modeling_sdar as package `sdar_modeling` in a temporary folder (not this
    module's own name `sdar_reference`, which the scripts import it by)."""
    # transformers checks for flash_attn when these load: import them before the stand-ins exist
    import transformers.activations  # noqa: F401
    import transformers.generation  # noqa: F401
    import transformers.modeling_rope_utils as rope_utils
    import transformers.modeling_utils  # noqa: F401
    import transformers.utils

    class LossKwargs(TypedDict, total=False):
        pass

    transformers.utils.LossKwargs = LossKwargs
    rope_utils.ROPE_INIT_FUNCTIONS.setdefault("default", default_rope)
    for name in ("flash_attn", "flash_attn.ops", "flash_attn.ops.triton",
                 "flash_attn.ops.triton.layer_norm", "flash_attn.bert_padding", "einops",
                 "sdar_modeling.fused_linear_diffusion_cross_entropy"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["flash_attn.ops.triton.layer_norm"].rms_norm_fn = flash_rms_norm
    sys.modules["flash_attn"].flash_attn_func = flash_attn_func
    sys.modules["einops"].rearrange = rearrange
    loss = sys.modules["sdar_modeling.fused_linear_diffusion_cross_entropy"]
    loss.FusedLinearDiffusionCrossEntropyLoss = None  # training only
    files = {stem: read_reference(repo, model, f"{stem}.py")
             for stem in ("configuration_sdar", "modeling_sdar")}
    return importlib.import_module(f"{scratch_package('sdar_modeling', files).__name__}.modeling_sdar")


def scratch_package(name: str, files: dict[str, bytes]) -> types.ModuleType:
    """Files (stem -> source) as package `name` in a temporary folder, imported; its modules
    import as `name.stem`."""
    package = Path(tempfile.mkdtemp(prefix=f"{name}-")) / name
    package.mkdir()
    (package / "__init__.py").write_bytes(files.get("__init__", b""))
    for stem, text in files.items():
        (package / f"{stem}.py").write_bytes(text)
    sys.path.insert(0, str(package.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(package.parent))


# --- the two models on the same weights ---------------------------------------------------------
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from init (std 0.2; norm weights around 1) so every term matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.2 * noise)


def pair(ref_module: types.ModuleType, raw: dict, seed: int):
    """(ours, reference) in float32 with identical weights, from one config.json dict."""
    ours = build_model(ModelConfig.from_dict(raw)).eval()
    randomize(ours, seed)
    return ours, reference_model(ref_module, raw, ours.state_dict())


def reference_model(ref_module: types.ModuleType, raw: dict, state: dict) -> torch.nn.Module:
    """The reference's SDARForCausalLM in float32 from a config.json dict, holding `state`."""
    config_cls = importlib.import_module("sdar_modeling.configuration_sdar").SDARConfig
    # transformers 4.52 gave every config pad_token_id None; 5 gives none (the embedding reads it)
    config = config_cls(pad_token_id=None, **{k: v for k, v in raw.items() if k != "torch_dtype"})
    config._attn_implementation = "sdpa"  # the published "flex_attention" is training's
    ref = ref_module.SDARForCausalLM(config).eval().float()
    ref.load_state_dict(state, strict=True)
    return ref


def as_loaded(ref: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The reference in `dtype` as from_pretrained(torch_dtype=...) loads it: parameters only,
    RoPE's inv_freq buffer stays float32 (ref.to(dtype) would round it, which generate.py never
    does)."""
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    return ref


def block_mask(num_blocks: int, block_length: int) -> torch.Tensor:
    """generate.py's block_diffusion_attention_mask: (1, L, L) float ones/zeros."""
    blocks = torch.tril(torch.ones(num_blocks, num_blocks))
    return blocks.repeat_interleave(block_length, dim=0).repeat_interleave(block_length, dim=1)[None]


def canvas(prompt: torch.Tensor, mask_id: int, block_length: int) -> tuple[torch.Tensor, int]:
    """generate.py's x: the prompt, then masks to whole blocks past GEN_LENGTH; and its blocks."""
    n = prompt.shape[1]
    num_blocks = (n + GEN_LENGTH + block_length - 1) // block_length
    x = torch.full((1, num_blocks * block_length), mask_id, dtype=torch.long)
    x[:, :n] = prompt
    return x, num_blocks


@torch.no_grad()
def canvas_logits(ours, ref, x: torch.Tensor, num_blocks: int, bl: int, per_head: bool = False):
    """per_head: the mask as (1, 1, L, L) instead of generate.py's (1, L, L), the shape ours
    passes to SDPA (torch's CPU SDPA takes another kernel for a 3-D mask)."""
    pos = torch.arange(x.shape[1])[None]
    got = ours(x, pos).float()
    mask = block_mask(num_blocks, bl)
    want = ref(x, attention_mask=mask[:, None] if per_head else mask, position_ids=pos,
               use_cache=False, return_dict=True).logits.float()
    return got, want


def indexed_cache_class() -> type:
    """DynamicCache as the reference reads transformers 4.52's: cache[layer] -> (k, v)."""
    from transformers.cache_utils import DynamicCache

    class IndexedCache(DynamicCache):
        def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.layers[layer].keys, self.layers[layer].values

    return IndexedCache


@torch.no_grad()
def cached_block_logits(ours, ref, x: torch.Tensor, num_blocks: int, bl: int, n_prompt: int):
    """generate.py's first decode block after its prefill; None when the prompt fills no block."""
    done = n_prompt // bl  # prefill_blocks
    if done == 0:
        return None
    mask, pos = block_mask(num_blocks, bl), torch.arange(x.shape[1])[None]
    cache = indexed_cache_class()()
    end = done * bl
    ref(x[:, :end], attention_mask=mask[:, :end, :end], position_ids=pos[:, :end],
        past_key_values=cache, use_cache=True, store_kv=True)
    blk = slice(end, end + bl)
    want = ref(x[:, blk], attention_mask=mask[:, blk, : end + bl], position_ids=pos[:, blk],
               past_key_values=cache, use_cache=True, store_kv=False).logits.float()
    got = ours(x[:, : end + bl], pos[:, : end + bl])[:, blk].float()
    return got, want


def measure(ref_module, raw: dict, seed: int, folder: Path | None = None) -> dict:
    """max |diff| per check and dtype, over every prompt; folder: an SDAR folder's own weights
    (raw: its config.json over the published one's keys) instead of random ones."""
    if folder is None:
        ours, ref = pair(ref_module, raw, seed)
    else:
        from unmask.checkpoint import load_model

        ours = load_model(folder, dtype=torch.float32).eval()
        ref = reference_model(ref_module, raw, ours.state_dict())
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, raw["mask_token_id"], (1, n), generator=g) for n in PROMPT_LENGTHS]
    bl = raw["block_size"]
    rows: dict = {}
    want32: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        ours = ours.to(dtype)
        as_loaded(ref, dtype)
        for check in CHECKS:
            diffs, ref_drift, agree, scale = [], [], [], []
            for i, p in enumerate(prompts):
                x, num_blocks = canvas(p, raw["mask_token_id"], bl)
                out = (cached_block_logits(ours, ref, x, num_blocks, bl, p.shape[1])
                       if check == "cached" else
                       canvas_logits(ours, ref, x, num_blocks, bl, per_head=check != "canvas"))
                if out is None:
                    continue
                got, want = out
                if dtype == torch.float32:
                    want32[check, i] = want
                base = want32[check, i]
                diffs.append((got - want).abs().max().item())
                ref_drift.append((want - base).abs().max().item())
                agree.append((got.argmax(-1) == want.argmax(-1)).float().mean().item())
                scale.append(want.abs().max().item())
            rows[check, str(dtype).removeprefix("torch.")] = {
                "prompts": len(diffs), "max_diff": max(diffs), "ref_vs_ref_fp32": max(ref_drift),
                "argmax_agree": min(agree), "max_logit": max(scale)}
    return rows


def report(results: dict, commit: str, seconds: float, folders: list[Path] = ()) -> str:
    lines = [
        "# SDAR: our forward vs SDAR's own modeling code",
        "",
        f"`python scripts/check/sdar_reference.py <JetAstra/SDAR>"
        f"{''.join(f' --model {f}' for f in folders)}` (reference commit {commit[:12]}, "
        f"torch {torch.__version__}, transformers {importlib.import_module('transformers').__version__}, "
        f"CPU, {seconds:.0f} s). Tiny random models with each published config.json's keys "
        f"({json.dumps(TINY)}, vocabulary 151,936, random weights std 0.2), "
        f"{len(PROMPT_LENGTHS)} random prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens, "
        f"{GEN_LENGTH} masks after each up to whole blocks. Stand-ins for the CPU: see the script's "
        "docstring (flash-attn's RMSNorm kernel and attention call, einops, transformers 5 renames). "
        "Rows named '(its weights)': an SDAR folder's own trained weights (`--model`), the same "
        "prompts and checks.",
        "",
        "- *canvas*: the whole canvas in one forward under generate.py's block-causal mask;",
        "- *canvas, 4-D mask*: the same mask given to the reference as (1, 1, L, L), the shape ours "
        "passes to SDPA (torch's CPU SDPA takes another kernel for generate.py's 3-D mask);",
        "- *cached*: generate.py's prefill into a DynamicCache, then the first decode block reading "
        "it (ours: one forward without a cache, block-causal by position id; the reference attends "
        "there through flash_attn_func, stood in for by SDPA without a mask);",
        "- *max |diff|*: ours vs the reference in the same dtype; *ref drift from its fp32*: the "
        "reference's own bfloat16 logits vs its float32 ones (the yardstick for bfloat16).",
        "",
        "Reading: in float32 the two agree to about 1e-5 (1e-6 of the largest logit; the stood-in "
        "norm kernel's 1/sqrt against torch's rsqrt). In bfloat16, with the mask in the same shape on "
        "both sides, the logits are equal bit for bit: every rounding is the same (norms scaled in "
        "float32 and rounded once, as flash-attn's kernel does; RoPE's inv_freq in float32, as "
        "from_pretrained keeps it; cos/sin and the rotation in bfloat16). With generate.py's 3-D "
        "mask, or through the reference's cache path, torch's CPU SDPA runs other kernels and the "
        "difference stays below the reference's own bfloat16 drift from its float32 logits.",
        "",
        "| config | check | dtype | prompts | max \\|logit\\| | max \\|diff\\| | ref drift from its fp32 "
        "| argmax agree (worst prompt) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, rows in results.items():
        for (check, dtype), r in rows.items():
            lines.append(f"| {model} | {check} | {dtype} | {r['prompts']} | {r['max_logit']:.2f} | "
                         f"{r['max_diff']:.3g} | {r['ref_vs_ref_fp32']:.3g} | {r['argmax_agree']:.4f} |")
    return "\n".join(lines) + "\n"


def script_args(doc: str, *positional: tuple[str, dict]) -> argparse.Namespace:
    """The reference scripts' command line: their positionals, --out and --threads (applied)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, kw in positional:
        ap.add_argument(name, **kw)
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def publish(text: str, out: Path | None) -> None:
    print(text)
    if out:
        out.write_text(text)


def main() -> None:
    args = script_args(__doc__, ("repo", {"type": Path, "help": "JetAstra/SDAR: a checkout or a "
                                          "bare git directory"}),
                       ("--model", {"type": Path, "action": "append", "default": [],
                                    "help": "also an SDAR folder's own weights (repeatable)"}))
    start = time.perf_counter()
    results = {}
    ref_module = None
    for seed, model in enumerate(MODELS):
        raw = {**json.loads(read_reference(args.repo, model, "config.json")), **TINY}
        if model == "SDAR-8B-Chat":  # the 8B shape: head_dim = hidden_size / heads
            raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
        ref_module = ref_module or load_reference(args.repo, model)
        results[f"{model} tiny"] = measure(ref_module, raw, seed)
    for folder in args.model:  # the published config's keys the folder lacks (training-only)
        raw = {**json.loads(read_reference(args.repo, MODELS[0], "config.json")),
               **json.loads((folder / "config.json").read_text())}
        results[f"{folder.name} (its weights)"] = measure(ref_module, raw, 0, folder)
    publish(report(results, reference_commit(args.repo), time.perf_counter() - start, args.model),
            args.out)


if __name__ == "__main__":
    main()
