"""SDAR (`model_type: sdar`): the layer math equals transformers' Qwen3 on the same random weights
(grouped-query heads, q/k RMSNorm, a head width set apart from hidden_size / heads), the forward
without a frame is block-causal by position id, and a folder generates through LLM and the CLI
(block-diffusion decoding itself: tests/test_block_decoding.py).

SDAR's own modeling code (JetAstra/SDAR) needs flash-attn and a fetched snapshot; it is checked
by scripts/check/sdar_reference.py (benchmarks/check/sdar-reference.md), not here.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import tiny_model, tiny_model_dir
from test_models import _randomize  # weights far from init: every term matters
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3 import modeling_qwen3

import unmask
from unmask.cli import main
from unmask.config import ConfigError, ModelConfig
from unmask.errors import InputError
from unmask.kv import Frame
from unmask.models import DiffusionLM, build_model
from unmask.models.layers import RMSNorm
from unmask.models.sdar import FusedRMSNorm, block_causal_mask

VOCAB, D, HEADS, HEAD_DIM, LAYERS, FF = 100, 32, 4, 16, 2, 64


def _config(kv_heads: int = 2, tie: bool = False, block_size: int = 4) -> ModelConfig:
    return ModelConfig(model_type="sdar", d_model=D, n_heads=HEADS, n_kv_heads=kv_heads,
                       head_size=HEAD_DIM, n_layers=LAYERS, mlp_hidden_size=FF, vocab_size=VOCAB,
                       rope_theta=10000.0, rms_norm_eps=1e-6, weight_tying=tie,
                       max_sequence_length=512, block_size=block_size, mask_token_id=VOCAB - 1)


def _pair(kv_heads: int = 2, tie: bool = False, block_size: int = 4):
    """(ours, transformers' Qwen3) with identical weights under identical tensor names."""
    ours = build_model(_config(kv_heads, tie, block_size)).eval()
    _randomize(ours, kv_heads)
    ref = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
        num_hidden_layers=LAYERS, intermediate_size=FF, vocab_size=VOCAB, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=tie,
        attn_implementation="sdpa")).eval()
    state = dict(ours.state_dict())
    if tie:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    ref.load_state_dict(state, strict=True)  # the same names, no renaming table
    return ours, ref


def _inputs(t: int = 14, start: int = 0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, t), generator=torch.Generator().manual_seed(seed))
    return ids, (start + torch.arange(t))[None].expand(2, t).contiguous()


def _ref_logits(ref, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # a 4-D bool mask goes to attention as given
        return ref(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits.float()


def _generate_py_mask(n_blocks: int, block_size: int) -> torch.Tensor:
    """The block-causal mask as SDAR's generate.py builds it (a lower triangle over blocks, each
    entry repeated block_size times both ways), (1, 1, L, L) bool."""
    blocks = torch.ones(n_blocks, n_blocks).tril()
    full = blocks.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
    return full.bool()[None, None]


@pytest.mark.parametrize("kv_heads", [HEADS, 2, 1], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_causal_forward_matches_qwen3(kv_heads: int, tie: bool) -> None:
    """The layers under a plain causal mask (a Frame's attn_mask): Qwen3's math."""
    ours, ref = _pair(kv_heads, tie)
    ids, pos = _inputs()
    causal = torch.ones(14, 14, dtype=torch.bool).tril()[None, None].expand(2, 1, 14, 14)
    expected = _ref_logits(ref, ids, pos, causal)
    with torch.no_grad():
        got = ours(ids, pos, frame=Frame(attn_mask=causal))
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_frameless_forward_is_block_causal_as_generate_py(block_size: int) -> None:
    """Without a frame the model attends block-causally: Qwen3 given generate.py's mask."""
    ours, ref = _pair(block_size=block_size)
    n_blocks = 24 // block_size
    ids, pos = _inputs(t=24)
    expected = _ref_logits(ref, ids, pos, _generate_py_mask(n_blocks, block_size).expand(2, 1, 24, 24))
    with torch.no_grad():
        got = ours(ids, pos)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # the bidirectional forward (the mask dropped) is a different model
    with torch.no_grad():
        bidirectional = ours(ids, pos, frame=Frame())
    if block_size < 24:
        assert not torch.allclose(bidirectional, expected, atol=1e-3)


def test_blocks_follow_position_ids() -> None:
    """Blocks are position // block_size, not the index in the call: a call starting at position
    6 with block size 4 has blocks of 2, 4, 4, ... tokens."""
    pos = torch.tensor([[6, 7, 8, 9, 10, 11, 12]])
    mask = block_causal_mask(pos, 4)[0, 0]
    expected = torch.tensor([[1, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]] + [[1, 1, 1, 1, 1, 1, 0]] * 4
                            + [[1] * 7], dtype=torch.bool)
    assert torch.equal(mask, expected)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        return model(ids, pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_later_blocks_never_change_earlier_ones(dtype: torch.dtype) -> None:
    model = tiny_model("sdar", vocab_size=64, block_size=4).to(dtype)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    base = _logits(model, ids)
    for changed in (8, 11, 15):  # blocks 2, 2, 3
        edited = ids.clone()
        edited[0, changed] = (ids[0, changed] + 1) % 64
        got = _logits(model, edited)
        first = changed // 4 * 4
        assert torch.equal(got[:, :first], base[:, :first]), changed  # earlier blocks: same bits
        # its own block (both directions) and every later block see the change
        for block_start in range(first, 16, 4):
            block = slice(block_start, block_start + 4)
            assert not torch.equal(got[:, block], base[:, block]), (changed, block_start)


def test_fused_rms_norm_rounds_once() -> None:
    """SDAR's norms scale by the weight in float32 and round once (its fused kernel), which
    RMSNorm (round, then scale; transformers' Qwen3RMSNorm) does not; in float32 they agree."""
    g = torch.Generator().manual_seed(0)
    weight = 1 + torch.randn(64, generator=g)
    x = torch.randn(3, 40, 64, generator=g) * 5
    fused, plain = FusedRMSNorm(64, 1e-6), RMSNorm(64, 1e-6)
    with torch.no_grad():
        fused.weight.copy_(weight)
        plain.weight.copy_(weight)

    def once(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)

    with torch.no_grad():
        torch.testing.assert_close(fused(x), once(x, weight), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(fused(x), plain(x), atol=0, rtol=0)
        fused, plain = fused.to(torch.bfloat16), plain.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        assert torch.equal(fused(xb), once(xb, fused.weight))
        assert not torch.equal(fused(xb), plain(xb))


def test_bf16_forward_matches_qwen3_with_the_fused_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """In bfloat16, with Qwen3's norm made SDAR's (scale in float32, round once), the forwards
    are equal bit for bit: every other rounding (RoPE in the model dtype, attention, SwiGLU,
    the head) is Qwen3's."""
    def fused(self, x):
        h = x.float()
        rstd = torch.rsqrt(h.square().mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * rstd * self.weight.float()).to(x.dtype)

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", fused)
    ours, ref = _pair()
    ours = ours.to(torch.bfloat16)
    for p in ref.parameters():  # parameters only: RoPE's inv_freq stays float32, as in ours
        p.data = p.data.to(torch.bfloat16)
    ids, pos = _inputs(t=24)
    mask = _generate_py_mask(6, 4).expand(2, 1, 24, 24)
    expected = _ref_logits(ref, ids, pos, mask)
    got = _logits(ours, ids).float()
    assert torch.equal(got, expected)


def test_model_contract() -> None:
    model = tiny_model("sdar")
    assert isinstance(model, DiffusionLM) and model.logit_shift == 0
    assert list(inspect.signature(model.forward).parameters)[:5] == [
        "input_ids", "position_ids", "frame", "embeds", "logits_at"]
    ids, pos = _inputs(t=10)
    ids = ids % model.config.vocab_size
    with torch.no_grad():
        full = model(ids, pos)
        assert torch.equal(model(ids, pos, embeds=model.embed(ids)), full)
        rows, cols = torch.tensor([0, 1, 1]), torch.tensor([3, 0, 9])
        torch.testing.assert_close(model(ids, pos, logits_at=(rows, cols)), full[rows, cols],
                                   atol=1e-5, rtol=0)


def test_head_width_apart_from_hidden_size() -> None:
    """SDAR-4B: head_dim 128 with hidden_size 2560 and 32 heads (80 each): q is 4096 wide."""
    model = tiny_model("sdar")  # d_model 32, 4 heads of head_size 16
    config = ModelConfig.from_dict({**model.config.to_dict(), "head_dim": 16})
    attn = build_model(config).model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 16, 32) and attn.o_proj.weight.shape == (32, 64)
    assert attn.k_proj.weight.shape == (2 * 16, 32) and attn.q_norm.weight.shape == (16,)


@pytest.mark.parametrize("change, named", [
    ({"block_size": None}, "block_size"),
    ({"block_size": 0}, "block_size"),
    ({"head_dim": 15}, "head_dim"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_bad_sdar_keys_named(change: dict, named: str) -> None:
    raw = {**tiny_model("sdar").config.to_dict(), **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=named) as e:
        ModelConfig.from_dict(raw)
    assert "\n" not in str(e.value)


def test_sdar_fields_refused_elsewhere() -> None:
    """block_size and head_size would be dropped by a LLaDA or Dream config.json: refused."""
    for model_type in ("llada", "Dream"):
        with pytest.raises(ConfigError, match=f"block_size: no key of model_type {model_type}"):
            ModelConfig(model_type=model_type, qkv_bias=model_type == "Dream", block_size=4)
    with pytest.raises(ConfigError, match="never has q/k/v biases"):
        ModelConfig(model_type="sdar", block_size=4, qkv_bias=True)


def test_folder_generates(tmp_path) -> None:
    """The folder loads (model and tokenizer) and generates in the model's blocks, whatever the
    default decoder's block length; a block length other than the model's is one line."""
    folder = tiny_model_dir(tmp_path, "sdar")
    llm = unmask.LLM(folder, device="cpu")
    assert llm.config.block_size == 4 and llm.tokenizer.mask_token_id == llm.config.mask_token_id
    (g,) = llm.generate("what is 12 + 34?", gen_length=8)
    assert len(g.token_ids) == 8 and llm.config.mask_token_id not in g.token_ids and g.nfe >= 1
    with pytest.raises(InputError, match="block_length=8 cannot apply: this model was trained "
                                         "with blocks of 4"):
        llm.generate("what is 12 + 34?", gen_length=8, block_length=8)


def test_cli_generates_and_refuses_in_one_line(tmp_path, capsys: pytest.CaptureFixture) -> None:
    folder = tiny_model_dir(tmp_path, "sdar")
    assert main(["generate", "--model", str(folder), "--gen-length", "8", "hi"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(folder), "--decoder", "threshold,cache=dual", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cache=dual cannot apply" in err, err
