"""The block-diffusion objective (SDAR, `model_type: sdar`): what `unmask train --model-type sdar`
optimises, its training-time greedy decode, and the warm start from a LLaDA-format model.

Objective (as SDAR's training, which follows BD3-LM): each response token is masked with the
row's probability p = (1 - eps) t + eps, t ~ U(0, 1), the prompt never (`mask_batch`). The model
reads the noisy copy x_t and the clean copy x_0 side by side as one sequence of 2T positions,
both at position ids 0..T-1, under one mask (`training_mask`):
- a noisy position sees the noisy positions of its own block (its block partly masked, the
  prompt's tail in the first decode block clean) and the clean positions of earlier blocks;
- a clean position sees clean positions of its own and earlier blocks, never a noisy one.
So every noisy block sees exactly what decoding shows it: clean earlier blocks (prompt
included), its own block partly masked, nothing later; one forward trains every block. The loss
is the LLaDA-weighted cross-entropy (`weighted_ce`) on the masked noisy positions.

Data: the same generated math and code as the LLaDA objective; each batch is padded with EOS to
a whole number of blocks, as SDAR's data pipeline pads a sample to its block length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from unmask.errors import InputError
from unmask.kv import Frame
from unmask.models.sdar import training_mask
from unmask.training.objective import (
    Batch,
    Decode,
    LossWeights,
    TextEncoder,
    mask_batch,
    same_config,
    weighted_ce,
)


def pad_to_blocks(batch: Batch, block_size: int, eos_id: int) -> Batch:
    """The batch with EOS columns appended up to a whole number of blocks."""
    b, t_len = batch.input_ids.shape
    extra = -t_len % block_size
    if not extra:
        return batch
    ids = torch.cat([batch.input_ids, batch.input_ids.new_full((b, extra), eos_id)], dim=1)
    prompt = torch.cat([batch.prompt_mask, batch.prompt_mask.new_zeros((b, extra))], dim=1)
    return Batch(ids, prompt, batch.response_len + extra, batch.answer_len)


def block_diffusion_loss(model: nn.Module, batch: Batch, mask_id: int, gen: torch.Generator | None,
                         weights: LossWeights) -> Tensor:
    """The weighted masked cross-entropy of the noisy copy, read beside the clean copy."""
    block_size = model.config.block_size
    batch = pad_to_blocks(batch, block_size, model.config.eos_token_id)
    noisy, masked, p_mask = mask_batch(batch, mask_id, gen)  # (B, T) each
    b, t_len = noisy.shape
    pos = torch.arange(t_len, device=noisy.device).repeat(2).expand(b, 2 * t_len)  # (B, 2T)
    frame = Frame(attn_mask=training_mask(t_len, block_size, noisy.device))
    rows, cols = masked.nonzero(as_tuple=True)  # masked positions of the noisy copy
    logits = model(torch.cat([noisy, batch.input_ids], dim=1), pos, frame,
                   logits_at=(rows, cols))  # (N, V)
    return weighted_ce(logits, batch, masked, p_mask, weights)


@torch.no_grad()
def greedy_block_decode(model: nn.Module, prompt: list[int], mask_id: int, eos_id: int,
                        max_tokens: int) -> list[int]:
    """The response tokens of a plain block-by-block decode: the prompt's last partial block is
    the first block decoded; in each block, one forward per masked position commits the most
    confident one (argmax), the model's own block-causal attention over the whole sequence (no
    cache). Stops after the block holding EOS, or once ``max_tokens`` are decoded. For
    training-time numbers only: the engine is what serves the model."""
    size = model.config.block_size
    ids = list(prompt)
    while len(ids) - len(prompt) < max_tokens and eos_id not in ids[len(prompt):]:
        end = min((len(ids) // size + 1) * size, len(prompt) + max_tokens)
        ids += [mask_id] * (end - len(ids))
        x = torch.tensor([ids])
        while bool((x == mask_id).any()):
            logits = model(x, torch.arange(x.shape[1])[None])[0, -size:]  # (<=size, V)
            conf, tok = logits.float().softmax(-1).max(-1)
            start = x.shape[1] - logits.shape[0]
            conf = torch.where(x[0, start:] == mask_id, conf, -1.0)
            i = int(conf.argmax())
            x[0, start + i] = tok[i]
        ids = x[0].tolist()
    return ids[len(prompt):]


def sdar_state_from_llada(llada: dict[str, Tensor], head_dim: int) -> dict[str, Tensor]:
    """A LLaDA state dict under SDAR's tensor names (docs/architecture.md: both are LLaMA blocks
    with SwiGLU and RMSNorm); SDAR's q/k norms, which LLaDA lacks, start at ones."""
    def rename(key: str) -> str:
        key = key.replace("model.transformer.blocks.", "model.layers.")
        for ours, theirs in _LLADA_TO_SDAR:
            if key.endswith(ours):
                return key[: -len(ours)] + theirs
        return key

    top = {"model.transformer.wte.weight": "model.embed_tokens.weight",
           "model.transformer.ln_f.weight": "model.norm.weight",
           "model.transformer.ff_out.weight": "lm_head.weight"}
    out = {top.get(k) or rename(k): v for k, v in llada.items()}
    for name in list(out):
        if name.endswith("self_attn.q_proj.weight"):
            prefix = name.removesuffix("q_proj.weight")
            out[prefix + "q_norm.weight"] = torch.ones(head_dim)
            out[prefix + "k_norm.weight"] = torch.ones(head_dim)
    return out


# Config fields a LLaDA --init may differ in from an SDAR run: the family's own.
_FAMILY_FIELDS = ("extra", "model_type", "block_size", "head_size", "qkv_bias", "rope_full_precision")

# LLaDA block tensor -> SDAR layer tensor (the suffix after model.layers.N.)
_LLADA_TO_SDAR = (
    ("attn_norm.weight", "input_layernorm.weight"), ("q_proj.weight", "self_attn.q_proj.weight"),
    ("k_proj.weight", "self_attn.k_proj.weight"), ("v_proj.weight", "self_attn.v_proj.weight"),
    ("attn_out.weight", "self_attn.o_proj.weight"),
    ("ff_norm.weight", "post_attention_layernorm.weight"), ("ff_proj.weight", "mlp.gate_proj.weight"),
    ("up_proj.weight", "mlp.up_proj.weight"), ("ff_out.weight", "mlp.down_proj.weight"),
)


@dataclass(frozen=True)
class BlockDiffusion:
    """The SDAR family's objective for `Trainer` (unmask.training.train.OBJECTIVES)."""

    model_type: str = "sdar"

    def config_fields(self, args: Any) -> dict[str, Any]:
        return {"block_size": args.block_size}

    def loss(self, model: nn.Module, batch: Batch, mask_id: int, gen: torch.Generator | None,
             weights: LossWeights, semi_ar: float = 0.0) -> Tensor:
        return block_diffusion_loss(model, batch, mask_id, gen, weights)

    def decoder(self, model: nn.Module, enc: TextEncoder) -> Decode:
        def decode(prompts: list[list[int]], gen_length: int,
                   on_event: Callable[[Any], None] | None) -> list[list[int]]:
            out = []
            for p in prompts:
                out.append(greedy_block_decode(model, p, enc.mask_id, enc.eos_id, gen_length))
                if on_event is not None:
                    on_event(_Finished())
            return out
        return decode

    def init_state(self, src: nn.Module, model: nn.Module) -> dict[str, Tensor]:
        """--init's weights for ``model``: an SDAR folder's as they are, a LLaDA one's renamed."""
        if src.config.model_type == "llada":
            same_config(src.config, model.config, exclude=_FAMILY_FIELDS)
            return sdar_state_from_llada(src.state_dict(), model.config.head_dim)
        if src.config.model_type == self.model_type:
            same_config(src.config, model.config, exclude=("extra",))
            return src.state_dict()
        raise InputError(f"--init: a {src.config.model_type} model cannot start an SDAR run; "
                         "give an SDAR or LLaDA model folder")


class _Finished:
    """A progress event for one decoded problem (the final evaluation's bar counts them)."""

    finished = True
