"""The engine commits, step by step, the positions the reference decoders commit on the shipped
model (docs/design.md § Vocabulary, "Confidence"): LLaDA's generate.py for static, Fast-dLLM's
get_transfer_index for threshold, re-implemented here as plain torch over the model's logits.
The engine used to take the softmax without the mask token, which raised a confidence by 1-2
ulps and broke near-ties the other way on 5 of the 96 held-out prompts (the first five below;
BENCHMARKS.md, "Commit order")."""

from __future__ import annotations

import functools

import pytest
import torch

from unmask import LLM
from unmask.bench.tasks import load_task
from unmask.decoding.params import DecodeParams
from unmask.engine import decode

GEN, BLOCK = 256, 32
PROMPTS = (43, 47, 71, 73, 88, 0, 1, 2)  # held-out math problems; the first five broke ties


@functools.cache
def llm() -> LLM:
    return LLM()


def reference(prompt: list[int], steps: int | None, threshold: float | None) -> list[list[int]]:
    """The positions (offsets into the generated region) each step commits. steps: LLaDA's
    schedule (get_num_transfer_tokens: M // s per step, one more in the first M % s steps of a
    block), its softmax in the logits' dtype; threshold: Fast-dLLM's, the softmax in float64,
    the top-1 and every other masked position with confidence >= threshold."""
    model, mask = llm().model, llm().config.mask_token_id
    x = torch.tensor([prompt + [mask] * GEN])
    p = len(prompt)
    pos = torch.arange(x.shape[1])[None]
    out = []
    for b in range(GEN // BLOCK):
        start, end = p + b * BLOCK, p + (b + 1) * BLOCK
        per_block = steps // (GEN // BLOCK) if steps else 0
        left = int((x[0, start:end] == mask).sum())
        i = 0
        while bool((x[0, start:end] == mask).any()):
            logits = model(x, pos)[0]  # (S, V), the mask token's logit included
            x0 = logits.argmax(-1)
            probs = torch.softmax(logits if steps else logits.double(), dim=-1)
            conf = probs.gather(-1, x0[:, None]).squeeze(-1)
            outside = torch.ones_like(conf, dtype=torch.bool)
            outside[start:end] = False
            conf = conf.masked_fill(outside | (x[0] != mask), float("-inf"))
            # The references rank with torch.topk, whose order among exactly equal scores is
            # unspecified (on the CPU it took the higher of two positions tied at 0.99993932 of
            # prompt 43 under static,steps=128); ties go to the lowest position here, the rule
            # of docs/design.md § Exactness and ties.
            top = torch.sort(-conf, stable=True).indices
            if steps:
                chosen = [int(j) for j in top[: left // per_block + (i < left % per_block)]]
            else:
                masked = int((x[0, start:end] == mask).sum())
                chosen = [int(top[0])] + [int(j) for j in top[1:masked] if conf[j] >= threshold]
            x[0, chosen] = x0[chosen]
            out.append(sorted(j - p for j in chosen))
            i += 1
    return out


def engine(prompt: list[int], spec: str) -> list[list[int]]:
    got: list[list[int]] = []
    decode(llm().model, DecodeParams.parse(spec, gen_length=GEN, block_length=BLOCK), [prompt],
           on_event=lambda ev: ev.positions and got.append(sorted(ev.positions)))
    return got


@pytest.mark.slow
@pytest.mark.parametrize("spec,steps,threshold", [("static-1", GEN, None),
                                                  ("static,steps=128", 128, None),
                                                  ("threshold,threshold=0.9", None, 0.9)])
def test_commit_order_is_the_references(spec: str, steps: int | None,
                                        threshold: float | None) -> None:
    examples = load_task("math", 96).examples
    for i in PROMPTS:
        prompt = llm().encode_prompt(examples[i].prompt)
        with torch.no_grad():
            want = reference(prompt, steps, threshold)
        got = engine(prompt, spec)
        first = next((s for s, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)
        assert got == want, f"prompt {i}: first differs at step {first}"
