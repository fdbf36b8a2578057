"""SDAR's `block_diffusion_generate`, FreeDave's base block decoder and its draft-and-verify one
(without eager acceptance) at temperature 0, re-implemented in plain torch from
docs/sdar-reference-semantics.md (our code, written from that description): the loops
tests/test_sdar_reference.py holds unmask's block decoding to, and which
scripts/check/sdar_generate.py checks against the real references (tokens, NFE and
token-forwards equal).

Greedy as FreeDave's temperature-0 sampler: the argmax over the whole vocabulary (the mask token
included, as both references leave it) and its softmax probability in the logits' dtype, at
every position of the block. Where the references do what their names do not say, this does
what they do: SDAR's static schedule counts the whole block and `torch.topk` may pick
non-masked positions when fewer masks than the count remain (they are overwritten with their
re-prediction); `entropy_bounded` is SDAR's formula (with the `transfer_index` its published
branch forgets). The model is one callable forwarding a prefix block-causally, so there is no
cache: a finished block's store forward is counted, as the references run it, not run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

# (1, T) token ids, (1, T) position ids -> (1, T, V) logits, attending block-causally
Forward = Callable[[Tensor, Tensor], Tensor]
STRATEGIES = ("static", "dynamic", "entropy_bounded", "sequential")
STOPS = ("block holds a stop id", "block is all EOS")  # SDAR's, FreeDave's early exit


@dataclass(frozen=True)
class Strategy:
    """A remasking strategy as SDAR's generate.py names it, and its knobs. steps: denoising
    steps per block (FreeDave's base decoder: the block length, one token per step). at_least:
    dynamic commits conf >= threshold (FreeDave) rather than SDAR's conf > threshold. capped:
    the schedule's count is capped at the masks left (LLaDA2's generate()), where SDAR's topk
    picks non-masked offsets too."""

    name: str
    steps: int
    threshold: float = 0.85
    eb_threshold: float = 0.35
    at_least: bool = False
    capped: bool = False

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"strategy {self.name!r}; valid: {', '.join(STRATEGIES)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


@dataclass
class Result:
    """canvas: prompt + every generated slot (the masks of blocks never decoded stay masks);
    commits: the block offsets each denoising step wrote, per block; nfe / token_forwards:
    every forward the reference runs (prefill, denoising, store) and the tokens it forwards."""

    canvas: list[int]
    commits: list[list[list[int]]] = field(default_factory=list)
    nfe: int = 0
    token_forwards: int = 0

    def forwarded(self, tokens: int) -> None:
        self.nfe += 1
        self.token_forwards += tokens


def schedule(block_length: int, steps: int) -> list[int]:
    """SDAR's get_num_transfer_tokens: the block's length (not its masks) over the steps."""
    base, extra = divmod(block_length, steps)
    return [base + (t < extra) for t in range(steps)]


def generate(forward: Forward, prompt: list[int], mask_id: int, gen_length: int,
             block_length: int, strategy: Strategy, stop_ids: list[int],
             stop: str = STOPS[0]) -> Result:
    """One prompt, greedy, block by block until a stop or the whole-block canvas is decoded."""
    if stop not in STOPS:
        raise ValueError(f"stop {stop!r}; valid: {', '.join(STOPS)}")
    p, b = len(prompt), block_length
    n_blocks = -(-(p + gen_length) // b)  # the last block is whole, past gen_length if need be
    x = torch.full((1, n_blocks * b), mask_id, dtype=torch.long)
    x[0, :p] = torch.tensor(prompt)
    pos = torch.arange(n_blocks * b)[None]
    out = Result(canvas=[])
    if p // b:
        out.forwarded(p // b * b)  # prefill: the prompt's whole blocks, their K/V stored
    for n in range(p // b, n_blocks):
        out.commits.append(decode_block(forward, x, pos, n, b, mask_id, strategy, out))
        block = x[0, n * b:(n + 1) * b]
        if stopped(block, x[0, p:], stop_ids, stop):
            if stop == STOPS[1]:
                x[0, (n + 1) * b:] = stop_ids[0]
            break
    out.canvas = x[0].tolist()
    return out


def decode_block(forward: Forward, x: Tensor, pos: Tensor, n: int, b: int, mask_id: int,
                 strategy: Strategy, out: Result) -> list[list[int]]:
    """Block n in place: at most `steps` denoising forwards, then the store forward."""
    lo, hi = n * b, (n + 1) * b
    counts = schedule(b, strategy.steps)
    commits = []
    for t in range(strategy.steps + 1):
        masked = x[0, lo:hi] == mask_id
        out.forwarded(b)  # a denoising forward, or once nothing is masked the store forward
        if not masked.any():
            return commits
        logits = forward(x[:, :hi], pos[:, :hi])[0, lo:hi]  # (b, V)
        token = logits.argmax(-1)  # (b,)
        conf = torch.softmax(logits, dim=-1).gather(-1, token[:, None])[:, 0]  # (b,)
        chosen = pick(strategy, conf, masked, counts[t] if t < len(counts) else None)
        x[0, lo:hi] = torch.where(chosen, token, x[0, lo:hi])
        commits.append(chosen.nonzero()[:, 0].tolist())
    raise ValueError(f"block {n} still masked after {strategy.steps} steps: the reference "
                     "fails here (the mask token was predicted)")


def pick(strategy: Strategy, conf: Tensor, masked: Tensor, k: int | None) -> Tensor:
    """(b,) bool: the block offsets one step writes. conf (b,) at every offset; masked (b,);
    k: the schedule's count at this step (None past the schedule, where SDAR indexes out)."""
    if strategy.name == "entropy_bounded":
        return entropy_bounded(conf, masked, strategy.eb_threshold)
    if k is None:
        raise IndexError("SDAR's schedule has no entry for this step")
    ranked = torch.where(masked, conf, float("-inf"))
    top = torch.zeros_like(masked)
    if strategy.capped:
        k = min(k, int(masked.sum()))
    if strategy.name == "sequential":
        first = int(masked.nonzero()[0, 0])
        top[first:first + k] = True
        return top
    top[torch.topk(ranked, k).indices] = True  # k may exceed the masks: -inf offsets picked too
    if strategy.name == "dynamic":
        high = ranked >= strategy.threshold if strategy.at_least else ranked > strategy.threshold
        return high if int(high.sum()) >= k else top
    return top


def entropy_bounded(conf: Tensor, masked: Tensor, eb_threshold: float) -> Tensor:
    """SDAR's entropy_bounded: one number for the whole block, sum over its offsets of
    -p log p of the chosen token's probability; the masked offsets all get it; in sorted
    order (ties: CPU sort keeps offset order) the count whose running sum stays below the
    threshold, between 1 and the masks."""
    p = conf.clamp_min(1e-12)
    per_block = -(p * p.log()).sum()
    entropy = torch.where(masked, per_block, float("inf"))
    order = torch.sort(entropy).indices
    k = int(torch.searchsorted(torch.cumsum(entropy[order], 0), torch.tensor(eb_threshold)))
    k = max(1, min(k, int(masked.sum())))
    chosen = torch.zeros_like(masked)
    chosen[order[:k]] = True
    return chosen


# --- LLaDA2's generate() (modeling_llada2_moe.py), greedy, eos_early_stop off -------------------
def llada2_generate(forward: Forward, prompt: list[int], mask_id: int, gen_length: int,
                    block_length: int, steps: int, threshold: float, eos_id: int) -> Result:
    """No cache: every denoising step forwards the whole prefix up to the block's end, and
    there is neither a prefill nor a store forward. Step t of a block commits the masked
    offsets whose confidence exceeds `threshold` when there are at least as many as the
    schedule's count (the block's length over `steps`, as SDAR's), else the count's most
    confident (capped at the masks left); a threshold of 1 is never exceeded: the schedule
    alone. Generation stops after a block once the generated slots hold EOS."""
    p, b = len(prompt), block_length
    n_blocks = -(-(p + gen_length) // b)
    x = torch.full((1, n_blocks * b), mask_id, dtype=torch.long)
    x[0, :p] = torch.tensor(prompt)
    pos = torch.arange(n_blocks * b)[None]
    strategy = Strategy("dynamic", steps, threshold=threshold, capped=True)
    counts = schedule(b, steps)
    out = Result(canvas=[])
    for n in range(p // b, n_blocks):
        lo, hi = n * b, (n + 1) * b
        commits = []
        for t in range(steps):
            masked = x[0, lo:hi] == mask_id
            if not masked.any():
                break
            out.forwarded(hi)
            logits = forward(x[:, :hi], pos[:, :hi])[0, lo:hi]  # (b, V)
            token = logits.argmax(-1)  # (b,)
            conf = torch.softmax(logits, dim=-1).gather(-1, token[:, None])[:, 0]  # (b,)
            chosen = pick(strategy, conf, masked, counts[t])
            x[0, lo:hi] = torch.where(chosen, token, x[0, lo:hi])
            commits.append(chosen.nonzero()[:, 0].tolist())
        out.commits.append(commits)
        if bool((x[0, p:hi] == eos_id).any()):
            break
    out.canvas = x[0].tolist()
    return out


# --- FreeDave's draft-and-verify decoder (block_decode_with_block_attention_FreeDave) --------------
def freedave(forward: Forward, prompt: list[int], mask_id: int, gen_length: int, block_length: int,
             draft_steps: int, threshold: float | None, stop_ids: list[int]) -> Result:
    """Without eager acceptance (drafts stay in the block), greedy, early exit on. Its tree-
    attention verify forward (each draft attends to the stored blocks and itself) is one
    forward of every draft's prefix here, counted once with all the drafts' tokens."""
    p, b = len(prompt), block_length
    n_blocks = -(-(p + gen_length) // b)
    x = torch.full((1, n_blocks * b), mask_id, dtype=torch.long)
    x[0, :p] = torch.tensor(prompt)
    pos = torch.arange(n_blocks * b)[None]
    out = Result(canvas=[])
    if p // b:
        out.forwarded(p // b * b)
    for n in range(p // b, n_blocks):
        out.commits.append(freedave_block(forward, x, pos, n, b, mask_id, draft_steps, threshold, out))
        if stopped(x[0, n * b:(n + 1) * b], x[0, p:], stop_ids, STOPS[1]):
            x[0, (n + 1) * b:] = stop_ids[0]
            break
    out.canvas = x[0].tolist()
    return out


def freedave_block(forward: Forward, x: Tensor, pos: Tensor, n: int, b: int, mask_id: int,
                   draft_steps: int, threshold: float | None, out: Result) -> list[list[int]]:
    """Block n in place: one forward, then rounds of drafts verified by one forward each (none
    when one mask is left: the first draft is the rule's own step), then the store forward."""
    lo, hi = n * b, (n + 1) * b
    block = x[0, lo:hi].clone()
    token, conf = predict(forward, x, pos, lo, block, mask_id)
    out.forwarded(b)
    commits = []
    while True:
        masked = block == mask_id
        drafts = draft(block, token, conf, min(draft_steps, int(masked.sum())), threshold, mask_id)
        if int(masked.sum()) <= 1:
            accepted = drafts[0]
        else:
            out.forwarded(len(drafts) * b)
            preds = [predict(forward, x, pos, lo, d, mask_id) for d in drafts]
            targets = [draft(d, *pred, 1, threshold, mask_id)[0]
                       for d, pred in zip(drafts, preds, strict=True)]
            best = verify(drafts, targets, mask_id)
            accepted, (token, conf) = drafts[best], preds[best]
        commits.append((accepted != block).nonzero()[:, 0].tolist())
        block = accepted
        if not (block == mask_id).any():
            break
    x[0, lo:hi] = block
    out.forwarded(b)  # the store forward
    return commits


def predict(forward: Forward, x: Tensor, pos: Tensor, lo: int, block: Tensor,
            mask_id: int) -> tuple[Tensor, Tensor]:
    """(b,) argmax and (b,) its probability at the masked offsets of `block` in place of the
    canvas's block at lo (-inf elsewhere)."""
    hi = lo + block.shape[0]
    canvas = x[:, :hi].clone()
    canvas[0, lo:] = block
    logits = forward(canvas, pos[:, :hi])[0, lo:]
    token = logits.argmax(-1)
    conf = torch.softmax(logits, dim=-1).gather(-1, token[:, None])[:, 0]
    return token, torch.where(block == mask_id, conf, float("-inf"))


def draft(block: Tensor, token: Tensor, conf: Tensor, k: int, threshold: float | None,
          mask_id: int) -> list[Tensor]:
    """FreeDave's token_transfer, k drafts from one prediction: static-1, draft j commits the
    top j + 1 masked offsets; with a threshold (FreeDave++) draft 0 is one threshold step (>=
    it, else the top one) and draft j adds the next j by confidence."""
    masked = int((block == mask_id).sum())
    if threshold is None:
        drafts = []
        for j in range(max(k, 1)):
            d = block.clone()
            at = torch.topk(conf, min(j + 1, masked)).indices
            d[at] = token[at]
            drafts.append(d)
        return drafts
    first = block.clone()
    high = conf >= threshold
    at = high.nonzero()[:, 0] if bool(high.any()) else torch.topk(conf, min(1, masked)).indices
    first[at] = token[at]
    rest = torch.where(first == mask_id, conf, float("-inf"))
    return [first] + draft(first, token, rest, k - 1, None, mask_id)[: k - 1] if k > 1 else [first]


def verify(drafts: list[Tensor], targets: list[Tensor], mask_id: int) -> int:
    """FreeDave's chain: from draft 0, move to the last later draft equal to the current one's
    target (or all masks), until none is."""
    best = 0
    while True:
        later = [j for j in range(best + 1, len(drafts))
                 if bool((drafts[j] == targets[best]).all()) or bool((drafts[j] == mask_id).all())]
        if not later:
            return best
        best = later[-1]


def stopped(block: Tensor, generated: Tensor, stop_ids: list[int], stop: str) -> bool:
    if stop == STOPS[0]:
        return any(bool((generated == s).any()) for s in stop_ids)
    return bool((block == stop_ids[0]).all())


def answer(generated: list[int], eos: int, gen_length: int, mask_id: int) -> list[int]:
    """What a user gets of a canvas's generated slots: cut at gen_length, before the masks of
    blocks never decoded, and after the first EOS."""
    ids = generated[:gen_length]
    if mask_id in ids:
        ids = ids[: ids.index(mask_id)]
    return ids[: ids.index(eos) + 1] if eos in ids else ids


# --- Fast-dLLM v2's generate(), docs/fast-dllm-v2-reference-semantics.md ---------------------------
# (1, T) token ids, (1, T) position ids, per layer stored (k, v) (1, H, K, D) or None ->
# (1, T, V) logits and per layer the forwarded tokens' (k, v) (1, H, T, D). With stored K/V the
# tokens attend to all of it and to each other with no mask (generate()'s block cache steps);
# without, block-causally among themselves.
KVForward = Callable[[Tensor, Tensor, "list[tuple[Tensor, Tensor]] | None"],
                     "tuple[Tensor, list[tuple[Tensor, Tensor]]]"]


def fast_dllm_v2(forward: Forward, prompt: list[int], mask_id: int, max_new_tokens: int,
                 block_size: int, small_block_size: int, threshold: float, stop_id: int,
                 kv_forward: KVForward | None = None) -> Result:
    """Greedy, one prompt: the generated tokens up to and including the first stop id (as
    generate() returns them), and its forwards. The model predicts slot i from logit i - 1.
    kv_forward: generate()'s use_block_cache, its block cache emptied at each block (as
    Satgoy152/DualDiffusion added modeling.py at 189fa7a; its commit b919117 carries the cache
    across blocks: docs/fast-dllm-v2-reference-semantics.md, "Where it is wrong or odd");
    None: use_block_cache=False.
    A prompt of exactly one block is prefilled here (generate() skips the prefill there and
    decodes without the prompt: docs/fast-dllm-v2-reference-semantics.md, "Where it is
    wrong")."""
    b, p = block_size, len(prompt)
    x = list(prompt)
    out = Result(canvas=[])
    if p >= b:
        out.forwarded(p // b * b)  # the prefill: the prompt's whole blocks, K/V stored
        if p % b == 0:
            x.append(int(_logits(forward, x)[-1].argmax()))  # the prefill's last logit
    for _ in range(max_new_tokens // b):
        if stop_id in x[p:]:
            break
        start = len(x)  # generate()'s prompt_length: stops are looked for from here
        x += [mask_id] * (b - len(x) % b)
        step = (functools.partial(_block_step, forward, b=b) if kv_forward is None
                else BlockCacheStep(kv_forward, x, b, small_block_size))
        if not _decode_sub_blocks(x, b, small_block_size, threshold, (mask_id, stop_id), start,
                                  out, step):
            break  # a stop with no mask before it
        out.forwarded(b)  # the store forward; its last logit is the next block's first token
        x.append(int(_logits(forward, x)[-1].argmax()))
    gen = x[p:]
    if stop_id in gen:
        gen = gen[: gen.index(stop_id) + 1]
    out.canvas = gen
    return out


def _logits(forward: Forward, x: list[int]) -> Tensor:
    """(T, V) the logits of a whole-prefix forward (no cache: the same values)."""
    ids = torch.tensor([x])
    return forward(ids, torch.arange(len(x))[None])[0]


def _stop_settled(x: list[int], start: int, stop_id: int, mask_id: int) -> bool:
    """generate()'s check: a stop id after `start` with no mask before the first one."""
    tail = x[start:]
    return stop_id in tail and mask_id not in tail[: tail.index(stop_id)]


def _block_step(forward: Forward, x: list[int], sub: range, mask_id: int, out: Result,
                b: int) -> Tensor:
    """(s, V) the logits of the sub-block's slots from a forward of the block (no block cache)."""
    out.forwarded(b)
    # slot i from logit i - 1; generate() gives the canvas's slot 0 its own logit (a prompt
    # token: never masked)
    return _logits(forward, x)[[max(i - 1, 0) for i in sub]]


class BlockCacheStep:
    """generate()'s use_block_cache steps in one block (x's last b slots): the whole block is
    forwarded when no K/V of it is kept yet or the sub-block's first slot is masked, and its K/V
    kept; otherwise the sub-block alone, attending to the prefix's K/V and the kept K/V of the
    block's other slots (their values at the last whole-block forward)."""

    def __init__(self, kv_forward: KVForward, x: list[int], b: int, s: int) -> None:
        self.kv_forward, self.b, self.s = kv_forward, b, s
        self.lo = len(x) - b
        # the prefix's K/V as generate()'s cache holds it (block-causal forwards of its blocks)
        self.prefix = (kv_forward(torch.tensor([x[: self.lo]]), torch.arange(self.lo)[None],
                                  None)[1] if self.lo else None)
        self.block: list[tuple[Tensor, Tensor]] | None = None

    def __call__(self, x: list[int], sub: range, mask_id: int, out: Result) -> Tensor:
        lo = self.lo
        if self.block is None or x[sub.start] == mask_id:
            out.forwarded(self.b)
            logits, self.block = self.kv_forward(torch.tensor([x[lo:]]),
                                                 torch.arange(lo, len(x))[None], self.prefix)
            # slot i from logit i - 1; the block's first slot from its own (never masked here)
            return logits[0, [max(i - 1 - lo, 0) for i in sub]]
        out.forwarded(self.s)
        others = [i - lo for i in range(lo, len(x)) if i not in sub]
        past = [(torch.cat(([p[0]] if p else []) + [k[:, :, others]], 2),
                 torch.cat(([p[1]] if p else []) + [v[:, :, others]], 2))
                for p, (k, v) in zip(self.prefix or [None] * len(self.block), self.block,
                                     strict=True)]
        logits = self.kv_forward(torch.tensor([x[sub.start : sub.stop]]),
                                 torch.tensor([list(sub)]), past)[0]
        # generate() shifts the sub-block's own logits: its first slot (never masked here)
        # gets its own
        return logits[0, [max(k - 1, 0) for k in range(len(sub))]]


def _decode_sub_blocks(x: list[int], b: int, s: int, threshold: float,
                       ids: tuple[int, int], start: int, out: Result,
                       step: Callable[[list[int], range, int, Result], Tensor]) -> bool:
    """The current block (x's last b slots) in place, sub-block by sub-block (ids: the mask and
    stop ids); False once a stop is settled (generate() then stores nothing more)."""
    lo = len(x) - b
    mask_id, stop_id = ids
    for j in range(b // s):
        sub = range(lo + j * s, lo + (j + 1) * s)
        while any(x[i] == mask_id for i in sub):
            if _stop_settled(x, start, stop_id, mask_id):
                return False
            logits = step(x, sub, mask_id, out)  # (s, V)
            probs = torch.softmax(logits, dim=-1)
            token = probs.argmax(-1)
            conf = probs.gather(-1, token[:, None])[:, 0]
            masked = torch.tensor([x[i] == mask_id for i in sub])
            conf = torch.where(masked, conf, float("-inf"))
            chosen = conf > threshold
            chosen[conf.argmax()] = True
            for k in (chosen & masked).nonzero()[:, 0].tolist():
                x[sub.start + k] = int(token[k])
    return not _stop_settled(x, start, stop_id, mask_id)
