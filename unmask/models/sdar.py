"""SDAR (`model_type: sdar`): Qwen3 layers attending block-causally, a block-diffusion model.

The layers are Qwen3's: grouped-query attention whose q and k are RMS-normalised per head before
RoPE, SwiGLU, no biases, a head width set by the config (`head_dim`, which need not be
hidden_size / num_attention_heads). Module names mirror the published tensor names
(model.layers.N.self_attn.q_norm...), so state_dict() keys are the safetensors keys.

Attention is block-causal, a property of the family (docs/design.md § Checkpoints): the sequence is cut
into blocks of `block_size` positions by position id, and a position attends to its own block
and every earlier one, never a later one. Without a frame the forward builds that mask from the
position ids; a `Frame` passed by the engine decides instead what a call attends to (stored K/V
of finished blocks plus the forwarded block). Predictions are unshifted: position i's is read
at i, as SDAR's generate.py reads them. `SDAR` (unmask/formats/sdar.py) says what each key of SDAR's
config.json does here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from unmask.config import ModelConfig
from unmask.models.layers import RMSNorm, rms_rounded
from unmask.models.qwen import QwenLayer, QwenLM


class FusedRMSNorm(RMSNorm):
    """RMSNorm scaled by its weight in float32 and rounded once: SDAR's modeling code calls a
    fused kernel (flash-attn's rms_norm_fn) that computes x * rstd * weight in float32 and
    stores the result in x's dtype. `RMSNorm` rounds before the weight, as transformers' Llama
    and Qwen do; in float32 the two are the same."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_rounded(x, self.eps, self.weight)


def block_causal_mask(position_ids: Tensor, block_size: int) -> Tensor:
    """(B, T) position ids -> (B, 1, T, T) bool: query i sees key j iff j's block (position //
    block_size) is i's or an earlier one."""
    block = torch.div(position_ids, block_size, rounding_mode="floor")
    return (block[:, :, None] >= block[:, None, :])[:, None]


def training_mask(t_len: int, block_size: int, device: torch.device | None = None) -> Tensor:
    """(1, 1, 2T, 2T) bool: query i sees key j, over [x_t (T positions) ; x_0 (T positions)] at
    position ids 0..T-1 each: a noisy position sees its own noisy block and the clean earlier
    blocks, a clean one the clean blocks up to its own (block_causal_mask). The block-diffusion
    objective's layout, shared by training (unmask.training.block_diffusion) and the likelihood
    bound (unmask.evaluation.block_likelihood)."""
    pos = torch.arange(t_len, device=device)
    seen = block_causal_mask(pos[None], block_size)[0, 0]  # (T, T): j's block <= i's block
    block = torch.div(pos, block_size, rounding_mode="floor")
    same = block[:, None] == block[None, :]  # (T, T)
    noisy_rows = torch.cat([same, seen & ~same], dim=1)  # own noisy block, clean earlier blocks
    clean_rows = torch.cat([torch.zeros_like(seen), seen], dim=1)  # clean only, block-causally
    return torch.cat([noisy_rows, clean_rows], dim=0)[None, None]


class SDARAttention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.d_model, q_dim, bias=False)
        self.k_proj = nn.Linear(c.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(c.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, c.d_model, bias=False)
        self.q_norm = FusedRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = FusedRMSNorm(c.head_dim, c.rms_norm_eps)
        self.head_dim = c.head_dim

    def queries_keys(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, H*D) queries and keys, each head's D values RMS-normalised on their own."""
        return self._per_head(self.q_norm, self.q_proj(h)), self._per_head(self.k_norm, self.k_proj(h))

    def _per_head(self, norm: FusedRMSNorm, x: Tensor) -> Tensor:
        return norm(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)


class SDARLayer(QwenLayer):
    attention_class = SDARAttention
    norm_class = FusedRMSNorm


class SDARModel(QwenLM):
    """Block-causal: without a frame a position attends to its own block and earlier ones."""

    layer_class = SDARLayer
    norm_class = FusedRMSNorm

    def attention_mask(self, position_ids: Tensor) -> Tensor:
        return block_causal_mask(position_ids, self.config.block_size)
