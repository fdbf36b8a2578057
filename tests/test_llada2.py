"""LLaDA2 (`model_type: llada2_moe`) and Fast-dLLM v2 (`Fast_dLLM_Qwen`).

LLaDA2: the routed experts (tokens grouped by expert) equal a per-token loop over each token's
chosen experts; the whole forward equals a plain-torch transcription of the published modeling
code's inference path (fused q/k/v, per-head q/k RMSNorm, RoPE on the leading half of each head
with rotate_half, eager attention under generate()'s additive block mask, the sigmoid router with
group-limited top-k, moe_infer's float32 weighted sum, shared experts); inconsistent MoE keys
are one line naming the key (exit 2 on the CLI). The published code itself runs in
scripts/check/block_references.py (benchmarks/check/llada2-reference.md).

Fast-dLLM v2: its layers are transformers' Qwen2 under its eval_block_diff_mask, and it reads
position i's prediction at i - 1.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from block_reference import Strategy, answer, llada2_generate, pick
from test_models import _randomize  # weights far from init: every term matters
from transformers import Qwen2Config, Qwen2ForCausalLM

from unmask.cli import main
from unmask.config import ConfigError, ModelConfig
from unmask.decoding.params import DecodeParams
from unmask.engine import decode
from unmask.models import build_model, llada2
from unmask.models.llada2 import LLaDA2MoE
from unmask.syncs import SyncCounter

DATA = Path(__file__).parent / "data"
VOCAB = 97
MOE = {"num_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
       "num_shared_experts": 1, "moe_intermediate_size": 12, "routed_scaling_factor": 2.5,
       "first_k_dense_replace": 1, "partial_rotary_factor": 0.5}


def _config(**kw) -> ModelConfig:
    base = dict(model_type="llada2_moe", d_model=32, n_heads=4, n_kv_heads=2, head_size=16,
                n_layers=3, mlp_hidden_size=40, vocab_size=VOCAB, rope_theta=600000.0,
                rms_norm_eps=1e-6, max_sequence_length=512, block_size=4, mask_token_id=VOCAB - 1,
                eos_token_id=VOCAB - 2)
    return ModelConfig(**{**base, **MOE, **kw})


def _model(dtype: torch.dtype = torch.float64, **kw) -> torch.nn.Module:
    model = build_model(_config(**kw)).eval()
    _randomize(model, 0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a selection bias large enough to change which experts win
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model.to(dtype)


# --- the routed experts ------------------------------------------------------------------------
def _per_token(moe: LLaDA2MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token alone: its chosen experts, one at a time."""
    chosen, weights = moe.gate(x)
    rows = []
    for t in range(x.shape[0]):
        rows.append(sum(weights[t, j] * moe.experts[int(e)](x[t]) for j, e in enumerate(chosen[t])))
    return torch.stack(rows)


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_grouped_experts_equal_a_per_token_loop(tokens: int) -> None:
    moe = _model().model.layers[1].mlp
    assert isinstance(moe, LLaDA2MoE)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens), dtype=torch.float64)
    chosen, _ = moe.gate(x)
    if tokens == 64:  # experts shared between tokens, so the grouping is exercised
        assert torch.bincount(chosen.flatten()).max() > 1
    torch.testing.assert_close(moe.routed(x, *moe.gate(x)), _per_token(moe, x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_logits_do_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """The same bits alone and among 7 other rows, though the other rows change how many tokens
    each expert multiplies (other counts take other CPU kernels: unmask.models.llada2.ROW_STEP)."""
    model = _model(dtype)
    ids = torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)[None].expand(8, 24)
    with torch.no_grad():
        together = model(ids, pos)
        alone = torch.cat([model(ids[i:i + 1], pos[i:i + 1]) for i in range(8)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 16, 40, 128])
def test_fixed_dispatch_is_the_counted_one_bit_for_bit_without_a_read(dtype: torch.dtype,
                                                                       tokens: int) -> None:
    """The experts at fixed shapes (every expert on all N rows, off the CPU up to FIXED_TOKENS:
    what a CUDA graph can hold) give the counted dispatch's bits, and read nothing on the host
    where the counted one reads its counts."""
    moe = _model(dtype).model.layers[1].mlp
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    chosen, _ = moe.gate(x)
    with SyncCounter(cpu_is_device=True).counting() as fixed_reads:
        fixed = llada2.fixed_dispatch(moe.experts, x, chosen)
    with SyncCounter(cpu_is_device=True).counting() as counted_reads:
        counted = llada2.counted_dispatch(moe.experts, x, chosen,
                                          llada2.device_counts(chosen, len(moe.experts)))
    assert torch.equal(fixed, counted)
    assert fixed_reads.total == 0 and counted_reads.total >= 1


def test_the_fixed_dispatch_decodes_todays_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding with every MoE call at fixed shapes (as a device runs them) gives the tokens and
    logits of the CPU's counted dispatch."""
    model = _model(torch.float32)
    params = DecodeParams.parse("threshold,threshold=0.7", gen_length=16, block_length=4)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    ids = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)[None].expand(3, 24)

    def run() -> tuple[list[list[int]], torch.Tensor]:
        reqs = decode(model, params, prompts, mask_id=VOCAB - 1, eos_id=VOCAB - 2, max_running=3)
        with torch.no_grad():
            return [r.token_ids for r in reqs], model(ids, pos)

    want = run()
    with monkeypatch.context() as mp:
        mp.setattr(llada2, "dispatch", llada2.fixed_dispatch)
        got = run()
    assert got[0] == want[0]
    assert torch.equal(got[1], want[1])


def test_only_calls_past_fixed_tokens_read_the_expert_counts() -> None:
    """On a device, a call of more than FIXED_TOKENS tokens counts its experts on the host (one
    read a MoE layer); on the CPU a smaller call's counting stands for the fixed dispatch a
    device runs, and is not counted."""
    model = _model(torch.float32)
    for tokens, reads in ((llada2.FIXED_TOKENS, 0), (llada2.FIXED_TOKENS + 1, 2)):
        ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), SyncCounter(cpu_is_device=True).counting() as c:
            model(ids, torch.arange(tokens)[None])
        assert c.total == reads, tokens  # two MoE layers of three


def test_a_tokens_moe_bits_do_not_depend_on_how_many_tokens_share_the_call() -> None:
    """A token's MoE output is the same bits among 1 to 40 tokens: the router's sigmoid (8
    experts) and the shared experts' SiLU (12 wide) end off the CPU's vector width at most
    counts, where the elementwise kernels' tail rounds differently (unmask.models.llada2.ROW_STEP)."""
    moe = _model(torch.float32).model.layers[1].mlp
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        together = moe(x)
        for n in range(1, 41):
            assert torch.equal(moe(x[:n]), together[:n]), n


def test_a_seeded_build_is_the_same_model_every_time() -> None:
    """Every weight of a model built under one seed is drawn from it, the router's included (an
    empty router read whatever memory held: other routing in every process, NaN at times)."""
    def build() -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        return build_model(_config()).state_dict()

    a, b = build(), build()
    for name, t in a.items():
        assert torch.isfinite(t).all() and torch.equal(t, b[name]), name
    assert a["model.layers.1.mlp.gate.weight"].abs().sum() > 0


def test_router_keeps_to_the_chosen_groups() -> None:
    """Every chosen expert lies in one of the topk_group groups with the best two-expert sums
    (bias included); the weights come from the unbiased scores, renormalised and scaled."""
    gate = _model().model.layers[1].mlp.gate
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    chosen, weights = gate(x)
    scores = torch.sigmoid(x @ gate.weight.T)
    biased = (scores + gate.expert_bias).view(50, 4, 2)
    best_groups = biased.sum(-1).topk(2, dim=-1).indices  # 2 experts per group: the pair sum
    for t in range(50):
        assert set((chosen[t] // 2).tolist()) <= set(best_groups[t].tolist())
    picked = scores.gather(1, chosen)
    torch.testing.assert_close(weights, 2.5 * picked / picked.sum(-1, keepdim=True))


# --- the whole forward against a transcription of the published modeling code --------------------
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LLaDA2MoeRMSNorm: normalised in float32, cast back, then scaled."""
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _mlp(s: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = (s[p + n + "_proj.weight"] for n in ("gate", "up", "down"))
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _moe(s: dict, p: str, x: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    """LLaDA2MoeGate + moe_infer + shared experts, one token at a time."""
    scores = torch.sigmoid(x @ s[p + "gate.weight"].T)  # (N, E)
    n = x.shape[0]
    biased = scores + s[p + "gate.expert_bias"]
    group = biased.view(n, c.n_group, -1).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(group).scatter_(1, group.topk(c.topk_group, dim=-1)[1], 1)
    keep = keep[..., None].expand(n, c.n_group, c.num_experts // c.n_group).reshape(n, -1)
    idx = biased.masked_fill(~keep.bool(), float("-inf")).topk(c.num_experts_per_tok, dim=-1)[1]
    w = scores.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
    out = torch.stack([sum(w[t, j] * _mlp(s, f"{p}experts.{int(e)}.", x[t]) for j, e in enumerate(idx[t]))
                       for t in range(n)])
    return out + _mlp(s, p + "shared_experts.", x)


def _reference(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    c, s = model.config, model.state_dict()
    t, hd, r = ids.shape[1], c.head_dim, c.rotary_dim
    # the rotary embedding's float32 angles, cast to the model dtype (as the reference does)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv
    cos, sin = (f(torch.cat([ang, ang], -1)).double() for f in (torch.cos, torch.sin))
    n_blocks = math.ceil(t / c.block_size)
    blocks = torch.tril(torch.ones(n_blocks, n_blocks)).repeat_interleave(c.block_size, 0)
    additive = blocks.repeat_interleave(c.block_size, 1)[:t, :t].log().double()  # generate()'s
    x = s["model.word_embeddings.weight"][ids[0]]
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        h = _norm(x, s[p + "input_layernorm.weight"])
        qkv = (h @ s[p + "attention.query_key_value.weight"].T).view(t, -1, hd).transpose(0, 1)
        q, k, v = qkv.split([c.n_heads, c.n_kv_heads, c.n_kv_heads], dim=0)
        q = _rotate(_norm(q, s[p + "attention.query_layernorm.weight"]), cos, sin)
        k = _rotate(_norm(k, s[p + "attention.key_layernorm.weight"]), cos, sin)
        rep = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + additive, dim=-1) @ v
        x = x + att.transpose(0, 1).reshape(t, -1) @ s[p + "attention.dense.weight"].T
        h = _norm(x, s[p + "post_attention_layernorm.weight"])
        x = x + (_mlp(s, p + "mlp.", h) if i < c.first_k_dense_replace else _moe(s, p + "mlp.", h, c))
    return _norm(x, s["model.norm.weight"]) @ s["lm_head.weight"].T


@pytest.mark.parametrize("length", [7, 12])
def test_forward_matches_the_published_modeling_code(length: int) -> None:
    model = _model()
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        got = model(ids, torch.arange(length)[None])[0]
    want = _reference(model, ids)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)


# --- generate()'s threshold with a static floor ---------------------------------------------------
def test_the_floor_is_the_schedule_capped_at_the_masks() -> None:
    """LLaDA2's step: every offset above the threshold when at least the schedule's count are,
    else the count's most confident, never more than the masks left."""
    conf = torch.tensor([0.75, 0.25, 0.625, 0.125])  # exact in float32
    every, one = torch.tensor([True] * 4), torch.tensor([False, True, False, False])
    rule = Strategy("dynamic", 2, threshold=0.5, capped=True)
    assert pick(rule, conf, every, 2).tolist() == [True, False, True, False]  # 2 above: them
    assert pick(rule, conf, every, 3).tolist() == [True, True, True, False]  # floor: the top 3
    assert pick(rule, conf, one, 2).tolist() == [False, True, False, False]  # capped at 1 mask


GEN = 16
FLOOR_PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10], [20],
                 [30, 31, 32, 33, 34], [40, 41], [50, 51, 52, 53, 54, 55, 56], [60, 61, 62, 63]]


@functools.cache
def _peaky(head: float) -> torch.nn.Module:
    """The tiny model in float32, its LM head scaled so that confidences cross thresholds, the
    mask token's row zero (generate() may predict it, unmask never commits it)."""
    model = _model(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(head)
        model.lm_head.weight[VOCAB - 1] = 0
    return model


# ours, then generate()'s steps per block of 4 and threshold (1: never exceeded, the schedule)
FLOOR_CASES = [("threshold,threshold=0.5,steps=8", 2, 0.5), ("threshold,threshold=0.9,steps=8", 2, 0.9),
               ("threshold,threshold=0.3,steps=4", 1, 0.3), ("threshold,threshold=0.5", 4, 0.5),
               ("static,steps=8", 2, 1.0), ("static-1", 4, 1.0)]


@pytest.mark.parametrize("spec, steps, threshold", FLOOR_CASES, ids=[c[0] for c in FLOOR_CASES])
@pytest.mark.parametrize("head, eos", [(5.0, 27), (12.0, 58)], ids=["varied", "sharp"])
def test_tokens_equal_llada2_generate(spec: str, steps: int, threshold: float, head: float,
                                      eos: int) -> None:
    """unmask's engine against tests/block_reference.py's llada2_generate (generate()'s loop in
    plain torch): the same tokens through the first EOS and its denoising forwards as NFE (ours
    fuses no extra call: generate() has neither prefill nor store forward), in no more
    token-forwards (ours reads finished blocks from the store, generate() forwards the prefix)."""
    model = _peaky(head)
    params = DecodeParams.parse(spec, gen_length=GEN, block_length=4)
    out = decode(model, params, FLOOR_PROMPTS, mask_id=VOCAB - 1, eos_id=eos)
    multi = 0
    for prompt, req in zip(FLOOR_PROMPTS, out, strict=True):
        with torch.no_grad():
            want = llada2_generate(lambda ids, pos: model(ids, pos), prompt, VOCAB - 1, GEN, 4,
                                   steps, threshold, eos)
        assert answer(req.token_ids, eos, GEN, VOCAB - 1) == answer(want.canvas[len(prompt):], eos,
                                                                    GEN, VOCAB - 1), prompt
        assert req.nfe == want.nfe and req.token_forwards <= want.token_forwards
        multi += any(len(c) > (4 // steps) for block in want.commits for c in block)
    if threshold < 1 and steps > 1:  # (one step a block: the floor is the whole block)
        assert multi  # the threshold committed past the floor somewhere


# --- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, named", [
    ("n_group", 3, "num_experts"),  # 256 experts in 3 groups
    ("n_group", 256, "n_group"),  # one expert per group: no two-best score
    ("topk_group", 9, "topk_group"),
    ("num_experts_per_tok", 257, "num_experts_per_tok"),
    ("num_experts_per_tok", 160, "num_experts_per_tok"),  # above 4 groups x 32 experts
    ("first_k_dense_replace", 21, "first_k_dense_replace"),
    ("partial_rotary_factor", 0.01, "partial_rotary_factor"),
    ("routed_scaling_factor", 0, "routed_scaling_factor"),
    ("num_experts", 0, "num_experts"),
])
def test_inconsistent_moe_keys_name_the_key(key: str, value: object, named: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    raw = {**json.loads((DATA / "llada2-mini.config.json").read_text()), key: value}
    with pytest.raises(ConfigError, match=named) as e:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["generate", "--model", str(tmp_path), "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err


def test_missing_moe_key_is_named() -> None:
    raw = json.loads((DATA / "llada2-mini.config.json").read_text())
    del raw["n_group"]
    with pytest.raises(ConfigError, match="'n_group'"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="topk_group"):
        _config(topk_group=None)


def test_moe_keys_are_refused_on_other_families() -> None:
    raw = {**json.loads((DATA / "dream-v0-instruct-7b.config.json").read_text()), "num_experts": 8}
    with pytest.raises(ConfigError, match="'num_experts'"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="num_experts: no key of model_type llada"):
        ModelConfig(num_experts=8)


# --- Fast-dLLM v2 -----------------------------------------------------------------------------
def test_fast_dllm_v2_is_qwen2_under_its_block_mask() -> None:
    """Its layers are Qwen2's (q/k/v biases) and, without a frame, it attends as its
    eval_block_diff_mask says: query block >= key block, blocks of bd_size by index."""
    raw = json.loads((DATA / "fast-dllm-v2-7b.config.json").read_text())
    tiny = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 160, "bd_size": 4,
            "eos_token_id": 150, "layer_types": ["full_attention"] * 2}
    config = ModelConfig.from_dict({**raw, **tiny} | {"vocab_size": 152_064})
    ours = build_model(config).eval()
    _randomize(ours, 0)
    ref = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        intermediate_size=64, vocab_size=152_064, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        attn_implementation="sdpa")).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, 1000, (1, 14), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(14)[None]
    block = pos[0] // 4
    mask = (block[:, None] >= block[None, :])[None, None]
    with torch.no_grad():
        want = ref(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
        got = ours(ids, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert ours.logit_shift == 1 and config.mask_token_id == 151_665 and config.block_size == 4
