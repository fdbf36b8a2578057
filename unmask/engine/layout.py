"""Where a row's blocks lie on its canvas: the one place that knows what a block-causal model
changes in decoding (docs/decoders.md, "Block-diffusion decoding").

- Bidirectional models (LLaDA, Dream): blocks cut the generated region, starting at slot P (the
  batch's first generated slot) for every row; the canvas is the prompt plus gen_length; every
  visible slot may be forwarded; a row stops when nothing is masked (or at early exit).
- Block-causal models (SDAR: the config sets `block_size`): the blocks are the model's own, cut
  at the row's absolute positions (block k holds positions [k * bs, (k + 1) * bs), and slot
  pad + p holds position p), so the first decode block holds the prompt's tail; the canvas is the
  prompt plus gen_length rounded up to whole blocks (generate.py's `total_length`); nothing past
  the current block's end is visible; a block's static schedule counts the whole block, as
  generate.py's `get_num_transfer_tokens(block_length, steps)` does; and a row stops once a
  completed block holds EOS (generate.py's stopping criterion), its later masks becoming EOS.
- Sub-blocks (`sub_block_length`, Fast-dLLM v2's generate(): SubBlockLayout): inside the
  model's blocks, a step commits only in the first sub-block holding a mask, and a block whose
  first slot is masked gets that slot alone first, from the previous block's last logit, in a
  forward that stops before the block (docs/fast-dllm-v2-reference-semantics.md).
"""

from __future__ import annotations

import numpy as np
from torch import nn

from unmask.decoding.knobs import entry
from unmask.decoding.params import DecodeParams, block_causal_keys
from unmask.errors import DecoderMismatch, SpecError


class BlockLayout:
    """Bidirectional: blocks start at slot P for every row."""

    stops_at_eos = False  # a completed block holding EOS ends the row whatever early_exit says

    def __init__(self, block_length: int) -> None:
        self.block_length = block_length

    def origin(self, pad: np.ndarray, P: int) -> np.ndarray:
        """(R,) the slot block 0 starts at, per row (pad: (R,) the rows' left padding)."""
        return np.full_like(pad, P)

    def block_start(self, slot: np.ndarray, pad: np.ndarray, P: int) -> np.ndarray:
        """(R,) first slot of the block holding `slot` (R,)."""
        origin = self.origin(pad, P)
        return origin + ((slot - origin) // self.block_length) * self.block_length

    def window(self, masked: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi), each (R,): the slots [lo, hi) a step may commit in, for canvases whose
        masked slots are masked (R, S) and whose current block starts at start (R,)."""
        return start, start + self.block_length

    def horizon(self, start: np.ndarray, lo: np.ndarray, block_end: np.ndarray,
                row_end: np.ndarray) -> np.ndarray:
        """(R,) one past the last slot a step may see (start, lo: (R,) the current block's and
        the commit window's first slot)."""
        return row_end

    def schedule_size(self, cand: np.ndarray) -> np.ndarray:
        """(R,) the M of LLaDA's static schedule for a block starting with candidates cand (R, S)."""
        return cand.sum(-1)

    def settled(self, first_mask: np.ndarray, pad: np.ndarray, P: int) -> np.ndarray:
        """(R,) one past the last slot whose token is final, for a stop at EOS (first_mask: (R,)
        the first masked slot): a bidirectional canvas is final up to its first mask."""
        return first_mask


class CausalBlockLayout(BlockLayout):
    """Block-causal: the model's blocks, aligned at each row's position 0."""

    stops_at_eos = True

    def origin(self, pad: np.ndarray, P: int) -> np.ndarray:
        return pad

    def horizon(self, start: np.ndarray, lo: np.ndarray, block_end: np.ndarray,
                row_end: np.ndarray) -> np.ndarray:
        return block_end

    def schedule_size(self, cand: np.ndarray) -> np.ndarray:
        return np.full(cand.shape[0], self.block_length, dtype=np.int64)

    def settled(self, first_mask: np.ndarray, pad: np.ndarray, P: int) -> np.ndarray:
        # generate.py checks for EOS once a block is complete, never inside the current one
        return self.block_start(first_mask, pad, P)


class SubBlockLayout(CausalBlockLayout):
    """Fast-dLLM v2's generate() inside the model's blocks: sub-blocks of `sub_block_length`
    decoded left to right, and a block's first slot, when masked, decoded alone from the
    forward that ends with the previous block (its autoregressive token)."""

    def __init__(self, block_length: int, sub_block_length: int) -> None:
        super().__init__(block_length)
        self.sub_block_length = sub_block_length

    def window(self, masked: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        slots = np.arange(masked.shape[1])
        in_block = (slots >= start[:, None]) & (slots < start[:, None] + self.block_length)
        open_ = masked & in_block
        # lo: the block's first mask (the window's masks are the same as the whole
        # sub-block's, and the forward need recompute nothing before it: unmask.engine.runner
        # recomputes the slot before `lo` for a model that predicts from it)
        lo = np.where(open_.any(-1), open_.argmax(-1), start)
        sub = start + (lo - start) // self.sub_block_length * self.sub_block_length
        return lo, np.where(lo == start, start + 1, sub + self.sub_block_length)

    def horizon(self, start: np.ndarray, lo: np.ndarray, block_end: np.ndarray,
                row_end: np.ndarray) -> np.ndarray:
        # the first slot alone: the forward ends with the previous block, as generate()'s
        # store forward does, whose last logit predicts that slot
        return np.where(lo == start, start, block_end)

    def settled(self, first_mask: np.ndarray, pad: np.ndarray, P: int) -> np.ndarray:
        # generate() stops once an EOS has no mask before it, inside the current block too
        return first_mask


def block_size_of(model: nn.Module) -> int | None:
    """The block size a block-causal model attends in (None: a bidirectional model)."""
    return getattr(getattr(model, "config", None), "block_size", None)


def model_defaults(model: nn.Module) -> dict[str, int | str]:
    """Decoder keys a spec parsed for this model defaults to: under the spec's own keys, over a
    preset's. For a block-causal model its block length (so gen_length need only be a multiple
    of it), the exact block cache and the full suffix: a preset keeps its method and rule knobs
    and takes the model's blocks and cache (docs/decoders.md, "Block-diffusion decoding")."""
    block_size = block_size_of(model)
    if block_size is None:
        return {}
    return {"block_length": block_size, "cache": "block", "suffix": "full"}


def make_layout(model: nn.Module, params: DecodeParams) -> BlockLayout:
    if block_size_of(model) is None:
        return BlockLayout(params.block_length)
    if params.sub_block_length is not None:
        return SubBlockLayout(params.block_length, params.sub_block_length)
    return CausalBlockLayout(params.block_length)


def canvas_length(prompt_len: int, gen_length: int, block_size: int | None) -> int:
    """Generated slots on a row's canvas: gen_length, or for a block-causal model up to the end of
    the block holding the last of them (generate.py's total_length, less the prompt)."""
    if block_size is None:
        return gen_length
    return -(-(prompt_len + gen_length) // block_size) * block_size - prompt_len


def for_model(params: DecodeParams, model: nn.Module) -> DecodeParams:
    """`params` as the model decodes them, or a DecoderMismatch naming the key that cannot apply.

    Every door (the CLI, `LLM.generate`, a server's request, lm-eval) reaches the engine through
    this, so a spec means one thing whichever door it came in by and whenever it was parsed. A
    block-causal model decodes in its own blocks with the exact block cache: the keys the caller
    did not choose (`DecodeParams.chosen`: a preset's or the defaults') take the model's
    (`model_defaults`); a chosen key that disagrees is refused, but cache none (no approximate
    cache) becomes the block cache, which changes no logit (docs/decoders.md). Keys that act on a
    bidirectional canvas beyond the current block are refused, and so are sub-blocks on a model
    that does not predict a slot from the one before it (their block's first slot comes from the
    previous block's last). Then every chosen key must be read by the decoder it resolved to."""
    if block_size_of(model) is None:
        if entry("cache", params.cache).facts.block_causal:
            raise DecoderMismatch(f"cache={params.cache} applies to block-causal models (config "
                                  f"block_size) only; this model is bidirectional: drop cache",
                                  "cache")
        for key in sorted(block_causal_keys(params.chosen_keys)):
            raise DecoderMismatch(f"{key} applies to block-causal models (config block_size) "
                                  f"only; this model is bidirectional: drop {key}", key)
        return _read(params)
    return _read(_in_blocks(params, model))


def parse_for(spec: str, model: nn.Module, explicit: dict | None = None,
              **defaults: object) -> DecodeParams:
    """`DecodeParams.parse` where the model is known: its own keys (`model_defaults`) over the
    command's `defaults`, under the spec's and `explicit` keys, then `for_model`; so a spec that
    cannot run on the model fails here, once, before any request."""
    parsed = DecodeParams.parse(spec, explicit, **{**defaults, **model_defaults(model)})
    return for_model(parsed, model)


def _in_blocks(params: DecodeParams, model: nn.Module) -> DecodeParams:
    """`params` with the block-causal model's own blocks, cache and suffix where the caller left
    them (module docstring); a chosen key that cannot apply is a DecoderMismatch."""
    block_size, chosen = block_size_of(model), params.chosen_keys
    if params.sub_block_length is not None and not getattr(model, "logit_shift", 0):
        raise DecoderMismatch("sub_block_length cannot apply: its block's first slot is "
                              "predicted from the previous block's last, and this model predicts "
                              "each slot at its own position; drop sub_block_length",
                              "sub_block_length")
    why = "a block-causal model never sees past its current block"
    if params.suffix != "full" and "suffix" in chosen:
        raise DecoderMismatch(f"suffix={params.suffix} cannot apply: {why}; drop suffix", "suffix")
    cache = entry("cache", params.cache).facts.block_causal or params.cache == "none"
    if not cache and "cache" in chosen:
        raise DecoderMismatch(f"cache={params.cache} cannot apply: {why}, and the K/V of its "
                              "finished blocks is exact already; drop cache (the exact block cache "
                              "is its default)", "cache")
    if params.block_length != block_size and "block_length" in chosen:
        raise DecoderMismatch(f"block_length={params.block_length} cannot apply: this model "
                              f"was trained with blocks of {block_size}; drop block_length "
                              f"or set block_length={block_size}", "block_length")
    changes = {k: v for k, v in model_defaults(model).items() if getattr(params, k) != v}
    if cache and params.cache != "none":  # a block-causal cache the caller chose stays
        changes.pop("cache", None)
    if not changes:
        return params
    try:
        return params.replace(**changes, name=params.name)
    except SpecError as e:  # e.g. gen_length or steps against the model's block size
        raise DecoderMismatch(f"{e} (block_length is this model's block size, {block_size})",
                              e.key) from None


def _read(params: DecodeParams) -> DecodeParams:
    """`params`, once every chosen key is read by the decoder they resolved to."""
    try:
        params.check_read()
    except SpecError as e:
        raise DecoderMismatch(str(e), e.key) from None
    return params
