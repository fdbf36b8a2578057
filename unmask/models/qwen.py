"""The Qwen layout that Dream (Qwen2) and SDAR (Qwen3) share: model.embed_tokens, model.layers,
model.norm and lm_head under transformers' Qwen tensor names, cos/sin rounded to the model dtype
(the rotation runs there, as in Qwen), and raw per-token logits. A family file supplies its layer
(how q and k come out of a layer's input, its norm) and, where its attention is not
bidirectional, the mask a call without a frame attends with.
"""

from __future__ import annotations

from torch import Tensor, nn

from unmask.config import ModelConfig
from unmask.kv import Frame
from unmask.models.layers import RMSNorm, attention, embedding, init_weights, rope_cos_sin, swiglu


class QwenMLP(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.mlp_hidden_size, bias=False)
        self.down_proj = nn.Linear(c.mlp_hidden_size, c.d_model, bias=False)


class QwenLayer(nn.Module):
    """Subclasses set `attention_class` ((config) -> q_proj, k_proj, v_proj, o_proj and
    `queries_keys(h)` -> the (B, T, H*D) queries and keys attention rotates), and may set
    `norm_class`. `index` is the layer's place in the stack (LLaDA2's first layers are dense)."""

    attention_class: type[nn.Module]
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, c: ModelConfig, index: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = c.n_heads, c.n_kv_heads
        self.self_attn = self.attention_class(c)
        self.mlp = QwenMLP(c)
        self.input_layernorm = self.norm_class(c.d_model, c.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(c.d_model, c.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, frame: Frame | None,
                mask: Tensor | None) -> Tensor:
        a, h = self.self_attn, self.input_layernorm(x)
        q, k = a.queries_keys(h)
        x = x + a.o_proj(attention(q, k, a.v_proj(h), cos, sin, self.n_heads, self.n_kv_heads,
                                   frame, mask))
        m = self.mlp
        return x + swiglu(self.post_attention_layernorm(x), m.gate_proj, m.up_proj, m.down_proj)


class QwenLM(nn.Module):
    """Subclasses set `layer_class` ((config, index) -> a layer module called as a QwenLayer is),
    and may set `norm_class`, `embed_name` (the embedding's tensor name under model.),
    `attention_mask` and `residual_outputs`."""

    logit_shift = 0
    layer_class: type[nn.Module]
    norm_class: type[RMSNorm] = RMSNorm
    embed_name = "embed_tokens"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        setattr(self.model, self.embed_name, embedding(config.vocab_size, config.d_model))
        self.model.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.n_layers))
        self.model.norm = self.norm_class(config.d_model, config.rms_norm_eps)
        if not config.weight_tying:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.embedding()(input_ids)

    def embedding(self) -> nn.Embedding:
        return getattr(self.model, self.embed_name)

    def attention_mask(self, position_ids: Tensor) -> Tensor | None:
        """(B, 1, T, T) bool keys each query sees in a call without a frame; None: all of them."""
        return None

    def forward(self, input_ids: Tensor, position_ids: Tensor, frame: Frame | None = None,
                embeds: Tensor | None = None, logits_at: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """input_ids, position_ids: (B, T) -> unshifted logits (B, T, vocab_size).

        logits_at: optional (rows, cols); then only those N positions' logits, (N, vocab_size).
        """
        c = self.config
        x = self.embed(input_ids) if embeds is None else embeds
        cos, sin = rope_cos_sin(position_ids, c.rotary_dim, c.rope_theta, x.dtype, c.rope_factor())
        mask = self.attention_mask(position_ids) if frame is None else None
        for layer in self.model.layers:
            x = layer(x, cos, sin, frame, mask)
        x = self.model.norm(x if logits_at is None else x[logits_at])
        head = self.embedding().weight if c.weight_tying else self.lm_head.weight
        return x @ head.T

    def residual_outputs(self) -> list[nn.Linear]:
        """The projections that write into the residual stream (scaled down by init_weights)."""
        return [lin for ly in self.model.layers for lin in (ly.self_attn.o_proj, ly.mlp.down_proj)]

    def init_weights(self, std: float = 0.02) -> None:
        init_weights(self, self.residual_outputs(), self.config.n_layers, std)
