"""What every training objective shares: the LLaDA objective (unmask.training.train) and the
block-diffusion one (unmask.training.block_diffusion) both train on a `Batch` of encoded
prompts and responses, mask it with the same forward process (`mask_batch`), weight positions
the same way (`LossWeights`) and score with the same cross-entropy (`weighted_ce`); both decode
with a `Decode` while training and check an ``--init`` model's config with `same_config`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from unmask.errors import CheckpointError, InputError
from unmask.training.tokenizer import EOS, MASK, format_prompt

# ------------------------------------------------------------------------------------ data


@dataclass
class Batch:
    input_ids: Tensor  # (B, T) prompt tokens then response tokens padded with EOS
    prompt_mask: Tensor  # (B, T) bool, True on prompt positions (never masked)
    response_len: Tensor  # (B,) number of response positions (answer + EOS padding)
    answer_len: Tensor | None = None  # (B,) answer tokens incl. its first EOS; None = all answer


class TextEncoder:
    """Wraps a `tokenizers.Tokenizer`; encodes chat prompts and responses to id lists."""

    def __init__(self, tokenizer_file: str | Path) -> None:
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises its own exception type for a bad file
            raise CheckpointError(f"{tokenizer_file} is not a readable tokenizer: {e}") from None
        self.eos_id = self.tok.token_to_id(EOS)
        self.mask_id = self.tok.token_to_id(MASK)
        if self.eos_id is None or self.mask_id is None:
            raise CheckpointError(f"{tokenizer_file} has no {EOS} or {MASK} token; unmask train "
                                  "needs both (a tokenizer it trained has them)")
        self.vocab_size = self.tok.get_vocab_size()

    def digit_ids(self) -> tuple[int, ...]:
        """Ids of the single-digit tokens 0-9 (the tokenizer splits numbers into digits)."""
        return tuple(i for i in (self.tok.token_to_id(str(d)) for d in range(10)) if i is not None)

    def prompt(self, question: str) -> list[int]:
        return self.tok.encode(format_prompt(question), add_special_tokens=False).ids

    def response(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids + [self.eos_id]


SEMI_AR_BLOCK = 32  # the block length decoding uses by default (docs/design.md § Vocabulary)


def mask_batch(batch: Batch, mask_id: int, gen: torch.Generator | None = None,
               eps: float = 1e-3, semi_ar: float = 0.0,
               block: int = SEMI_AR_BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """LLaDA forward process on the response: returns (noisy ids, masked bool, p_mask (B,T)).

    With ``semi_ar`` > 0, that share of rows is masked the way semi-autoregressive decoding sees
    its canvas: the response before a block-aligned cut is clean, the block of ``block``
    positions after it is masked at rate t, everything after the block is masked (p_mask 1).
    Why: under uniform masking a result like ``7+8+0=15`` almost always has a visible copy
    (``write 5``, ``= 85``, ``#### 85``), so the model learns to copy results, not to compute
    them from what precedes; decoding never shows it those copies. Measured: from the same
    d128 weights, 30 minutes each side by side, held-out problems solved 7/104 with semi_ar 0.5
    vs 1/104 without (4 x 16 logged, different problems per arm, plus the same 40 for both:
    2/40 vs 0/40); the run went on to 83% on held-out math. The default since.
    """
    if not 0.0 <= semi_ar <= 1.0:
        raise InputError(f"semi_ar is a share of rows in [0, 1], got {semi_ar}")
    ids = batch.input_ids
    b, t_len = ids.shape
    dev = ids.device
    t = torch.rand(b, generator=gen, device=dev)
    p_mask = ((1 - eps) * t + eps)[:, None].expand(b, t_len)
    masked = (torch.rand(b, t_len, generator=gen, device=dev) < p_mask) & ~batch.prompt_mask
    if semi_ar > 0:
        rows = torch.rand(b, generator=gen, device=dev) < semi_ar  # (B,)
        start = t_len - batch.response_len  # (B,) first response position
        answer = batch.response_len if batch.answer_len is None else batch.answer_len
        n_blocks = (answer - 1) // block + 1  # (B,) blocks holding answer tokens
        k = (torch.rand(b, generator=gen, device=dev) * n_blocks).long()  # (B,) in [0, n_blocks)
        cut = (start + k * block)[:, None]  # (B, 1)
        j = torch.arange(t_len, device=dev)[None, :]  # (1, T)
        after = (j >= cut + block) & rows[:, None]  # (B, T)
        masked = torch.where(rows[:, None], (j >= cut) & (masked | after), masked)
        p_mask = torch.where(after, torch.ones_like(p_mask), p_mask)
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    return noisy, masked, p_mask


@dataclass(frozen=True)
class LossWeights:
    """Per-position loss weights on top of LLaDA's 1/p: answer tokens 1, EOS padding after the
    answer's own EOS ``pad``, digit tokens ``digit`` (ids in ``digit_ids``).

    Why digits: the answer's correctness lives in its digits, which must be copied or computed
    from context, while the template tokens around them are learned almost at once. At weight 1
    the copy skill did not emerge in 4765 steps of the first run; at 5 a small model copied the
    operands from the prompt 7x more often after 1000 steps than at 1 (0.69 vs ~0.1).
    """

    pad: float = 1.0
    digit: float = 1.0
    digit_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.pad < 0 or self.digit < 0:
            raise InputError(f"loss weights must be >= 0, got {self}")


def position_weights(batch: Batch, weights: LossWeights = LossWeights()) -> Tensor:
    """(B, T) loss weight per position: 0 on the prompt, else as ``weights`` says."""
    b, t_len = batch.input_ids.shape
    w = (~batch.prompt_mask).float()
    if weights.pad != 1.0 and batch.answer_len is not None:
        prompt_len = t_len - batch.response_len  # (B,)
        answer_end = (prompt_len + batch.answer_len)[:, None]  # (B, 1)
        is_pad = torch.arange(t_len, device=w.device)[None, :] >= answer_end  # (B, T)
        w = torch.where(is_pad, w * weights.pad, w)
    if weights.digit != 1.0 and weights.digit_ids:
        ids = torch.tensor(weights.digit_ids, device=w.device)
        w = torch.where(torch.isin(batch.input_ids, ids), w * weights.digit, w)
    return w


def weighted_ce(logits: Tensor, batch: Batch, masked: Tensor, p_mask: Tensor,
                weights: LossWeights = LossWeights()) -> Tensor:
    """logits (N, V) of the N masked positions (``masked`` (B, T), row-major order) -> per row,
    the sum of w * CE / p_mask divided by the row's total weight; mean over the batch."""
    b, t_len = masked.shape
    ce = F.cross_entropy(logits.float(), batch.input_ids[masked], reduction="none")  # (N,)
    w = position_weights(batch, weights)  # (B, T)
    row_total = w.sum(dim=1, keepdim=True).expand(b, t_len)  # (B, T)
    return (ce * w[masked] / (p_mask[masked] * row_total[masked])).sum() / b


# A training-time decoder: (prompts, gen_length, on_event) -> each prompt's response tokens.
Decode = Callable[[list[list[int]], int, Callable[[Any], None] | None], list[list[int]]]


def same_config(theirs_cfg: Any, ours_cfg: Any, exclude: tuple[str, ...]) -> None:
    """InputError unless --init's config equals this run's outside ``exclude``."""
    theirs, ours = ({k: v for k, v in asdict(c).items() if k not in exclude}
                    for c in (theirs_cfg, ours_cfg))
    if theirs != ours:
        diff = {k: (theirs[k], ours[k]) for k in ours if theirs[k] != ours[k]}
        raise InputError(f"--init: its config differs from this run's (theirs, ours): {diff}")
