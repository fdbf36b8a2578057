"""Layer math: our LLaDA / Dream forwards equal transformers' Llama / Qwen2 on the same random
weights when both sides use a causal mask, in float32 and in bfloat16 (with LLaDA's RoPE in
float32 on the reference side too), and are bidirectional without a mask."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import tiny_model
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama import modeling_llama

from unmask.config import ModelConfig
from unmask.kv import Frame
from unmask.models import build_model, layers
from unmask.models.layers import RMSNorm, apply_rope, rope_cos_sin
from unmask.models.sdar import FusedRMSNorm

VOCAB, D, HEADS, LAYERS, FF = 100, 64, 4, 2, 128
ATOL = 1e-5


def _hf_kwargs(kv_heads: int, tie: bool, attn: str) -> dict:
    return dict(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=kv_heads,
                num_hidden_layers=LAYERS, intermediate_size=FF, vocab_size=VOCAB,
                rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                attention_dropout=0.0, attn_implementation=attn, torch_dtype="float32")


def _ours_config(model_type: str, kv_heads: int, tie: bool) -> ModelConfig:
    return ModelConfig(model_type=model_type, d_model=D, n_heads=HEADS, n_kv_heads=kv_heads,
                       n_layers=LAYERS, mlp_hidden_size=FF, vocab_size=VOCAB, embedding_size=VOCAB,
                       rope_theta=10000.0, rms_norm_eps=1e-5, weight_tying=tie,
                       qkv_bias=model_type == "Dream", max_sequence_length=512)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from init (std 0.2, norms around 1, non-zero biases) so every term matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(0.2 * noise)


def _llada_to_llama(name: str) -> str:
    """LLaDA tensor name -> transformers Llama tensor name."""
    if name == "model.transformer.wte.weight":
        return "model.embed_tokens.weight"
    if name == "model.transformer.ln_f.weight":
        return "model.norm.weight"
    if name == "model.transformer.ff_out.weight":
        return "lm_head.weight"
    prefix, rest = name.removeprefix("model.transformer.blocks.").split(".", 1)
    sub = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
           "attn_out": "self_attn.o_proj", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
           "ff_out": "mlp.down_proj", "attn_norm": "input_layernorm",
           "ff_norm": "post_attention_layernorm"}
    module, param = rest.split(".")
    return f"model.layers.{prefix}.{sub[module]}.{param}"


def _pair(model_type: str, kv_heads: int = 2, tie: bool = False, attn: str = "eager", seed: int = 0):
    """(ours, reference) with identical weights."""
    ours = build_model(_ours_config(model_type, kv_heads, tie)).eval()
    _randomize(ours, seed)
    if model_type == "llada":
        ref = LlamaForCausalLM(LlamaConfig(**_hf_kwargs(kv_heads, tie, attn))).eval()
        rename = _llada_to_llama
    else:
        ref = Qwen2ForCausalLM(Qwen2Config(**_hf_kwargs(kv_heads, tie, attn))).eval()
        rename = str  # Dream uses the Qwen2 names verbatim
    assert ref.config._attn_implementation == attn
    ref_state = ref.state_dict()
    ours_state = ours.state_dict()
    mapped = {rename(k): v for k, v in ours_state.items()}
    if tie:
        mapped.setdefault("lm_head.weight", mapped["model.embed_tokens.weight"])
    assert set(mapped) == set(ref_state), set(mapped) ^ set(ref_state)
    for k, v in mapped.items():
        assert ref_state[k].shape == v.shape, k
        assert ref_state[k].dtype == torch.float32
    ref.load_state_dict(mapped, strict=True)
    if tie:
        assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    return ours, ref


def _causal(b: int, t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()[None, None].expand(b, 1, t, t)


def _inputs(b: int = 2, t: int = 12, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    pos = torch.arange(t)[None].expand(b, t).contiguous()
    return ids, pos


def _ref_logits(ref, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    # An explicit all-ones attention_mask: without one, transformers reads position ids that do
    # not step by 1 as packed sequences and splits the causal mask at every gap.
    with torch.no_grad():
        return ref(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids),
                   use_cache=False).logits.float()


def _our_logits(ours, ids, pos, mask: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        return ours(ids, pos, frame=Frame(attn_mask=mask) if mask is not None else None)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
@pytest.mark.parametrize("kv_heads", [HEADS, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_causal_forward_matches_transformers(model_type: str, kv_heads: int, attn: str) -> None:
    ours, ref = _pair(model_type, kv_heads=kv_heads, attn=attn)
    ids, pos = _inputs()
    expected = _ref_logits(ref, ids, pos)
    got = _our_logits(ours, ids, pos, _causal(*ids.shape))
    assert got.shape == expected.shape == (2, 12, VOCAB)
    assert got.dtype == torch.float32
    assert expected.abs().max() > 1.0  # logits are not trivially small
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_position_ids_with_gaps_match_transformers(model_type: str) -> None:
    ours, ref = _pair(model_type, kv_heads=2)
    ids, _ = _inputs(b=2, t=8)
    pos = torch.tensor([[0, 1, 2, 5, 9, 10, 20, 37], [3, 4, 8, 9, 15, 16, 17, 100]])
    expected = _ref_logits(ref, ids, pos)
    got = _our_logits(ours, ids, pos, _causal(2, 8))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # The gaps matter: contiguous positions give different logits on both sides.
    contiguous = torch.arange(8)[None].expand(2, 8)
    assert not torch.allclose(_our_logits(ours, ids, contiguous, _causal(2, 8)), got, atol=1e-3)


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_weight_tying_matches_transformers(model_type: str) -> None:
    ours, ref = _pair(model_type, kv_heads=2, tie=True)
    names = set(ours.state_dict())
    assert "model.transformer.ff_out.weight" not in names and "lm_head.weight" not in names
    ids, pos = _inputs()
    torch.testing.assert_close(_our_logits(ours, ids, pos, _causal(2, 12)), _ref_logits(ref, ids, pos),
                               atol=ATOL, rtol=0)
    # Tied: the output head is the embedding, so changing the embedding changes the logits.
    before = _our_logits(ours, ids, pos, None)
    with torch.no_grad():
        ours.embed(torch.tensor([0])).sum()  # embed() works with tying
        next(p for n, p in ours.named_parameters() if "wte" in n or "embed_tokens" in n).mul_(2)
    assert not torch.allclose(_our_logits(ours, ids, pos, None), before)


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_bidirectional_without_mask(model_type: str) -> None:
    ours, _ = _pair(model_type)
    ids, pos = _inputs()
    causal = _our_logits(ours, ids, pos, _causal(2, 12))
    full = _our_logits(ours, ids, pos, None)
    # Every position differs (the last one too: from layer 2 on, its keys saw the future).
    assert (full - causal).abs().amax(-1).min() > 1e-3
    # Changing a late token changes an early position's logits (no mask) ...
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % VOCAB
    assert not torch.allclose(_our_logits(ours, ids2, pos, None)[:, 0], full[:, 0], atol=1e-4)
    # ... and an all-True explicit mask is the same as no mask.
    ones = torch.ones(2, 1, 12, 12, dtype=torch.bool)
    torch.testing.assert_close(_our_logits(ours, ids, pos, ones), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_key_mask_hides_keys(model_type: str) -> None:
    """A key_mask (batch padding) gives the same logits as leaving the padded tokens out."""
    ours, _ = _pair(model_type)
    ids, pos = _inputs(b=1, t=10)
    key_mask = torch.ones(1, 10, dtype=torch.bool)
    key_mask[:, :3] = False
    padded = _our_logits_frame(ours, ids, pos, Frame(key_mask=key_mask))
    alone = _our_logits(ours, ids[:, 3:], pos[:, 3:], None)
    torch.testing.assert_close(padded[:, 3:], alone, atol=ATOL, rtol=0)


def _our_logits_frame(ours, ids, pos, frame: Frame) -> torch.Tensor:
    with torch.no_grad():
        return ours(ids, pos, frame=frame)


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_embeds_argument_replaces_lookup(model_type: str) -> None:
    ours, _ = _pair(model_type)
    ids, pos = _inputs()
    with torch.no_grad():
        via_embeds = ours(ids, pos, embeds=ours.embed(ids))
    torch.testing.assert_close(via_embeds, _our_logits(ours, ids, pos, None), atol=0, rtol=0)


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_logits_at_selects_positions(model_type: str) -> None:
    ours, _ = _pair(model_type)
    ids, pos = _inputs()
    rows, cols = torch.tensor([0, 1, 1]), torch.tensor([3, 0, ids.shape[1] - 1])
    with torch.no_grad():
        full = ours(ids, pos)
        some = ours(ids, pos, logits_at=(rows, cols))
    assert some.shape == (3, full.shape[-1])
    torch.testing.assert_close(some, full[rows, cols], atol=1e-5, rtol=1e-5)


def test_llada_embedding_size_larger_than_vocab() -> None:
    """LLaDA pads its embedding (embedding_size > vocab_size); logits are cut to vocab_size."""
    c = ModelConfig(d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64,
                    vocab_size=50, embedding_size=64)
    m = build_model(c).eval()
    m.init_weights()
    assert m.model.transformer.wte.weight.shape == (64, 32)
    assert m.model.transformer.ff_out.weight.shape == (64, 32)
    with torch.no_grad():
        out = m(torch.tensor([[1, 63, 5]]), torch.arange(3)[None])
    assert out.shape == (1, 3, 50)


def test_dream_logit_shift_flag() -> None:
    """Dream's forward is unshifted (equal to Qwen2); the decoder reads the shift from the model."""
    assert build_model(_ours_config("Dream", 2, False)).logit_shift == 1
    assert build_model(_ours_config("llada", 2, False)).logit_shift == 0


# --- bfloat16 ------------------------------------------------------------------------------------
# Both sides use SDPA, so in bfloat16 they run the same kernels on the same rounded inputs; the
# tolerance is for other platforms' kernels. Rotating q/k in bfloat16 instead moves the logits
# by about 2% of their scale here (test_rope_in_bf16_is_caught).
BF16_RTOL = 2e-3  # of the largest |logit|


def _to_bf16(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    rotary = ref.model.rotary_emb
    inv_freq = rotary.inv_freq  # a buffer: .to() would round RoPE's frequencies to bfloat16
    ours.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    rotary.inv_freq = inv_freq


@pytest.fixture
def llama_rope_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' Llama with LLaDA's rope_full_precision: cos/sin and the rotation of q/k in
    float32, cast back to the model dtype."""
    rotary_forward = modeling_llama.LlamaRotaryEmbedding.forward
    rotate = modeling_llama.apply_rotary_pos_emb

    def forward(self, x, position_ids):
        return rotary_forward(self, x.float(), position_ids)

    def apply(q, k, cos, sin, unsqueeze_dim=1):
        q2, k2 = rotate(q.float(), k.float(), cos, sin, unsqueeze_dim)
        return q2.to(q.dtype), k2.to(k.dtype)

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", forward)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", apply)


def _far_positions(b: int, t: int) -> torch.Tensor:
    """Positions spread over a 4,096 canvas, where RoPE's angles are large."""
    return (torch.arange(t) * 331 + 7)[None].expand(b, t).contiguous()


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_bf16_forward_matches_transformers(model_type: str, llama_rope_fp32: None) -> None:
    ours, ref = _pair(model_type, kv_heads=2, attn="sdpa")
    _to_bf16(ours, ref)
    assert ours.config.rope_full_precision == (model_type == "llada")
    ids, _ = _inputs()
    pos = _far_positions(*ids.shape)
    expected = _ref_logits(ref, ids, pos)
    got = _our_logits(ours, ids, pos, _causal(*ids.shape))
    assert got.dtype == torch.bfloat16
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=BF16_RTOL * scale, rtol=0)


def test_rope_in_bf16_is_caught(llama_rope_fp32: None) -> None:
    """rope_full_precision: true must rotate in float32: the bf16 rotation is far outside the
    tolerance of the comparison above."""
    ours, ref = _pair("llada", kv_heads=2, attn="sdpa")
    _to_bf16(ours, ref)
    ids, _ = _inputs()
    pos = _far_positions(*ids.shape)
    expected = _ref_logits(ref, ids, pos)
    scale = expected.abs().max().item()
    ours.config.rope_full_precision = False
    bf16_rope = (_our_logits(ours, ids, pos, _causal(*ids.shape)).float() - expected).abs().max()
    assert bf16_rope > 5 * BF16_RTOL * scale, (bf16_rope, scale)


def test_apply_rope_rotates_in_cos_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 16, generator=g).to(torch.bfloat16)
    pos = _far_positions(2, 8)
    cos32, sin32 = rope_cos_sin(pos, 16, 10000.0, torch.float32)
    full = apply_rope(x, cos32, sin32)
    assert full.dtype == torch.bfloat16
    assert torch.equal(full, apply_rope(x.float(), cos32, sin32).to(torch.bfloat16))
    cos16, sin16 = rope_cos_sin(pos, 16, 10000.0, torch.bfloat16)
    assert not torch.equal(full, apply_rope(x, cos16, sin16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_is_the_reference_rotation_bit_for_bit(dtype: torch.dtype) -> None:
    """apply_rope rolls x and uses a sin whose first half is negated; that must give exactly
    the reference's x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), with the
    reference's plain cos and sin of the same angles (negating a factor of a product is exact)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 4, 9, 16, generator=g) * 10).to(dtype)
    pos = _far_positions(3, 9)
    cos, signed_sin = rope_cos_sin(pos, 16, 10000.0, dtype, factor=2.0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    angles = pos[..., None].float() * (inv_freq / 2.0)
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    ref_cos, ref_sin = emb.cos().to(dtype), emb.sin().to(dtype)
    assert torch.equal(cos, ref_cos)
    assert torch.equal(signed_sin[..., 8:], ref_sin[..., 8:])
    assert torch.equal(signed_sin[..., :8], -ref_sin[..., :8])
    rotated = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
    assert torch.equal(apply_rope(x, cos, signed_sin), x * ref_cos + rotated * ref_sin)


def test_dream_linear_rope_scaling_matches_qwen2() -> None:
    scaling = {"type": "linear", "factor": 4.0}
    ours = build_model(ModelConfig(**{**_ours_config("Dream", 2, False).__dict__,
                                      "rope_scaling": scaling, "extra": {}})).eval()
    _randomize(ours, 0)
    kw = _hf_kwargs(2, False, "sdpa")
    ref = Qwen2ForCausalLM(Qwen2Config(**kw, rope_scaling=scaling)).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    ids, pos = _inputs()
    expected = _ref_logits(ref, ids, pos)
    torch.testing.assert_close(_our_logits(ours, ids, pos, _causal(2, 12)), expected, atol=ATOL, rtol=0)
    plain, _ = _pair("Dream", kv_heads=2)
    assert not torch.allclose(_our_logits(plain, ids, pos, _causal(2, 12)), expected, atol=1e-3)


@pytest.mark.parametrize("kind", ["llada", "Dream"])
def test_models_follow_the_contract(kind: str) -> None:
    """Every registered model satisfies the one written-down model contract."""
    from unmask.models import DiffusionLM
    from unmask.models.protocol import DiffusionLM as Contract

    assert DiffusionLM is Contract
    model = tiny_model(kind)
    assert isinstance(model, DiffusionLM)
    params = inspect.signature(model.forward).parameters
    assert list(params)[:5] == ["input_ids", "position_ids", "frame", "embeds", "logits_at"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 48, 271, 1000])
def test_rms_norm_is_transformers_llama_rms_norm_bit_for_bit(dtype: torch.dtype, tokens: int) -> None:
    """RMSNorm calls torch's rms_norm (one call, not five): it must give the bits of
    transformers' LlamaRMSNorm (float32 normalisation, cast back, then the weight), the layer
    every decoder's exactness tests and the committed benchmarks were computed with."""
    g = torch.Generator().manual_seed(tokens)
    ours = RMSNorm(64, 1e-5)
    ref = modeling_llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64, generator=g) * 2)
        ref.weight.copy_(ours.weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = (torch.randn(2, tokens, 64, generator=g) * 5).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))


class _TorchCalls(TorchFunctionMode):
    """The torch functions and tensor methods called under it, in order (not what they call;
    attribute reads such as x.dtype left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name != "__get__":
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_class, calls", [(RMSNorm, ["rms_norm", "mul"]),
                                               (FusedRMSNorm, ["rms_norm"])])
def test_a_half_precision_norm_on_the_cpu_is_torchs_one_call_with_the_casts_bits(
        norm_class: type[RMSNorm], calls: list[str], dtype: torch.dtype) -> None:
    """In bfloat16 or float16 on the CPU a norm hands x to torch's rms_norm as it is: that
    upcasts to float32 and rounds its result once itself, so the explicit casts around it
    (x.float(), weight.float(), .to(dtype): three of a norm's four calls, ~150 of a 12-layer
    SDAR call) give the same bits and are left out. RMSNorm rounds before its weight, SDAR's
    FusedRMSNorm after."""
    g = torch.Generator().manual_seed(0)
    norm = norm_class(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(64, generator=g))
    norm = norm.to(dtype)
    x = (torch.randn(3, 37, 64, generator=g) * 5).to(dtype)
    rms = layers.reference_rms(x.float(), 1e-6)
    want = (rms * norm.weight.float()).to(dtype) if norm_class is FusedRMSNorm else \
        norm.weight * rms.to(dtype)
    with torch.no_grad(), _TorchCalls() as seen:
        got = norm(x)
    assert torch.equal(got, want)
    assert seen.calls == calls


@pytest.mark.parametrize("tokens", [1, 16, 271])
def test_the_fused_rms_norm_is_used_only_where_it_is_the_reference_formula(
        tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A norm computes the references' ``x * rsqrt(mean(x^2) + eps)`` in float32: torch's fused
    rms_norm only on the devices where it gives those bits (the CPU, checked here), the formula
    itself elsewhere (CUDA's fused kernel departs from it). The norms of every family route
    through `rms_kernel`: on a device without the fused op's bits (meta stands for CUDA) they
    never call it."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(2, tokens, 64, generator=g) * 5
    w = torch.randn(64, generator=g) * 2
    by_hand = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(layers.reference_rms(x, 1e-5), by_hand)
    assert torch.equal(layers.reference_rms(x, 1e-5, w), by_hand * w)
    assert torch.equal(layers.fused_rms(x, 1e-5, w), layers.reference_rms(x, 1e-5, w))
    assert layers.rms_kernel(torch.device("cpu")) is layers.fused_rms
    assert layers.rms_kernel(torch.device("cuda")) is layers.reference_rms

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("fused rms_norm called off the CPU")

    monkeypatch.setattr(layers.F, "rms_norm", refused)
    for norm in (RMSNorm(64, 1e-5), FusedRMSNorm(64, 1e-5)):
        for dtype in (torch.float32, torch.bfloat16):
            out = norm.to("meta", dtype)(torch.empty(2, tokens, 64, device="meta", dtype=dtype))
            assert out.shape == (2, tokens, 64) and out.dtype == dtype
