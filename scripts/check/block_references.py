"""Our LLaDA2 and Fast-dLLM v2 forwards against each family's own modeling code, same weights.

    python scripts/check/block_references.py llada2 /path/to/ZHZisZZ/dllm \\
        [--out benchmarks/check/llada2-reference.md]
    python scripts/check/block_references.py fast-dllm-v2 /path/to/Satgoy152/DualDiffusion \\
        [--out benchmarks/check/fast-dllm-v2-reference.md]

The path is a checkout or a bare git directory (the `fetch` tool's mirror) of a repository that
vendors the published folder's remote code: LLaDA2.0's configuration_llada2_moe.py and
modeling_llada2_moe.py (dllm/pipelines/llada2/models/, whose only change to the published file
is accepting a boolean 4-D mask; generate() builds a float one), and Fast-dLLM v2 7B's
configuration.py and modeling.py (FastDLLM_inferencing/Fast_dLLM_v2_7B/ at d3a3470, which
only renamed the folder the files were added in at 189fa7a; in between, b919117 "Added cache
carryover": generate() keeps its block cache across blocks). The files are imported as a scratch package
from a temporary folder, as scripts/check/sdar_reference.py does (its helpers are reused);
nothing of them enters unmask. Stand-ins for what transformers 5 dropped: the names those files
import for torch.fx and version checks, the "default" RoPE initialiser (transformers 4.52's, with
the partial rotary factor it reads), and einops (imported by Fast-dLLM's file, never called at
inference).

For tiny random configs with the published key set (each published config.json with small
dimensions and the real vocabulary), both models get the same weights and read the canvas
forward: prompt + masks up to whole blocks. LLaDA2: its generate()'s additive block mask
(tril over blocks, repeat_interleave, log), in the model dtype; Fast-dLLM v2: its own
eval_block_diff_mask, built by its forward from block_size = bd_size. Written: max |diff| of
logits in float32 and bfloat16, argmax agreement, and the reference's own bfloat16 drift from its
float32 logits (the yardstick for bfloat16).

Then decoding, NFE and token-forwards per generated token: LLaDA2's tokens against its
generate() in each of its modes (`GENERATE_MODES`); Fast-dLLM v2's modes of ours against
tests/block_reference.py's loop with the same rule (`FAST_MODES`), and its own generate()
(DynamicCache's cache[layer] stood in for, as sdar_reference.py does) on its own tokens.
Last, Fast-dLLM v2's own routine (threshold, small_block_size, use_block_cache: as at d3a3470,
and with the block cache emptied at each block as 189fa7a's file does, b919117's deleted line
edited back into a copy) against the spec `threshold,...,sub_block_length=S`
(docs/fast-dllm-v2-reference-semantics.md), with tests/block_reference.py's re-implementation of
it beside.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # block_reference
import block_reference  # noqa: E402  (the CI test's re-implementation, checked here)
from helpers import kv_forward  # noqa: E402  (its block cache's forwards through our model)
from sdar_reference import (  # noqa: E402  (the loaders and stand-ins, shared)
    PROMPT_LENGTHS,
    block_mask,
    canvas,
    default_rope,
    indexed_cache_class,
    publish,
    randomize,
    reference_commit,
    repo_file,
    scratch_package,
    script_args,
)

from unmask.config import ModelConfig  # noqa: E402
from unmask.models import build_model  # noqa: E402

FAMILIES = {
    # repository, folder, files, commit (None: the snapshot's), config, modeling module, LM class
    "llada2": ("ZHZisZZ/dllm", "dllm/pipelines/llada2/models", ("configuration_llada2_moe.py",
               "modeling_llada2_moe.py"), None, "tests/data/llada2-mini.config.json",
               "modeling_llada2_moe", "LLaDA2MoeModelLM"),
    "fast-dllm-v2": ("Satgoy152/DualDiffusion", "FastDLLM_inferencing/Fast_dLLM_v2_7B",
                     ("configuration.py", "modeling.py"), "d3a3470",
                     "tests/data/fast-dllm-v2-7b.config.json", "modeling", "Fast_dLLM_QwenForCausalLM"),
}
# Small dimensions, the published head/kv-head ratios (LLaDA2 16:4, Fast-dLLM v2 7B 28:4),
# LLaDA2's 8 groups of which 4 are drawn and 8 experts per token on 32 experts.
TINY = {
    "llada2": {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
               "num_hidden_layers": 3, "intermediate_size": 128, "head_dim": 16,
               "moe_intermediate_size": 16, "num_experts": 32},
    "fast-dllm-v2": {"hidden_size": 112, "num_attention_heads": 7, "num_key_value_heads": 1,
                     "num_hidden_layers": 2, "intermediate_size": 128, "bd_size": 8,
                     "layer_types": ["full_attention"] * 2},
}


READING = {
    "llada2": "Reading: in float32 the two agree to a few 1e-6 (below 1e-6 of the largest logit; "
              "matmuls of another shape: ours runs each expert on its tokens gathered, the reference "
              "its moe_infer's). In bfloat16 they are equal bit for bit: every rounding is the same "
              "(the router and the routed sum in float32, rounded once; norms in float32, cast, then "
              "scaled; cos/sin rounded to bfloat16). The reference's own bfloat16 logits are far "
              "from its float32 ones because rounding flips some tokens' expert choices.",
    "fast-dllm-v2": "Reading: equal bit for bit in float32 and bfloat16: the same Qwen2 operations "
                    "in the same order and the same SDPA kernel under the same boolean block mask "
                    "(the script also checks the mask matters: the reference with one block of the "
                    "whole canvas moves the logits by up to 13).",
}


def stand_ins() -> None:
    """What the reference files import and transformers 5 no longer has."""
    import transformers.modeling_rope_utils as rope_utils
    import transformers.pytorch_utils as pytorch_utils
    import transformers.utils.import_utils as import_utils

    import_utils.is_torch_fx_available = getattr(import_utils, "is_torch_fx_available", lambda: False)
    pytorch_utils.is_torch_greater_or_equal_than_1_13 = True
    pytorch_utils.ALL_LAYERNORM_LAYERS = getattr(pytorch_utils, "ALL_LAYERNORM_LAYERS", [])

    def partial_default_rope(config, device=None):
        factor = getattr(config, "partial_rotary_factor", 1.0)
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head * factor)
        return default_rope(types.SimpleNamespace(head_dim=dim, rope_theta=config.rope_theta), device)

    rope_utils.ROPE_INIT_FUNCTIONS["default"] = partial_default_rope
    sys.modules.setdefault("einops", types.ModuleType("einops"))
    sys.modules["einops"].rearrange = sys.modules["einops"].repeat = None  # training only


def load_reference(family: str, repo: Path) -> types.ModuleType:
    _, folder, names, commit, *_ = FAMILIES[family]
    stand_ins()
    files = {Path(n).stem: repo_file(repo, f"{folder}/{n}", commit or "HEAD") for n in names}
    package = scratch_package(f"{family.replace('-', '_')}_reference", files)
    module = importlib.import_module(f"{package.__name__}.{FAMILIES[family][5]}")
    module.DynamicCache = indexed_cache_class()  # Fast-dLLM v2's generate() reads cache[layer]
    return module


def pair(family: str, module: types.ModuleType, raw: dict, seed: int):
    """(ours, reference) in float32 with identical weights (and LLaDA2's expert_bias)."""
    ours = build_model(ModelConfig.from_dict(raw)).eval()
    randomize(ours, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, b in ours.named_buffers():
            if name.endswith("expert_bias"):  # large enough to change which experts win
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    config_module = importlib.import_module(module.__name__.rsplit(".", 1)[0] + "." + (
        "configuration_llada2_moe" if family == "llada2" else "configuration"))
    config_cls = next(v for k, v in vars(config_module).items() if k.endswith("Config")
                      and k != "PretrainedConfig" and isinstance(v, type))
    config = config_cls(**{k: v for k, v in raw.items() if k not in ("torch_dtype", "model_type")})
    config._attn_implementation = "sdpa"
    ref = getattr(module, FAMILIES[family][6])(config).eval().float()
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


@torch.no_grad()
def reference_logits(family: str, ref, x: torch.Tensor, num_blocks: int, bl: int,
                     dtype: torch.dtype) -> torch.Tensor:
    pos = torch.arange(x.shape[1])[None]
    if family == "llada2":  # generate()'s mask: log of the 0/1 block mask, an additive one
        mask = block_mask(num_blocks, bl)[:, None].log().to(dtype)
        return ref(x, attention_mask=mask, position_ids=pos).logits.float()
    return ref(x, position_ids=pos, block_size=bl, use_cache=False).logits.float()


def measure(family: str, module, raw: dict, seed: int, mask_id: int, bl: int,
            eos_id: int) -> tuple[dict, list[dict]]:
    """Logits per dtype; and, for LLaDA2, tokens against generate() (float32)."""
    ours, ref = pair(family, module, raw, seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 150_000, (1, n), generator=g) for n in PROMPT_LENGTHS]
    tokens = GENERATIONS[family](ours, ref, prompts, mask_id, eos_id)
    rows, want32 = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        ours = ours.to(dtype)
        for p in ref.parameters():  # parameters only: RoPE's inv_freq stays float32
            p.data = p.data.to(dtype)
        for name, b in ref.named_buffers():
            if name.endswith("expert_bias"):
                b.data = b.data.to(dtype)
        diffs, drift, agree, scale = [], [], [], []
        for i, p in enumerate(prompts):
            x, num_blocks = canvas(p, mask_id, bl)
            with torch.no_grad():
                got = ours(x, torch.arange(x.shape[1])[None]).float()
            want = reference_logits(family, ref, x, num_blocks, bl, dtype)
            want32.setdefault(i, want)
            diffs.append((got - want).abs().max().item())
            drift.append((want - want32[i]).abs().max().item())
            agree.append((got.argmax(-1) == want.argmax(-1)).float().mean().item())
            scale.append(want.abs().max().item())
        rows[str(dtype).removeprefix("torch.")] = {
            "prompts": len(diffs), "max_diff": max(diffs), "ref_vs_ref_fp32": max(drift),
            "argmax_agree": min(agree), "max_logit": max(scale)}
    return rows, tokens


# LLaDA2's generate() (greedy) against our engine: (its threshold, its steps per block of 32)
# and the spec that should give the same tokens on a gen_length of 64 (two blocks). A threshold
# of 1 is never exceeded (its test is `>`), so each step commits its schedule's count: static.
# Below 1, a step commits what exceeds it when that is at least the schedule's count, else the
# count's best: our threshold with `steps` as its floor (one a step without; ours tests `>=`,
# so only an exact tie with the threshold tells them apart).
GENERATE_MODES = (("static-1", 1.0, 32), ("static,steps=16", 1.0, 8),
                  ("threshold,threshold=0.95", 0.95, 32), ("threshold,threshold=0.5", 0.5, 32),
                  ("threshold,threshold=0.95,steps=16", 0.95, 8),
                  ("threshold,threshold=0.5,steps=8", 0.5, 4),
                  # FreeDave reproduces its rule: static-1's and threshold's tokens, fewer calls;
                  # the presets keep their rules and take the model's blocks
                  ("exact", 1.0, 32), ("freedave++,draft_steps=4,threshold=0.5", 0.5, 32),
                  ("freedave++,threshold=0.99,draft_conf=0.9,early_exit=true", 0.99, 32),
                  ("fast", 0.9, 32))
GEN_TOKENS = 64
PEAK = 8.0  # the LM head's scale for the token comparison (a power of two: exact both ways)


def counted(ref) -> dict:
    """Wrap ref.forward to count its calls and the tokens they process. generate() builds its
    mask in bfloat16, the dtype the published model runs in, which SDPA refuses next to float32
    queries: it is cast to the parameters' dtype (its values, 0 and -inf, are exact in both)."""
    count = {"nfe": 0, "tokens": 0}
    forward = ref.forward
    dtype = next(ref.parameters()).dtype

    def spy(input_ids, *args, attention_mask=None, **kw):
        count["nfe"] += 1
        count["tokens"] += input_ids.numel()
        if attention_mask is not None:
            attention_mask = attention_mask.to(dtype)
        return forward(input_ids, *args, attention_mask=attention_mask, **kw)

    ref.forward = spy
    return count


@torch.no_grad()
def generation(ours, ref, prompts: list[torch.Tensor], mask_id: int, eos_id: int) -> list[dict]:
    """Per mode: prompts whose tokens equal generate()'s, and NFE / token-forwards per generated
    token, ours against generate()'s (which forwards the whole prefix every step, no cache)."""
    from unmask.decoding.params import DecodeParams
    from unmask.engine import decode
    from unmask.engine.layout import model_defaults

    count = counted(ref)
    for m in (ours, ref):  # peaky: random weights' confidences would never reach a threshold
        m.lm_head.weight.data.mul_(PEAK)
    out = []
    for spec, threshold, steps in GENERATE_MODES:
        params = DecodeParams.parse(spec, gen_length=GEN_TOKENS, **model_defaults(ours))
        same, tokens, ours_cost, ref_cost = 0, 0, [0, 0], [0, 0]
        for p in prompts:
            before = dict(count)
            want = ref.generate(p, temperature=0.0, block_length=32, steps=steps,
                                gen_length=GEN_TOKENS, threshold=threshold, eos_id=eos_id,
                                mask_id=mask_id)[0].tolist()
            (req,) = decode(ours, params, [p[0].tolist()], mask_id=mask_id, eos_id=eos_id)
            same += req.token_ids[: len(want)] == want
            tokens += len(want)
            ours_cost = [ours_cost[0] + req.nfe, ours_cost[1] + req.token_forwards]
            ref_cost = [ref_cost[0] + count["nfe"] - before["nfe"],
                        ref_cost[1] + count["tokens"] - before["tokens"]]
        out.append({"spec": spec, "threshold": threshold, "steps": steps, "same": same,
                    "prompts": len(prompts), "tokens": tokens,
                    "nfe": (ours_cost[0] / tokens, ref_cost[0] / tokens),
                    "token_forwards": (ours_cost[1] / tokens, ref_cost[1] / tokens)})
    for m in (ours, ref):
        m.lm_head.weight.data.div_(PEAK)  # a power of two: the logit checks see the same weights
    return out


# Fast-dLLM v2 (blocks of bd_size 8 here, gen_length 32: four blocks): each of our modes against
# the generate.py-style loop of tests/block_reference.py on the same model with its logits read
# one position back (the loop's accounting: a prefill of the prompt's whole blocks, the denoising
# forwards, a store forward per block); (spec, the loop's strategy, its steps per block (None:
# the block's size), threshold). The loop caps a step's count at the masks left, as ours.
FAST_GEN = 32
FAST_MODES = (("static-1", "static", None, None), ("static,steps=16", "static", 4, None),
              ("threshold,threshold=0.9", "dynamic", None, 0.9),
              ("threshold,threshold=0.5", "dynamic", None, 0.5),
              ("threshold,threshold=0.9,steps=8", "dynamic", 2, 0.9),
              ("exact", "static", None, None), ("freedave++,draft_steps=4,threshold=0.5", "dynamic",
                                                None, 0.5),
              ("freedave++,threshold=0.99,draft_conf=0.9,early_exit=true", "dynamic", None, 0.99),
              ("fast", "dynamic", None, 0.9))
# Its published generate() (greedy, use_block_cache: the cache of the current block): (threshold,
# small_block_size); its own tokens, compared with our threshold's at the same value.
FAST_GENERATE = ((0.9, 8), (0.9, 4), (0.5, 8))


def shifted(model) -> Callable:
    """The model's forward as Fast-dLLM v2's generate() reads it: position i's prediction from
    the hidden state at i - 1 (position 0 keeps its own)."""
    def forward(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        logits = model(ids, pos)
        return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return forward


def ours_run(ours, spec: str, prompt: torch.Tensor, mask_id: int, eos_id: int, gen: int):
    from unmask.decoding.params import DecodeParams
    from unmask.engine import decode
    from unmask.engine.layout import model_defaults

    params = DecodeParams.parse(spec, gen_length=gen, **model_defaults(ours))
    (req,) = decode(ours, params, [prompt[0].tolist()], mask_id=mask_id, eos_id=eos_id)
    return req


@torch.no_grad()
def fast_generation(ours, ref, prompts: list[torch.Tensor], mask_id: int, eos_id: int) -> list[dict]:
    """Our modes against the reference loop (same tokens), then the published generate()."""
    from block_reference import Strategy, answer, generate

    bs = ours.config.block_size
    for m in (ours, ref):
        m.lm_head.weight.data.mul_(PEAK)
    out = []
    for spec, name, steps, threshold in FAST_MODES:
        strategy = Strategy(name, steps or bs, threshold=threshold or 0.85, at_least=True, capped=True)
        same, tokens, mine, loop = 0, 0, [0, 0], [0, 0]
        for p in prompts:
            req = ours_run(ours, spec, p, mask_id, eos_id, FAST_GEN)
            want = generate(shifted(ours), p[0].tolist(), mask_id, FAST_GEN, bs, strategy, [eos_id])
            got_ids = answer(req.token_ids, eos_id, FAST_GEN, mask_id)
            want_ids = answer(want.canvas[p.shape[1]:], eos_id, FAST_GEN, mask_id)
            same += got_ids == want_ids
            tokens += len(want_ids)
            mine = [mine[0] + req.nfe, mine[1] + req.token_forwards]
            loop = [loop[0] + want.nfe, loop[1] + want.token_forwards]
        out.append({"spec": spec, "same": same, "prompts": len(prompts), "tokens": tokens,
                    "nfe": (mine[0] / tokens, loop[0] / tokens),
                    "token_forwards": (mine[1] / tokens, loop[1] / tokens)})
    out += published_fast_generate(ours, ref, prompts, mask_id, eos_id)
    for m in (ours, ref):
        m.lm_head.weight.data.div_(PEAK)
    return out


def published_fast_generate(ours, ref, prompts: list[torch.Tensor], mask_id: int,
                            eos_id: int) -> list[dict]:
    """Fast-dLLM v2's generate() on its own: cost per token of its own tokens, and on how many
    prompts those equal our threshold's at the same value (its first token of a block is the
    previous block's store forward's argmax, ours a step of the rule, so they may differ)."""
    count = counted(ref)
    bs = ours.config.block_size
    out = []
    for threshold, small in FAST_GENERATE:
        same, theirs, cost, ours_tokens, mine = 0, 0, [0, 0], 0, [0, 0]
        for p in prompts:
            before = dict(count)
            ids = ref.generate(p, max_new_tokens=FAST_GEN, mask_id=mask_id, threshold=threshold,
                               small_block_size=small, block_size=bs, stop_token=eos_id,
                               temperature=0, use_block_cache=True)[0][0, p.shape[1]:].tolist()
            cost = [cost[0] + count["nfe"] - before["nfe"], cost[1] + count["tokens"] - before["tokens"]]
            theirs += len(ids)
            req = ours_run(ours, f"threshold,threshold={threshold}", p, mask_id, eos_id, FAST_GEN)
            n = min(len(ids), len(req.token_ids))
            same += req.token_ids[:n] == ids[:n]
            ours_tokens += len(req.token_ids)
            mine = [mine[0] + req.nfe, mine[1] + req.token_forwards]
        out.append({"spec": f"generate(threshold={threshold}, small_block_size={small})",
                    "same": same, "prompts": len(prompts), "tokens": theirs,
                    "nfe": (mine[0] / ours_tokens, cost[0] / theirs),
                    "token_forwards": (mine[1] / ours_tokens, cost[1] / theirs)})
    return out


def generation_table(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "## Tokens against the published generate()",
        "",
        f"The same float32 models, their LM head scaled by {PEAK:g} so that confidences reach "
        "the thresholds (random weights over 157,184 tokens stay below 0.5): LLaDA2's generate() "
        f"(greedy, gen_length {GEN_TOKENS}, "
        "block_length 32, eos_early_stop off) against `LLM.generate`'s engine with the spec "
        "below, on the same prompts. Tokens compared up to generate()'s first EOS (it returns "
        "no more); NFE and token-forwards per generated token, ours / generate()'s (it forwards "
        "the whole prefix at every step, no K/V cache; ours reads finished blocks from the "
        "store and fuses a block's store forward with the next block's first step). "
        "generate()'s threshold below 1 with fewer steps than the block is a threshold with a "
        "static floor of several tokens a step: our threshold with `steps` (over gen_length, "
        "so twice generate()'s per-block steps here).",
        "",
        "| generate() threshold, steps | our spec | prompts identical | NFE per token (ours / ref) "
        "| token-forwards per token (ours / ref) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['threshold']}, {r['steps']} | `{r['spec']}` | {r['same']}/{r['prompts']} "
                     f"| {r['nfe'][0]:.2f} / {r['nfe'][1]:.2f} | {r['token_forwards'][0]:.1f} / "
                     f"{r['token_forwards'][1]:.1f} |")
    return lines


def fast_generation_table(rows: list[dict]) -> list[str]:
    n_modes = len(FAST_MODES)
    lines = [
        "",
        "## Cost per token against the reference loop and the published generate()",
        "",
        f"The same float32 model, its LM head scaled by {PEAK:g}, gen_length {FAST_GEN} (blocks of "
        "8). First each of our decoding modes against tests/block_reference.py's generate.py-style "
        "loop with the same rule on the same model, its logits read one position back as "
        "Fast-dLLM v2's generate() reads them (a prefill of the prompt's whole blocks, the "
        "denoising forwards of the whole block, a store forward per block): tokens compared "
        "through the first EOS; NFE and token-forwards per generated token, ours / the loop's. "
        "Then Fast-dLLM v2's own generate() (greedy, the cache of the current block): its cost "
        "per token of its own tokens against our `threshold` at its threshold on ours, and the "
        "prompts where the two agree; it commits a block's first token as the argmax of the "
        "previous block's store forward and thresholds inside sub-blocks, which our rules do "
        "not, so its tokens are not ours (sub-block decoding is a spec of its own).",
        "",
        "| our spec / reference | prompts identical | NFE per token (ours / ref) | token-forwards "
        "per token (ours / ref) |",
        "|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        name = f"`{r['spec']}`" if i < n_modes else r["spec"]
        lines.append(f"| {name} | {r['same']}/{r['prompts']} | {r['nfe'][0]:.2f} / "
                     f"{r['nfe'][1]:.2f} | {r['token_forwards'][0]:.1f} / "
                     f"{r['token_forwards'][1]:.1f} |")
    return lines


def report(family: str, rows: dict, tokens: list[dict], commit: str, seconds: float) -> str:
    title = {"llada2": "LLaDA2", "fast-dllm-v2": "Fast-dLLM v2"}[family]
    lines = [
        f"# {title}: our forward vs its own modeling code",
        "",
        f"`python scripts/check/block_references.py {family} <{FAMILIES[family][0]}>` (snapshot "
        f"{commit[:12]}, files {FAMILIES[family][1]}/ at {FAMILIES[family][3] or 'that commit'}; "
        f"torch {torch.__version__}, transformers "
        f"{importlib.import_module('transformers').__version__}, CPU, {seconds:.0f} s). A tiny "
        f"random model with the published config.json's keys ({json.dumps(TINY[family])}, the "
        "real vocabulary, weights std 0.2, norms around 1"
        + (", expert_bias std 0.3" if family == "llada2" else "") + f"), {len(PROMPT_LENGTHS)} "
        f"random prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens, 8 masks after each up "
        "to whole blocks, one forward of the canvas under the reference's own block mask. Stand-ins: "
        "see the script's docstring.",
        "",
        READING[family],
        "",
        "| dtype | prompts | max \\|logit\\| | max \\|diff\\| | ref drift from its fp32 | argmax agree "
        "(worst prompt) |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, r in rows.items():
        lines.append(f"| {dtype} | {r['prompts']} | {r['max_logit']:.2f} | {r['max_diff']:.3g} | "
                     f"{r['ref_vs_ref_fp32']:.3g} | {r['argmax_agree']:.4f} |")
    if tokens:
        lines += TABLES[family](tokens)
    return "\n".join(lines) + "\n"


# Fast-dLLM v2's generate() (greedy) against our engine: its threshold (1, its default, is never
# exceeded: one token a step, our static-1), its small_block_size, with and without its
# use_block_cache, on FD2_TOKENS tokens of whole blocks (docs/fast-dllm-v2-reference-semantics.md).
FD2_THRESHOLDS = (1.0, 0.9, 0.5)
FD2_SUB_BLOCKS = (2, 4, 8)
FD2_TOKENS = 32
# our cache -> the generate() modes it is compared with: the exact block cache with all three,
# cache=sub_block (its use_block_cache, emptied per block) with the corrected one
FD2_CACHES = {"block": ("off", "on", "on, reset per block"), "sub_block": ("on, reset per block",)}


def fd2_spec(threshold: float, sub: int) -> str:
    rule = "static-1" if threshold == 1 else f"threshold,threshold={threshold}"
    return f"{rule},sub_block_length={sub}"


@torch.no_grad()
def fd2_generation(ours, ref, prompts: list[torch.Tensor], mask_id: int, eos_id: int) -> list[dict]:
    """Per mode: prompts whose tokens equal generate()'s, its tokens per prompt, and NFE /
    token-forwards per decoded slot, ours against generate()'s; tests/block_reference.py's
    re-implementation beside, through our model (tokens and counts equal to generate()'s
    without its block cache)."""
    from unmask.decoding.params import DecodeParams
    from unmask.engine import decode

    fixed = with_block_cache_reset(ref)
    for m in (ref, fixed):  # transformers 4's cache[layer] -> (k, v)
        sys.modules[type(m).__module__].DynamicCache = indexed_cache_class()
    count = counted(ref)
    refs = {"off": (ref, count), "on": (ref, count), "on, reset per block": (fixed, counted(fixed))}
    bs = ours.config.block_size
    out = []
    for m in (ours, ref, fixed):  # peaky, as for LLaDA2's tokens
        m.lm_head.weight.data.mul_(PEAK)
    ignored = one_block_prompt_ignored(ref, mask_id, eos_id, bs)
    for threshold in FD2_THRESHOLDS:
        for sub in FD2_SUB_BLOCKS:
            for cache in FD2_CACHES:
                params = DecodeParams.parse(fd2_spec(threshold, sub), gen_length=FD2_TOKENS,
                                            block_length=bs, cache=cache)
                reqs = decode(ours, params, [p[0].tolist() for p in prompts], mask_id=mask_id,
                              eos_id=eos_id)
                for block_cache in FD2_CACHES[cache]:
                    model, count = refs[block_cache]
                    row = {"spec": f"{params.name},cache={cache}", "threshold": threshold,
                           "sub": sub, "bs": bs, "cache": cache, "block_cache": block_cache,
                           "prompts": len(prompts), "one_block_ignored": ignored}
                    out.append(fd2_mode(ours, model, count, prompts, reqs, row, mask_id, eos_id))
    for m in (ours, ref, fixed):
        m.lm_head.weight.data.div_(PEAK)
    return out


def fd2_mode(ours, ref, count: dict, prompts: list[torch.Tensor], reqs: list, row: dict,
             mask_id: int, eos_id: int) -> dict:
    """One generate() mode against our requests `reqs` of the same prompts."""
    bs = ours.config.block_size
    reimpl = REIMPL_OF.get((row["cache"], row["block_cache"]))
    same = reimpl_same = agree = compared = slots = 0
    ours_cost, ref_cost, reimpl_cost = [0, 0], [0, 0], [0, 0]
    for p, req in zip(prompts, reqs, strict=True):
        n = p.shape[1]
        budget = -(-(n + FD2_TOKENS) // bs) * bs - n // bs * bs  # our canvas, in its blocks
        before = dict(count)
        want = ref.generate(p, max_new_tokens=budget, mask_id=mask_id, threshold=row["threshold"],
                            small_block_size=row["sub"], block_size=bs, stop_token=eos_id,
                            temperature=0, use_block_cache=row["block_cache"] != "off",
                            )[0][0, n:].tolist()
        k = min(len(want), len(req.token_ids))  # ours: cut at gen_length
        same += req.token_ids[:k] == want[:k]
        agree += sum(a == b for a, b in zip(req.token_ids[:k], want[:k], strict=True))
        compared += k
        slots += req.canvas
        ours_cost = [ours_cost[0] + req.nfe, ours_cost[1] + req.token_forwards]
        ref_cost = [ref_cost[0] + count["nfe"] - before["nfe"],
                    ref_cost[1] + count["tokens"] - before["tokens"]]
        if reimpl is not None:  # the re-implementation in the same mode, held to generate()
            r = block_reference.fast_dllm_v2(lambda ids, pos: ours(ids, pos), p[0].tolist(),
                                             mask_id, budget, bs, row["sub"], row["threshold"],
                                             eos_id, kv_forward(ours, bs) if reimpl else None)
            reimpl_same += r.canvas == want
            reimpl_cost = [reimpl_cost[0] + r.nfe, reimpl_cost[1] + r.token_forwards]
    return {**row, "same": same, "agree": agree, "compared": compared,
            "reimpl_same": None if reimpl is None else reimpl_same,
            "reimpl_counts_equal": reimpl_cost == ref_cost,
            "nfe": (ours_cost[0] / slots, ref_cost[0] / slots),
            "token_forwards": (ours_cost[1] / slots, ref_cost[1] / slots)}


# (our cache, generate()'s mode) -> whether tests/block_reference.py's loop runs with its block
# cache, for the rows that hold it to generate()
REIMPL_OF = {("block", "off"): False, ("sub_block", "on, reset per block"): True}


# Fast-dLLM v2's generate() at d3a3470 keeps its block cache from one block to the next (commit
# b919117, "Added cache carryover", deleted this line); the file as 189fa7a added it empties it
# at each block (docs/fast-dllm-v2-reference-semantics.md).
FD2_RESET = ("            x_t = x_init.clone()\n",
             "            x_t = x_init.clone()\n            block_past_key_values = None\n")


def with_block_cache_reset(ref):
    """The reference model with generate() as modeling.py was added at 189fa7a (FD2_RESET,
    edited into a copy of the loaded files), the same weights."""
    folder = Path(sys.modules[type(ref).__module__].__file__).parent
    files = {f.stem: f.read_bytes() for f in folder.glob("*.py")}
    old, new = (t.encode() for t in FD2_RESET)
    if files["modeling"].count(old) != 1:
        raise SystemExit(f"modeling.py: the line to edit is not there once: {FD2_RESET[0]!r}")
    files["modeling"] = files["modeling"].replace(old, new)
    module = importlib.import_module(f"{scratch_package('fast_dllm_v2_reset', files).__name__}.modeling")
    model = getattr(module, type(ref).__name__)(ref.config).eval().float()
    model.load_state_dict(ref.state_dict(), strict=True)
    return model


@torch.no_grad()
def one_block_prompt_ignored(ref, mask_id: int, eos_id: int, bs: int) -> bool:
    """generate() with a prompt of exactly one block: it skips the prefill (P > block_size) and
    decodes the next block without the prompt, so two different prompts give the same tokens."""
    g = torch.Generator().manual_seed(7)
    a, b = (torch.randint(0, 150_000, (1, bs), generator=g) for _ in range(2))
    run = [ref.generate(p, max_new_tokens=bs, mask_id=mask_id, threshold=0.9, small_block_size=bs,
                        block_size=bs, stop_token=eos_id, temperature=0)[0][0, bs:].tolist()
           for p in (a, b)]
    return run[0] == run[1]


def fd2_table(rows: list[dict]) -> list[str]:
    setting = (
        f"The same float32 models, their LM head scaled by {PEAK:g} so that confidences reach "
        f"the thresholds. generate() greedy (temperature 0), block_size {rows[0]['bs']} (the "
        "model's bd_size), "
        f"on the {len(PROMPT_LENGTHS)} prompts above, max_new_tokens = our canvas in its blocks "
        f"(gen_length {FD2_TOKENS} rounded to whole blocks), against `LLM.generate`'s engine "
        "with the spec below. Tokens compared up to generate()'s stop (it returns no more) or "
        "our canvas; NFE and token-forwards per decoded slot, ours / generate()'s (generate() "
        "forwards the block with the prefix's K/V read from its cache; with use_block_cache a "
        "sub-block's later steps forward the sub-block alone and read the rest of the block "
        "from its block cache). use_block_cache *on*: generate() as Satgoy152/DualDiffusion's "
        "file is at d3a3470, which keeps the block cache from one block to the next (that "
        "repository's commit b919117, \"Added cache carryover\", deleted the line that emptied "
        "it); *on, reset per block*: the same file with that line put back "
        "(`block_past_key_values = None` at each block, edited into a copy: FD2_RESET), "
        "generate() as the file was added at 189fa7a. Our spec with `cache=block` is exact (that "
        "block cache holds only final K/V); with `cache=sub_block` it is use_block_cache reset "
        "per block. *re-impl*: tests/block_reference.py's loop through our model in the same "
        "mode (with its block cache for `cache=sub_block`), prompts identical to generate() and "
        "its NFE / token-forwards equal to generate()'s.")
    lines = [
        "", "## Its sub-block routine as our spec: tokens against its generate()", "", setting, "",
        f"A prompt of exactly one block ({rows[0]['bs']} tokens): generate() skips its prefill "
        "(`input_ids.shape[1] > block_size`) and decodes without the prompt; two different "
        f"prompts gave the same tokens: {rows[0]['one_block_ignored']} (no prompt here has that "
        "length; ours prefills it).",
        "",
        "| generate() threshold, small_block_size | use_block_cache | our spec | prompts identical "
        "| tokens agreeing | NFE per slot (ours / ref) | token-forwards per slot (ours / ref) "
        "| re-impl |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines[-2:-2] = fd2_reading(rows)  # before the table
    for r in rows:
        reimpl = ("-" if r["reimpl_same"] is None else
                  f"{r['reimpl_same']}/{r['prompts']}, counts "
                  f"{'equal' if r['reimpl_counts_equal'] else 'differ'}")
        lines.append(f"| {r['threshold']:g}, {r['sub']} | {r['block_cache']} | `{r['spec']}` | "
                     f"{r['same']}/{r['prompts']} | {r['agree']}/{r['compared']} | "
                     f"{r['nfe'][0]:.2f} / {r['nfe'][1]:.2f} | {r['token_forwards'][0]:.1f} / "
                     f"{r['token_forwards'][1]:.1f} | {reimpl} |")
    return lines


def fd2_reading(rows: list[dict]) -> list[str]:
    """The table in three sentences, from its rows."""
    exact = [r for r in rows if r["cache"] == "block"]
    off = [r for r in exact if r["block_cache"] == "off"]
    cached = [r for r in exact if r["block_cache"] != "off" and r["sub"] < r["bs"]]
    ours = [r for r in rows if r["cache"] == "sub_block"]
    reset = [r for r in cached if r["block_cache"] != "on"]
    lower = all(r["nfe"][0] <= r["nfe"][1] and r["token_forwards"][0] <= r["token_forwards"][1]
                for r in off)
    cost = max(r["token_forwards"][0] / r["token_forwards"][1] for r in reset)
    held = all(r["reimpl_same"] == r["prompts"] and r["reimpl_counts_equal"] for r in off)
    held_cache = all(r["reimpl_same"] == r["prompts"] and r["reimpl_counts_equal"] for r in ours)
    lower_cache = all(r["nfe"][0] <= r["nfe"][1] and r["token_forwards"][0] <=
                      r["token_forwards"][1] for r in ours)
    return [
        f"Reading: without its block cache, tokens identical on {sum(r['same'] for r in off)} of "
        f"{sum(r['prompts'] for r in off)} prompt runs ({len(off)} modes), ours "
        f"{'at most' if lower else 'NOT always at most'} its NFE and token-forwards in every "
        f"row, and the re-implementation {'equal' if held else 'NOT equal'} to it in tokens "
        "and counts. With its block cache "
        "and sub-blocks smaller than the block, its tokens are another decoding's (identical "
        f"prompts: {sum(r['same'] for r in cached if r['block_cache'] == 'on')} of "
        f"{sum(r['prompts'] for r in cached if r['block_cache'] == 'on')} carried over as at "
        "d3a3470, "
        f"{sum(r['same'] for r in reset)} of {sum(r['prompts'] for r in reset)} reset per "
        "block as at 189fa7a; a random model with a scaled head is more sensitive to stale "
        "K/V than a trained one may be); with sub-blocks of the whole block its cache is exact "
        "and so are the tokens. Ours stays exact at up to "
        f"{cost:.2f}x the token-forwards of its block cache reset per block. `cache=sub_block` "
        f"(its block cache, reset per block as at 189fa7a): tokens identical on "
        f"{sum(r['same'] for r in ours)} of {sum(r['prompts'] for r in ours)} prompt runs "
        f"({len(ours)} modes), ours {'at most' if lower_cache else 'NOT always at most'} its "
        f"NFE and token-forwards in every row, the re-implementation with its block cache "
        f"{'equal' if held_cache else 'NOT equal'} to it in tokens and counts.",
        "",
    ]


def fast_dllm_v2_generation(ours, ref, prompts: list[torch.Tensor], mask_id: int,
                            eos_id: int) -> list[list[dict]]:
    """Our modes against the reference loop and its generate(), then its sub-block routine."""
    return [fast_generation(ours, ref, prompts, mask_id, eos_id),
            fd2_generation(ours, ref, prompts, mask_id, eos_id)]


def fast_dllm_v2_tables(parts: list[list[dict]]) -> list[str]:
    return fast_generation_table(parts[0]) + fd2_table(parts[1])


GENERATIONS = {"llada2": generation, "fast-dllm-v2": fast_dllm_v2_generation}
TABLES = {"llada2": generation_table, "fast-dllm-v2": fast_dllm_v2_tables}


def main() -> None:
    args = script_args(__doc__, ("family", {"choices": FAMILIES}),
                       ("repo", {"type": Path, "help": "a checkout or a bare git directory"}))
    start = time.perf_counter()
    raw = {**json.loads(Path(FAMILIES[args.family][4]).read_text()), **TINY[args.family]}
    config = ModelConfig.from_dict(raw)
    module = load_reference(args.family, args.repo)
    rows, tokens = measure(args.family, module, raw, 0, config.mask_token_id, config.block_size,
                           config.eos_token_id)
    seconds = time.perf_counter() - start
    publish(report(args.family, rows, tokens, reference_commit(args.repo), seconds), args.out)


if __name__ == "__main__":
    main()
