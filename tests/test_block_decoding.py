"""Block-diffusion decoding of a block-causal model (SDAR) with the exact block cache.

(a) every model call's logits equal a plain forward of the row's visible prefix under the model's
    own block-causal mask (no frame, no cache);
(b) the tokens equal a straightforward generate.py-style loop written here (whole-prefix
    forwards, no cache), and NFE is what the fused store forward saves against that loop;
(c) FreeDave / FreeDave++ are token-identical to static-1 / threshold;
(d) batch invariance with joins and aborts;
(e) keys that cannot apply are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BLOCK_FAMILIES, assert_batch_invariant, peaky_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, decode
from unmask.engine import runner as runner_mod
from unmask.engine.layout import canvas_length
from unmask.errors import DecoderMismatch, SpecError

VOCAB, MASK, EOS, BS = 64, 63, 1, 4
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [3, 4, 5, 6, 7, 8, 9, 10], [20]]


def sdar(seed: int = 0) -> torch.nn.Module:
    """A tiny random SDAR model (blocks of BS), peaky: threshold decoding commits several
    tokens and near ties are rare."""
    return peaky_model("sdar", seed, 4.0, VOCAB, MASK, EOS)


def params(spec: str, gen: int = 16, **kw) -> DecodeParams:
    return DecodeParams.parse(spec, gen_length=gen, block_length=BS, **kw)


def run(model, spec: str, prompts=PROMPTS, gen: int = 16, eos: int = EOS, **kw):
    return decode(model, params(spec, gen, **kw), prompts, mask_id=MASK, eos_id=eos)


# --- (a) logits of every call == a plain block-causal forward of the visible prefix ---------------
class CallLogits:
    """Every model call of the engine: its plan's rows and the logits it scored, by slot."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __enter__(self) -> CallLogits:
        self.mp = pytest.MonkeyPatch()
        forward, call, spy = runner_mod.Runner.forward, runner_mod.Runner._call, self

        def fwd(runner, plan):
            spy.plan = plan
            return forward(runner, plan)

        def _call(runner, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks, rows, cols, *rest):
            logits, kv, at = call(runner, ids, pos, ok, n_tokens, t_hat, embeds, past, blocks,
                                  rows, cols, *rest)
            slots = pos.cpu().numpy()[rows, cols] + spy.plan.pad[rows]
            spy.calls.append((spy.plan, rows, slots, logits.detach().clone()))
            return logits, kv, at

        self.mp.setattr(runner_mod.Runner, "forward", fwd)
        self.mp.setattr(runner_mod.Runner, "_call", _call)
        return self

    def __exit__(self, *exc) -> None:
        self.mp.undo()


@pytest.mark.parametrize("spec", ["static-1", "threshold,threshold=0.5", "freedave,draft_steps=3",
                                  "static,steps=8"])
@torch.no_grad()
def test_every_call_equals_a_plain_block_causal_forward(spec: str) -> None:
    model = sdar()
    with CallLogits() as spy:
        run(model, spec)  # rows of several shapes: packed calls
        run(model, spec, [PROMPTS[2]])  # one row: padded (unpacked) calls
    assert spy.calls
    n_fused = 0
    for plan, rows, slots, logits in spy.calls:
        for r in np.unique(rows):
            pad = int(plan.pad[r])
            end = int(np.flatnonzero(plan.visible[r]).max()) + 1  # the current block's end
            assert (end - pad) % BS == 0  # nothing past a block's end is ever visible
            ids = torch.from_numpy(plan.x[r, pad:end])[None]
            want = model(ids, torch.arange(end - pad)[None])[0]  # no frame: block-causal mask
            at = rows == r
            torch.testing.assert_close(logits[at], want[slots[at] - pad], atol=1e-5, rtol=0)
            n_fused += int(plan.active[r].sum() > BS)
    assert n_fused  # calls that forwarded a finished block with the next (or the prompt) ran


def test_store_holds_only_final_kv() -> None:
    """After each call, every stored slot lies in a block that was complete in the forwarded
    canvas: the store never holds K/V computed while its block had masks."""
    from unmask.engine import decoder as decoder_mod

    model, seen = sdar(), []
    take = decoder_mod.Decoder._take_predictions

    def spy(self, b, fw, rows, fi, start):  # b.x: the forwarded canvases
        take(self, b, fw, rows, fi, start)
        for i in range(len(b)):
            valid = b.stored_tokens(np.array([i]))[0] >= 0
            if valid.any():
                last = int(np.flatnonzero(valid).max())
                gen_masked = b.x[i, b.P:] == MASK
                first_mask = b.P + int(gen_masked.argmax()) if gen_masked.any() else b.S
                seen.append(last < first_mask)
                assert (b.stored_tokens(np.array([i]))[0][valid] == b.x[i][valid]).all()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoder_mod.Decoder, "_take_predictions", spy)
        run(model, "threshold,threshold=0.5")
    assert seen and all(seen)


# --- (b) tokens == a generate.py-style loop; NFE -----------------------------------------------
@torch.no_grad()
def reference_loop(model, prompt: list[int], gen: int, steps_per_block: int, rule: str,
                   threshold: float | None = None, eos: int = EOS,
                   suppress_eos: bool = False) -> tuple[list[int], int, int]:
    """generate.py's block_diffusion_generate, greedy, without its K/V cache (every forward
    runs the whole prefix up to the block's end under the model's own mask): the prompt's whole
    blocks prefill, each block is denoised with get_num_transfer_tokens(block, steps) commits
    a step (threshold: every masked position at or above it, at least that count), then one
    forward stores it; generation stops after a block holding EOS. The mask token is never
    chosen, and only masked positions are committed. entropy_bounded: the most confident masked
    positions while their summed entropy stays below `threshold`, at least one. Returns (the
    gen tokens, the later positions EOS; NFE; token-forwards) as the reference loop with its
    cache would spend them). This is the loop as unmask means it (docs/decoders.md,
    "Block-diffusion decoding"); tests/block_reference.py is the loop as the references run it,
    quirks included, and tests/test_sdar_reference.py holds ours to it where the two agree."""
    n = len(prompt)
    total = -(-(n + gen) // BS) * BS
    x = torch.full((total,), MASK)
    x[:n] = torch.tensor(prompt)
    counts = [BS // steps_per_block + (s < BS % steps_per_block) for s in range(steps_per_block)]
    nfe, tok_fw = int(n >= BS), (n // BS) * BS
    for k in range(n // BS, total // BS):
        lo, hi = k * BS, (k + 1) * BS
        for step in range(steps_per_block + 1):
            masked = x[lo:hi] == MASK
            nfe, tok_fw = nfe + 1, tok_fw + BS
            if not masked.any():
                break  # the store forward
            logits = model(x[None, :hi], torch.arange(hi)[None])[0, lo:hi].float()
            if suppress_eos:
                logits[:, eos] = float("-inf")
            p = torch.softmax(logits, -1)
            tok = logits.index_fill(-1, torch.tensor([MASK]), float("-inf")).argmax(-1)
            conf = torch.where(masked, p.gather(-1, tok[:, None])[:, 0], float("-inf"))
            count = counts[step]
            order = np.argsort(-conf.numpy(), kind="stable")
            if rule == "threshold":
                count = max(int(((conf >= threshold) & masked).sum()), count)
            if rule == "entropy_bounded":  # the EB-sampler's bound, in confidence order
                entropy = torch.special.entr(p).sum(-1)  # 0 log 0 = 0 (a dropped EOS)
                sums = np.cumsum(entropy.numpy()[order][: int(masked.sum())])
                count = max(int((sums < threshold).sum()), 1)
            order = order[: min(count, int(masked.sum()))]
            x[lo + order] = tok[order]
        if (x[n:hi] == eos).any():
            x[hi:] = eos
            break
    return x[n : n + gen].tolist(), nfe, tok_fw


@pytest.mark.parametrize("spec, spb, rule, value", [
    ("static-1", BS, "static", None), ("static,steps=8", 2, "static", None),
    ("static,steps=4", 1, "static", None), ("threshold,threshold=0.5", BS, "threshold", 0.5),
    ("threshold,threshold=0.5,steps=8", 2, "threshold", 0.5),  # a floor of 2 a step
    ("freedave,draft_steps=3", BS, "static", None),
    ("freedave++,draft_steps=3,threshold=0.5", BS, "threshold", 0.5),
    ("entropy_bounded,eb_threshold=0.5", BS, "entropy_bounded", 0.5),
    ("entropy_bounded,eb_threshold=6", BS, "entropy_bounded", 6.0),  # several a step
])
@pytest.mark.parametrize("seed", [0, 1])
def test_tokens_equal_the_reference_loop(spec: str, spb: int, rule: str, value, seed: int) -> None:
    model = sdar(seed)
    out = run(model, spec)
    for prompt, req in zip(PROMPTS, out, strict=True):
        want, ref_nfe, ref_tok_fw = reference_loop(model, prompt, 16, spb, rule, value)
        assert req.token_ids == want, prompt
        assert req.nfe <= ref_nfe  # the fused store forward
        if not spec.startswith("freedave"):  # (drafts forward more tokens, by design)
            assert req.token_forwards <= ref_tok_fw


def test_nfe_of_the_fused_store_forward() -> None:
    """static-1 to the canvas's end: one forward per committed position (the first scores the
    prompt with the first block, the one that completes a block also scores the next), none
    after the last; the reference loop spends a prefill, and one store forward per block."""
    model = sdar(0)
    out = run(model, "static-1,suppress_eos=true")  # no early stop
    for prompt, req in zip(PROMPTS, out, strict=True):
        n = len(prompt)
        canvas = canvas_length(n, 16, BS)
        n_blocks = (n + canvas) // BS - n // BS  # decode blocks
        assert req.finish_reason == "length"
        assert req.nfe == canvas
        want, ref_nfe, ref_tok_fw = reference_loop(model, prompt, 16, BS, "static", suppress_eos=True)
        assert req.token_ids == want
        assert ref_nfe == (n >= BS) + canvas + n_blocks
        # per block: its denoising forwards, and the next block's first one forwards it again
        # the first call forwards the prompt's whole blocks with the first block; a call that
        # completes a block forwards it again with the next; the last block is never stored
        assert req.token_forwards == (n // BS) * BS + (canvas + n_blocks - 1) * BS
        assert ref_tok_fw - req.token_forwards == BS


def test_a_completed_block_holding_eos_ends_the_row() -> None:
    """A row stops after the block whose commits hold EOS, the rest of its canvas EOS; inside
    that block, positions after EOS are decoded as the reference loop does."""
    model = sdar(0)
    free = run(model, "static-1", eos=MASK - 1)[0]
    assert MASK - 1 not in free.token_ids
    eos = free.token_ids[6]  # a token the first row commits in its third block
    req = run(model, "static-1", eos=eos)[0]
    want, ref_nfe, _ = reference_loop(model, PROMPTS[0], 16, BS, "static", eos=eos)
    assert req.token_ids == want
    assert req.finish_reason == "eos"
    i = want.index(eos)
    block_end = (len(PROMPTS[0]) + i) // BS * BS + BS - len(PROMPTS[0])
    assert want[:block_end] == free.token_ids[:block_end] and set(want[block_end:]) == {eos}
    assert req.nfe < free.nfe and req.nfe < ref_nfe


# --- (c) FreeDave inside the block -----------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 3), prompts=st.lists(st.lists(st.integers(3, VOCAB - 3), min_size=1,
                                                         max_size=10), min_size=1, max_size=3),
       draft_steps=st.integers(2, 5), threshold=st.sampled_from([0.3, 0.5, 0.9]),
       gen=st.sampled_from([8, 12, 20]))
def test_freedave_is_exact_inside_the_block(seed, prompts, draft_steps, threshold, gen) -> None:
    model = sdar(seed)
    pairs = [(f"freedave,draft_steps={draft_steps}", "static-1"),
             (f"freedave++,draft_steps={draft_steps},threshold={threshold}",
              f"threshold,threshold={threshold}")]
    for method, ref in pairs:
        got = [r.token_ids for r in run(model, method, prompts, gen)]
        assert got == [r.token_ids for r in run(model, ref, prompts, gen)], method


# --- (d) batch invariance --------------------------------------------------------------------------
prompt_st = st.lists(st.integers(3, VOCAB - 3), min_size=1, max_size=11)


@settings(max_examples=45, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(list(BLOCK_FAMILIES)),
       method=st.sampled_from(["static,steps=8", "static-1", "threshold,threshold=0.5",
                               "threshold,threshold=0.7,steps=8", "freedave,draft_steps=3",
                               "freedave++,draft_steps=3,threshold=0.5"]),
       temperature=st.sampled_from([0.0, 0.8]), target=prompt_st,
       others=st.lists(st.tuples(prompt_st, st.sampled_from([8, 16, 32])), min_size=1, max_size=3),
       join_at=st.integers(0, 6), abort_at=st.integers(1, 8))
def test_batch_invariance(family, method, temperature, target, others, join_at, abort_at) -> None:
    """Alone == in a batch == joining at step k of rows at other blocks and stages (other
    prompt lengths, so other block alignments), with one of them aborted mid-way and a request
    of another decoder beside; for each block-diffusion family (LLaDA2's experts see other
    rows' tokens; Fast-dLLM v2 reads its predictions one position back)."""
    m = peaky_model(family, 0, 4.0, VOCAB, MASK, EOS)
    spec = f"{method},temperature={temperature}"
    assert_batch_invariant(m, lambda gen, seed: params(spec, gen, seed=seed), target, others,
                           join_at, abort_at, MASK, EOS)


# --- (e) what a block model takes and refuses ---------------------------------------------------
def test_defaults_resolve_to_the_models_blocks_and_cache() -> None:
    eng = Engine(sdar(), mask_id=MASK, eos_id=EOS)
    req = eng.add_request([5, 6, 7], DecodeParams.parse("threshold", gen_length=64))
    assert (req.params.block_length, req.params.cache) == (BS, "block")
    assert req.canvas == 65  # 3 + 64 rounded up to whole blocks of 4, less the prompt
    eng.run()
    assert len(req.token_ids) == 64


@pytest.mark.parametrize("spec, key", [
    ("threshold,cache=dual", "cache"), ("threshold,cache=entropy", "cache"),
    ("threshold,cache=prefix", "cache"), ("threshold,suffix=window", "suffix"),
    ("threshold,suffix=structured,inject=0.5", "suffix"), ("fast,suffix=structured", "suffix"),
])
def test_keys_that_cannot_apply_are_refused(spec: str, key: str) -> None:
    eng = Engine(sdar(), mask_id=MASK, eos_id=EOS)
    with pytest.raises(DecoderMismatch, match=f"^{key}=") as e:
        eng.add_request([5, 6], DecodeParams.parse(spec, gen_length=32))
    assert "\n" not in str(e.value) and e.value.key == key
    assert not eng.has_unfinished


def test_block_length_other_than_the_models_is_refused() -> None:
    eng = Engine(sdar(), mask_id=MASK, eos_id=EOS)
    with pytest.raises(DecoderMismatch, match="block_length=8 .*set block_length=4"):
        eng.check_prompt([5], DecodeParams.parse("static-1", gen_length=32, block_length=8))
    with pytest.raises(DecoderMismatch, match="steps"):  # 8 steps over 16 blocks of 4
        eng.check_prompt([5], DecodeParams.parse("static,steps=8", gen_length=64))


def test_cache_block_is_refused_on_a_bidirectional_model() -> None:
    from helpers import peaky_model

    m = peaky_model("llada", 0, 4.0, VOCAB, MASK, EOS)
    with pytest.raises(DecoderMismatch, match="cache=block applies to block-causal"):
        Engine(m, mask_id=MASK, eos_id=EOS).add_request([5], DecodeParams.parse(
            "static-1,cache=block", gen_length=8, block_length=8))
    assert issubclass(DecoderMismatch, SpecError)


def test_the_rounded_canvas_must_fit_the_model() -> None:
    """The canvas reaches the end of the last block, so prompt + gen_length within
    max_sequence_length (here 126, not whole blocks of 4) is refused when rounding takes it
    past."""
    from helpers import tiny_model

    from unmask.errors import CanvasTooLong

    eng = Engine(tiny_model("sdar", max_sequence_length=126))
    eng.check_prompt([5] * 4, params("static-1", 120))  # 124: fits
    with pytest.raises(CanvasTooLong, match="128 positions in the model's whole blocks exceeds "
                                            "max_sequence_length 126"):
        eng.check_prompt([5] * 5, params("static-1", 120))  # 125, rounded to 128
