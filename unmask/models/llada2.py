"""LLaDA2 (`model_type: llada2_moe`): LLaDA2.0/2.1's mixture-of-experts layers, block-causal.

The layout is the published folders' (inclusionAI's modeling_llada2_moe.py, docs/design.md §
Checkpoints): one fused q/k/v projection (`attention.query_key_value`, heads in the order q, k,
v), q and k RMS-normalised per head (`query_layernorm`, `key_layernorm`), RoPE on the leading
`partial_rotary_factor` share of each head only, grouped K/V heads, `attention.dense` out. The
first `first_k_dense_replace` layers have a plain SwiGLU MLP; every later one a mixture of
experts (`LLaDA2MoE`): a sigmoid router with a per-expert bias used for selection only,
group-limited top-k (the `topk_group` best of `n_group` groups, a group scored by its two best
experts, then the `num_experts_per_tok` best experts inside them), weights renormalised and
scaled by `routed_scaling_factor`, plus always-on shared experts. Module names are the tensor
names, so state_dict() keys are the safetensors keys.

Block-causal as SDAR: without a frame a position attends to its own block (position //
block_size) and earlier ones. The folders carry no block size, mask or EOS id; the published
generate() defaults (block_length 32, mask 156895, EOS 156892) stand for them (`JsonKeys.fixed`).
Predictions are unshifted. `LLADA2` (unmask/formats/llada2.py) says what each key of config.json does here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unmask.config import ModelConfig
from unmask.kv import Frame
from unmask.models.layers import RMSNorm, attention
from unmask.models.qwen import QwenLM
from unmask.models.sdar import block_causal_mask
from unmask.syncs import cpu_only

# An expert runs on its tokens padded with zero rows to a multiple of this: on the CPU torch
# takes other kernels for other row counts (the matmuls below 12 rows, the elementwise SiLU and
# product at counts whose elements end off the vector width), whose results round differently,
# so a token's output would depend on how many other tokens of the batch chose its expert. At
# multiples of 16 every row got the same bits (measured at 1 and 2 threads, widths 12 to 512);
# a batch must not change a row's bits (docs/design.md § Exactness and ties), as the engine's
# padding of a call's tokens to multiples of 16 ensures for the dense layers
# (unmask.engine.runner.TOKEN_STEP).
ROW_STEP = 16


def _accumulate(dtype: torch.dtype) -> torch.dtype:
    """The router's and the routed sum's dtype: float32, or the model's where wider."""
    return torch.promote_types(dtype, torch.float32)


class LLaDA2MLP(nn.Module):
    """SwiGLU of width `width`: a dense layer's MLP, one expert, or the shared experts."""

    def __init__(self, c: ModelConfig, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, width, bias=False)
        self.up_proj = nn.Linear(c.d_model, width, bias=False)
        self.down_proj = nn.Linear(width, c.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LLaDA2Gate(nn.Module):
    """The router: which experts each token uses and with what weight."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.scale = c.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.d_model))
        # drawn as nn.Linear draws its weight (a checkpoint overwrites it): left empty, a
        # seeded build's router read whatever memory held, so its routing changed from one
        # process to the next (docs/engine.md, "Prefix reuse")
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        # the load-balancing bias: it shifts which experts are chosen, never their weights
        self.register_buffer("expert_bias", torch.zeros(c.num_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, d) -> expert ids (N, K) and their weights (N, K), in float32 whatever the
        model dtype, as the reference's router scores (float64 stays float64)."""
        dtype = _accumulate(x.dtype)
        scores = torch.sigmoid(F.linear(x.to(dtype), self.weight.to(dtype)))  # (N, E)
        chosen = self._select(scores + self.expert_bias)
        weights = scores.gather(1, chosen)
        if self.top_k > 1:  # the reference's epsilon, so an all-zero row stays finite
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, weights * self.scale

    def _select(self, biased: Tensor) -> Tensor:
        """(N, E) -> (N, K): the K best experts among those of the `topk_group` best groups."""
        n = biased.shape[0]
        grouped = biased.view(n, self.n_group, -1)  # (N, G, E/G)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
        groups = group_score.topk(self.topk_group, dim=-1, sorted=False).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
        masked = grouped.masked_fill(~allowed[..., None], float("-inf")).view(n, -1)
        return masked.topk(self.top_k, dim=-1).indices


class LLaDA2MoE(nn.Module):
    """Routed experts plus the shared ones. Tokens are grouped by expert (one sort), so the
    Python loop runs over the experts some token chose, never over tokens."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.experts = nn.ModuleList(LLaDA2MLP(c, c.moe_intermediate_size)
                                     for _ in range(c.num_experts))
        self.gate = LLaDA2Gate(c)
        if c.num_shared_experts:
            self.shared_experts = LLaDA2MLP(c, c.moe_intermediate_size * c.num_shared_experts)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        n = flat.shape[0]
        # the router's sigmoid and the shared experts' SiLU run on rows padded to ROW_STEP,
        # as each routed expert does: at other counts the elementwise kernels' tail rounds
        # differently, so a token's bits would follow how many tokens share the call
        padded = F.pad(flat, (0, 0, 0, -n % ROW_STEP))  # (N', d)
        chosen, weights = (t[:n] for t in self.gate(padded))  # (N, K) each
        y = self.routed(flat, chosen, weights)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(padded)[:n]
        return y.view(shape)

    def routed(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """x (N, d), chosen / weights (N, K) -> (N, d): sum_k weights[:, k] * expert_k(x),
        summed in float32 and rounded once, as the reference's moe_infer does."""
        n, k = chosen.shape
        per_pair = dispatch(self.experts, x, chosen)  # (N*K, d) in (token, k) order
        pairs = per_pair.view(n, k, x.shape[-1]).to(weights.dtype)
        summed = (pairs * weights[..., None]).sum(dim=1)
        return summed.to(x.dtype)


# A call of at most this many tokens runs every expert on a fixed number of rows off the CPU
# (`fixed_dispatch`): no shape depends on the routing, so no expert count is read on the host
# and a CUDA graph can hold the layer. It costs experts x rows of expert products where the
# routing needs K rows a token (32x for LLaDA2-mini), which a GPU hides while a product of so
# few rows is bound by reading the expert's weights rather than by arithmetic (an H200 does
# ~200 bf16 flops in the time it reads a byte). Larger calls count first (`counted_dispatch`).
FIXED_TOKENS = 128


def dispatch(experts: nn.ModuleList, x: Tensor, chosen: Tensor) -> Tensor:
    """Each (token, k) pair's expert output (N*K, d) for tokens x (N, d) and their experts
    chosen (N, K): at fixed shapes for calls of at most FIXED_TOKENS off the CPU; by the
    experts' counts on the CPU (the host is the device there: the read waits for nothing) and
    for larger calls (one device read a MoE layer)."""
    n_experts = len(experts)
    if x.shape[0] > FIXED_TOKENS:
        return counted_dispatch(experts, x, chosen, device_counts(chosen, n_experts))
    if x.device.type == "cpu":
        return counted_dispatch(experts, x, chosen, cpu_counts(chosen, n_experts))
    return fixed_dispatch(experts, x, chosen)


def _counts(chosen: Tensor, n_experts: int) -> Tensor:
    return torch.bincount(chosen.flatten(), minlength=n_experts)  # (E,)


def device_counts(chosen: Tensor, n_experts: int) -> list[int]:
    """How many tokens chose each expert, read on the host."""
    return _counts(chosen, n_experts).tolist()


@cpu_only
def cpu_counts(chosen: Tensor, n_experts: int) -> list[int]:
    """`device_counts` of a CPU call that a device would run at fixed shapes (`dispatch`),
    reading nothing: `SyncCounter` leaves it out."""
    return _counts(chosen, n_experts).tolist()


def counted_dispatch(experts: nn.ModuleList, x: Tensor, chosen: Tensor,
                     counts: list[int]) -> Tensor:
    """`dispatch` with each expert run on the pairs that chose it (counts: (E,) how many), in
    pair order, padded to ROW_STEP rows."""
    k = chosen.shape[1]
    order = chosen.flatten().argsort(stable=True)  # (N*K,) pairs grouped by expert
    tokens = x[order // k]  # (N*K, d) each pair's token, in expert order
    out = torch.empty_like(tokens)
    start = 0
    for expert, count in zip(experts, counts, strict=True):
        if count:
            mine = F.pad(tokens[start:start + count], (0, 0, 0, -count % ROW_STEP))
            out[start:start + count] = expert(mine)[:count]
            start += count
    per_pair = torch.empty_like(out)
    per_pair[order] = out  # back to (token, k) order
    return per_pair


def fixed_dispatch(experts: nn.ModuleList, x: Tensor, chosen: Tensor) -> Tensor:
    """`dispatch` with no host read: every expert runs on N rows rounded up to ROW_STEP (a
    token chooses an expert at most once), its pairs first in pair order, zeros after. Each
    pair's row holds the place it has in `counted_dispatch` in a product of a multiple of
    ROW_STEP rows, so the results are its bits on the CPU (tests/test_llada2.py)."""
    n, k = chosen.shape
    flat = chosen.flatten()  # (N*K,)
    # (E,) counted by a scatter: CUDA's bincount reads its input's maximum on the host
    counts = torch.zeros(len(experts), dtype=flat.dtype, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    first = counts.cumsum(0) - counts  # (E,) each expert's first pair in expert order
    order = flat.argsort(stable=True)
    place = torch.empty_like(flat)  # (N*K,) each pair's row among its expert's
    place[order] = torch.arange(flat.shape[0], device=flat.device) - first[flat[order]]
    rows = -(-n // ROW_STEP) * ROW_STEP
    grid = x.new_zeros(len(experts), rows, x.shape[-1])  # (E, rows, d)
    grid[flat, place] = x[:, None].expand(n, k, x.shape[-1]).reshape(n * k, -1)  # pair i's token: i // k
    out = torch.stack([expert(grid[e]) for e, expert in enumerate(experts)])  # (E, rows, d)
    return out[flat, place]


class LLaDA2Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.split = (c.n_heads, c.n_kv_heads, c.n_kv_heads)
        self.head_dim = c.head_dim
        self.query_key_value = nn.Linear(c.d_model, sum(self.split) * c.head_dim, bias=False)
        self.query_layernorm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.key_layernorm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.dense = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)

    def qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, d) -> queries (B, T, H*D), keys and values (B, T, H_kv*D); q and k normalised
        per head."""
        heads = self.query_key_value(h).unflatten(-1, (-1, self.head_dim))  # (B, T, H+2H_kv, D)
        q, k, v = heads.split(self.split, dim=-2)
        return (self.query_layernorm(q).flatten(-2), self.key_layernorm(k).flatten(-2),
                v.flatten(-2))


class LLaDA2Layer(nn.Module):
    def __init__(self, c: ModelConfig, index: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = c.n_heads, c.n_kv_heads
        self.attention = LLaDA2Attention(c)
        dense = index < c.first_k_dense_replace
        self.mlp = LLaDA2MLP(c, c.mlp_hidden_size) if dense else LLaDA2MoE(c)
        self.input_layernorm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.d_model, c.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, frame: Frame | None,
                mask: Tensor | None) -> Tensor:
        q, k, v = self.attention.qkv(self.input_layernorm(x))
        x = x + self.attention.dense(attention(q, k, v, cos, sin, self.n_heads, self.n_kv_heads,
                                               frame, mask))
        return x + self.mlp(self.post_attention_layernorm(x))


class LLaDA2Model(QwenLM):
    """Block-causal: without a frame a position attends to its own block and earlier ones."""

    layer_class = LLaDA2Layer
    embed_name = "word_embeddings"
    # a call of more tokens reads each MoE layer's expert counts on the host (`dispatch`),
    # which a CUDA graph cannot hold: its buckets run eagerly (unmask.engine.buckets)
    graph_tokens = FIXED_TOKENS

    def attention_mask(self, position_ids: Tensor) -> Tensor:
        return block_causal_mask(position_ids, self.config.block_size)

    def residual_outputs(self) -> list[nn.Linear]:
        mlps = [m for m in self.modules() if isinstance(m, LLaDA2MLP)]
        return [ly.attention.dense for ly in self.model.layers] + [m.down_proj for m in mlps]
