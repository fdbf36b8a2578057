"""LLaDA (`model_type: llada`): a LLaMA block stack with bidirectional attention.

Module names mirror the public checkpoint's tensor names (model.transformer.blocks.N.q_proj...),
so state_dict() keys are the safetensors keys with no renaming table. `LLADA` (unmask/formats/llada.py)
says what each key of LLaDA's OLMo-style config.json does here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from unmask.config import ModelConfig
from unmask.kv import Frame
from unmask.models.layers import RMSNorm, attention, embedding, init_weights, rope_cos_sin, swiglu


class LLaDABlock(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = c.n_heads, c.n_kv_heads
        kv_dim = c.n_kv_heads * c.head_dim
        bias, qkv_bias = c.include_bias, c.include_bias or c.qkv_bias
        self.attn_norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.q_proj = nn.Linear(c.d_model, c.d_model, bias=qkv_bias)
        self.k_proj = nn.Linear(c.d_model, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(c.d_model, kv_dim, bias=qkv_bias)
        self.attn_out = nn.Linear(c.d_model, c.d_model, bias=bias)
        self.ff_norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.ff_proj = nn.Linear(c.d_model, c.mlp_hidden_size, bias=bias)  # SiLU-gated branch
        self.up_proj = nn.Linear(c.d_model, c.mlp_hidden_size, bias=bias)
        self.ff_out = nn.Linear(c.mlp_hidden_size, c.d_model, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, frame: Frame | None) -> Tensor:
        h = self.attn_norm(x)
        x = x + self.attn_out(attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), cos, sin,
                                        self.n_heads, self.n_kv_heads, frame))
        return x + swiglu(self.ff_norm(x), self.ff_proj, self.up_proj, self.ff_out)


class LLaDAModel(nn.Module):
    logit_shift = 0  # position i is predicted from the hidden state at i

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        t = nn.ModuleDict({
            "wte": embedding(config.embedding_size, config.d_model),
            "blocks": nn.ModuleList(LLaDABlock(config) for _ in range(config.n_layers)),
            "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
        })
        if not config.weight_tying:
            t["ff_out"] = nn.Linear(config.d_model, config.embedding_size, bias=False)
        self.model = nn.Module()
        self.model.transformer = t

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.model.transformer.wte(input_ids)

    def forward(self, input_ids: Tensor, position_ids: Tensor, frame: Frame | None = None,
                embeds: Tensor | None = None, logits_at: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """input_ids, position_ids: (B, T) -> logits (B, T, vocab_size).

        embeds: optional (B, T, d_model) input embeddings replacing the lookup of input_ids.
        logits_at: optional (rows, cols) index tensors; then only those N positions get the
        LM head and the result is (N, vocab_size) — decoders score a few positions of many.
        """
        t = self.model.transformer
        c = self.config
        x = self.embed(input_ids) if embeds is None else embeds
        rope_dtype = torch.float32 if c.rope_full_precision else x.dtype
        cos, sin = rope_cos_sin(position_ids, c.head_dim, c.rope_theta, rope_dtype)
        for block in t.blocks:
            x = block(x, cos, sin, frame)
        x = t.ln_f(x if logits_at is None else x[logits_at])
        head = t.wte.weight if self.config.weight_tying else t.ff_out.weight
        return (x @ head.T)[..., : self.config.vocab_size]

    def init_weights(self, std: float = 0.02) -> None:
        blocks = self.model.transformer.blocks
        init_weights(self, [lin for b in blocks for lin in (b.attn_out, b.ff_out)],
                     self.config.n_layers, std)
