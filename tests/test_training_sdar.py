"""The block-diffusion objective (`unmask train --model-type sdar`): the training mask shows each
noisy block exactly what decoding shows it, the LLaDA warm start maps every tensor, and the
training-time greedy decode stops where it should (tiny configs, CPU)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from helpers import tiny_model, tiny_model_dir
from torch import nn

from unmask.errors import InputError
from unmask.kv import Frame
from unmask.models.sdar import training_mask
from unmask.training.args import add_train_arguments, check_train_args
from unmask.training.block_diffusion import (
    BlockDiffusion,
    greedy_block_decode,
    pad_to_blocks,
    sdar_state_from_llada,
)
from unmask.training.objective import Batch
from unmask.training.train import run_train


def test_training_mask_by_rule() -> None:
    """Query/key pairs over [x_t ; x_0] against the rule written out pair by pair."""
    t_len, size = 10, 4
    mask = training_mask(t_len, size)[0, 0]
    assert mask.shape == (2 * t_len, 2 * t_len)
    for q in range(2 * t_len):
        for k in range(2 * t_len):
            q_clean, k_clean = q >= t_len, k >= t_len
            bq, bk = (q % t_len) // size, (k % t_len) // size
            if not q_clean:  # noisy: its own noisy block, clean earlier blocks
                want = (not k_clean and bk == bq) or (k_clean and bk < bq)
            else:  # clean: clean blocks up to its own, never a noisy token
                want = k_clean and bk <= bq
            assert bool(mask[q, k]) == want, (q, k)


@pytest.mark.parametrize("t_len", [12, 11])
def test_noisy_block_logits_are_what_decoding_sees(t_len: int) -> None:
    """Every noisy block's logits in the one training forward equal a plain block-causal forward
    of [clean earlier blocks ; that noisy block], nothing after it: the state decoding is in."""
    model = tiny_model("sdar", block_size=4)
    size = 4
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(5, 300, (2, t_len), generator=gen)
    noisy = torch.where(torch.rand(2, t_len, generator=gen) < 0.5, torch.full_like(clean, 2), clean)
    pos = torch.arange(t_len).repeat(2)[None].expand(2, -1)
    with torch.no_grad():
        both = model(torch.cat([noisy, clean], 1), pos, Frame(attn_mask=training_mask(t_len, size)))
        for start in range(0, t_len, size):
            end = min(start + size, t_len)
            seen = torch.cat([clean[:, :start], noisy[:, start:end]], 1)
            alone = model(seen, torch.arange(end)[None].expand(2, -1))
            torch.testing.assert_close(both[:, start:end], alone[:, start:end], atol=1e-5, rtol=1e-5)
            # and the clean copy is the model's own block-causal forward of the clean tokens
            torch.testing.assert_close(both[:, t_len:][:, start:end],
                                       model(clean, torch.arange(t_len)[None].expand(2, -1))[:, start:end],
                                       atol=1e-5, rtol=1e-5)


def test_pad_to_blocks() -> None:
    b = Batch(torch.full((2, 6), 7), torch.tensor([[True] * 2 + [False] * 4] * 2), torch.tensor([4, 4]),
              torch.tensor([3, 2]))
    p = pad_to_blocks(b, 4, eos_id=1)
    assert p.input_ids.shape == (2, 8) and p.input_ids[:, 6:].eq(1).all()
    assert p.response_len.tolist() == [6, 6] and p.answer_len.tolist() == [3, 2]
    assert not p.prompt_mask[:, 6:].any()
    assert pad_to_blocks(p, 4, eos_id=1) is p


def test_warm_start_maps_every_llada_tensor() -> None:
    """With the q/k norms (which LLaDA lacks) bypassed and one block spanning the sequence, the
    SDAR model built from a LLaDA model's tensors computes the LLaDA model's logits: every tensor
    landed on its counterpart (gate and up, q and k, the two norms, are not interchangeable)."""
    llada = tiny_model("llada")
    sdar = tiny_model("sdar", block_size=64)
    state = sdar_state_from_llada(llada.state_dict(), sdar.config.head_dim)
    sdar.load_state_dict(state, strict=True)
    for layer in sdar.model.layers:
        assert layer.self_attn.q_norm.weight.eq(1).all() and layer.self_attn.k_norm.weight.eq(1).all()
        layer.self_attn.q_norm, layer.self_attn.k_norm = nn.Identity(), nn.Identity()
    ids = torch.randint(5, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(9)[None].expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(sdar(ids, pos), llada(ids, pos), atol=1e-5, rtol=1e-5)


class _Script(nn.Module):
    """Predicts ``script[i]`` at response position i (argmax), with its confidence rising along
    the block from right to left, so commits run right to left within each block; counts calls."""

    logit_shift = 0

    def __init__(self, prompt_len: int, script: list[int], block_size: int) -> None:
        super().__init__()
        self.config = argparse.Namespace(block_size=block_size)
        self.prompt_len, self.script, self.calls, self.seen = prompt_len, script, 0, []

    def forward(self, ids, pos, frame=None, embeds=None, logits_at=None):
        self.calls += 1
        self.seen.append(ids[0].tolist())
        out = torch.zeros(*ids.shape, 50)
        for j in range(ids.shape[1]):
            i = j - self.prompt_len
            if i >= 0:
                out[0, j, self.script[i] if i < len(self.script) else 1] = 1.0 + j % 4
        return out


def test_greedy_block_decode_fills_blocks_and_stops_at_eos() -> None:
    prompt = [9, 9, 9, 9, 9, 9]  # 6 tokens: the first block decoded is positions 4..7 (two masks)
    script = [10, 11, 12, 13, 1, 14, 15, 16, 17, 18]  # EOS at response position 4 (sequence 10)
    m = _Script(len(prompt), script, block_size=4)
    out = greedy_block_decode(m, prompt, mask_id=2, eos_id=1, max_tokens=40)
    assert out == [10, 11, 12, 13, 1, 14]  # stops after the block holding EOS (positions 8..11)
    assert m.calls == 2 + 4  # one forward per masked position
    # never anything after the current block, and its masks filled right to left
    assert all(len(s) in (8, 12) for s in m.seen)
    assert m.seen[:2] == [prompt + [2, 2], prompt + [2, 11]]
    assert m.seen[2] == prompt + [10, 11, 2, 2, 2, 2]
    assert m.seen[3] == prompt + [10, 11, 2, 2, 2, 14]
    capped = greedy_block_decode(_Script(6, script, 4), prompt, mask_id=2, eos_id=1, max_tokens=3)
    assert capped == [10, 11, 12]


def _args(*extra: str) -> argparse.Namespace:
    return add_train_arguments(argparse.ArgumentParser()).parse_args(list(extra))


def test_family_flags() -> None:
    a = _args("--model-type", "sdar")
    check_train_args(a)
    assert (a.block_size, a.semi_ar) == (4, 0.0)
    a = _args()
    check_train_args(a)
    assert (a.block_size, a.semi_ar) == (None, 0.5)
    for bad, word in ((("--block-size", "4"), "--block-size"),
                      (("--model-type", "sdar", "--semi-ar", "0.5"), "--semi-ar"),
                      (("--model-type", "sdar", "--block-size", "0"), "--block-size")):
        with pytest.raises(InputError, match=word):
            check_train_args(_args(*bad))


def test_sdar_run_from_llada_init(tmp_path) -> None:
    """A two-step SDAR run warm-started from a LLaDA folder: the exported folder is SDAR with
    block size 4, its tensors those of the LLaDA model moved by two optimizer steps at most."""
    src = tiny_model_dir(tmp_path, "llada", n_kv_heads=4)  # the trainer builds H_kv = H
    cfg = json.loads((src / "config.json").read_text())
    common = ["--tokenizer", str(src), "--d-model", str(cfg["d_model"]), "--n-layers",
              str(cfg["n_layers"]), "--n-heads", str(cfg["n_heads"]), "--mlp-hidden",
              str(cfg["mlp_hidden_size"]), "--max-seq-len", str(cfg["max_sequence_length"]),
              "--batch-tokens", "256", "--buckets", "tight:0-3:1,8-200:0", "--code-frac", "0",
              "--solve-n", "1", "--eval-batches", "1", "--threads", "1", "--model-type", "sdar"]
    summary = run_train(_args(*common, "--out", str(tmp_path / "run"), "--init", str(src),
                              "--max-steps", "2", "--lr", "1e-6"))
    out = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert out["model_type"] == "sdar" and out["block_size"] == 4
    assert summary["steps"] == 2 and summary["final_heldout_loss"] > 0
    wider = [*common, "--out", str(tmp_path / "run2"), "--init", str(src), "--max-steps", "1"]
    wider[wider.index("--d-model") + 1] = str(2 * cfg["d_model"])
    with pytest.raises(InputError, match="--init .*d_model"):
        run_train(_args(*wider))


def test_block_diffusion_init_refuses_other_families() -> None:
    dream = tiny_model("Dream")
    with pytest.raises(InputError, match="Dream"):
        BlockDiffusion().init_state(dream, tiny_model("sdar"))
