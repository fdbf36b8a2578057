"""Layers shared by the LLaMA-family dLLMs (LLaDA, Dream, SDAR): RMSNorm, RoPE, attention, SwiGLU."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unmask.kv import Frame


def reference_rms(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """x (..., D) float32 divided by its root mean square, as the references write it:
    ``x * rsqrt(mean(x^2) + eps)``, then times weight (D,) float32 if given, all in float32."""
    h = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return h if weight is None else h * weight


def fused_rms(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """`reference_rms` in torch's one fused call (`F.rms_norm`)."""
    return F.rms_norm(x, x.shape[-1:], weight, eps)


# Device types whose fused rms_norm was measured to give `reference_rms`'s bits: there a norm
# is one torch call instead of five (a forward of the embedded model makes 9 norms). The CPU's
# is pinned by tests/test_models.py; CUDA's did not give the formula's bits on an H200 (the
# first difference from LLaDA's reference in float32, whose logits then differed by up to
# 5.8e-5: BENCHMARKS.md, "GPU (H200)"), so every other device computes the formula itself.
FUSED_RMS_EXACT = frozenset({"cpu"})


def rms_kernel(device: torch.device) -> Callable[..., Tensor]:
    """The function that computes `reference_rms`'s bits on `device`."""
    return fused_rms if device.type in FUSED_RMS_EXACT else reference_rms


# The dtypes torch's rms_norm computes in float32 (its opmath type) and rounds back from once.
RMS_IN_FLOAT32 = frozenset({torch.bfloat16, torch.float16, torch.float32})


def rms_rounded(x: Tensor, eps: float, weight: Tensor | None = None) -> Tensor:
    """`reference_rms` of x (..., D) with x and weight (D,) upcast to float32 (exactly), rounded
    once to x's dtype: the references' ``(x.float() * rstd * weight.float()).to(x.dtype)``.

    On the devices of FUSED_RMS_EXACT torch's rms_norm does that upcast and that one rounding
    itself when x and weight share a dtype (it computes in float32 for bfloat16 and float16
    inputs and returns the input's dtype: tests/test_models.py pins the bits; a float64 input
    it would keep in float64, where the references compute in float32), so a norm there
    is one torch call instead of three or four, ~50 of a small model's call
    (benchmarks/probe/call-ops-sdar-170m.md)."""
    if (x.device.type in FUSED_RMS_EXACT and x.dtype in RMS_IN_FLOAT32
            and (weight is None or weight.dtype == x.dtype)):
        return fused_rms(x, eps, weight)
    return rms_kernel(x.device)(x.float(), eps, None if weight is None else weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 like the reference implementations, then cast back, then scale.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return rms_kernel(x.device)(x, self.eps, self.weight)
        return self.weight * rms_rounded(x, self.eps)


@functools.lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, factor: float, device: torch.device) -> Tensor:
    """(head_dim/2,) float32 rotation frequencies, divided by the linear scaling factor: the same
    for every forward of a model, so computed once."""
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return (1.0 / (theta**exponent)) / factor


def rope_cos_sin(position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 factor: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos and signed sin, each (B, 1, T, head_dim), for explicit position ids (gaps allowed).

    The angles are computed in float32 and rounded to `dtype`, the dtype the rotation runs in
    (see apply_rope). factor: linear RoPE scaling, positions divided by it. The sin's first half
    is negated: apply_rope then rotates with one roll of x instead of the reference's slice,
    negate and concatenate (the same values: negating a factor of a product is exact).
    """
    inv_freq = _inv_freq(head_dim, float(theta), float(factor), position_ids.device)
    angles = position_ids[..., None].float() * inv_freq  # (B, T, head_dim/2)
    emb = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, T, head_dim)
    sin = emb.sin().to(dtype)
    sin[..., : head_dim // 2].neg_()
    return emb.cos().to(dtype), sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x rotated by the angles of cos / signed sin (rope_cos_sin), computed in cos's dtype and
    returned in x's: x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) written as
    roll(x) = (x2, x1) times the sin whose first half is negated.

    float32 cos/sin with bfloat16 x is LLaDA's rope_full_precision: rotating in bfloat16 instead
    moves the embedded model's logits by up to 0.41 (docs/checkpoints.md, "Precision").
    """
    r = cos.shape[-1]
    if r < x.shape[-1]:  # partial rotary (LLaDA2): the leading r values of each head turn
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    h = x if x.dtype == cos.dtype else x.to(cos.dtype)
    out = h * cos + h.roll(h.shape[-1] // 2, dims=-1) * sin
    return out if out.dtype == x.dtype else out.to(x.dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, n_heads: int,
              n_kv_heads: int, frame: Frame | None, mask: Tensor | None = None) -> Tensor:
    """Multi-head attention with grouped K/V: bidirectional, or as `mask` says without a frame.

    q: (B, T, H*D), k/v: (B, T, H_kv*D) projections of the forwarded tokens. Returns (B, T, H*D).
    mask: (B, 1, T, T) bool, the keys each query sees when no frame is given (a block-causal
    family's own attention); with a frame, the frame decides. A model calls it once per layer,
    in layer order: the frame tells layers apart by that order, so no layer index is passed (one
    that was made torch.compile specialise a compiled layer to each index: unmask.compiling).
    """
    b, t, _ = q.shape
    q = q.view(b, t, n_heads, -1).transpose(1, 2)  # (B, H, T, D)
    k = k.view(b, t, n_kv_heads, -1).transpose(1, 2)  # (B, H_kv, T, D)
    v = v.view(b, t, n_kv_heads, -1).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if frame is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_heads != n_kv_heads)
    else:
        out = frame.attend(q, k, v)  # padding, stored keys, packing: the frame's business
    return out.transpose(1, 2).reshape(b, t, -1)  # (B, T, H*D)


def embedding(n: int, dim: int) -> nn.Embedding:
    """An (n, dim) token embedding. On the meta device, where load_model builds, its weight is
    left unset: nn.Embedding's normal_ init there imports torch._dynamo, ~1 s of every model
    load (measured), to draw values that do not exist. Elsewhere it draws them as before, so a
    seeded build's random stream (tests, training from scratch) is unchanged."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(n, dim, _weight=torch.empty(n, dim))
    return nn.Embedding(n, dim)


def swiglu(x: Tensor, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> Tensor:
    return down(F.silu(gate(x)) * up(x))


def init_weights(model: nn.Module, residual_out: list[nn.Linear], n_layers: int,
                 std: float = 0.02) -> None:
    """GPT-2 style init for training from scratch: normal weights, zero biases, residual output
    projections scaled down by depth so the residual stream does not grow with n_layers."""
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            nn.init.normal_(p, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    with torch.no_grad():
        for lin in residual_out:
            lin.weight.mul_((2 * n_layers) ** -0.5)
