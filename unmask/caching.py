"""K/V cache policies for bidirectional decoding: which positions a step recomputes.

A policy looks at the rows about to be forwarded and returns, per row, whether the step is a
full refresh and otherwise which slots to recompute; every other visible slot is read from the
K/V store (unmask.kv). The model and the decoding rules know nothing of this.

- none: every step forwards every visible position (vanilla).
- prefix (Fast-dLLM): full forward at each block start; then the block and everything after it,
  reusing the prefix's K/V.
- dual (Fast-dLLM): full forward at each block start; then only the block, reusing prefix and
  suffix K/V.
- block (block-causal models only, unmask.engine.layout): the exact cache. The K/V of a slot is
  final once its block and every earlier one are committed in the forwarded canvas, so a step
  forwards the current block plus every visible slot without final K/V (the prompt at a row's
  first step, the block just finished after it), and only final K/V is stored. Its knob
  `sub_block_length` decodes each block in Fast-dLLM v2's sub-blocks (the layout reads it:
  unmask.engine.layout.SubBlockLayout; docs/fast-dllm-v2-reference-semantics.md).
- sub_block (block-causal models, with `sub_block_length`): Fast-dLLM v2's `use_block_cache`, its
  block cache emptied at each block (docs/fast-dllm-v2-reference-semantics.md, item 7). A
  sub-block's steps forward the whole current block until the sub-block's first slot is
  committed (and at the block's first step), keeping that forward's K/V of the block; its later
  steps forward the sub-block alone, attending to the kept K/V of the block's other slots, stale
  since. Approximate: a slot's K/V depends on every slot of its block.
- entropy (EntropyCache): forward the block plus the `recent_k` most recently committed positions;
  when the maximum entropy of the tokens committed by the last step exceeds `entropy_tau`, the
  step is a full refresh (and, optionally, at each block start). The decision is O(V) per step:
  the entropies come with the logits that committed those tokens.

`block_recompute` says what "the block" means for prefix, dual and entropy: `all` (the papers:
every slot of the current block, every step) or `masked` (only its still-masked slots, plus any
slot whose stored K/V predates its commit, so a committed token is recomputed at least once and
then read from the store like the rest of the context).

Each policy declares the knobs it reads and registers once (unmask.decoding.knobs); EntropyCache's
knobs may differ per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

from unmask.decoding.knobs import REGISTRY, Facts, Knobs, at_least, choice, knob, register
from unmask.decoding.rules import rank
from unmask.errors import SpecError


@dataclass
class StepView:
    """The R rows about to be forwarded (decoded rows, or FreeDave drafts of them); host arrays."""

    slots: np.ndarray  # (S,) slot indices
    block_start: np.ndarray  # (R,) first slot of each row's current block
    block_end: np.ndarray  # (R,) one past its last slot
    new_entropy: np.ndarray  # (R,) max entropy of the tokens the last step committed (-inf: none)
    commit_step: np.ndarray  # (R, S) step at which each slot was committed (-1: never / prompt)
    store_block: np.ndarray  # (R,) block_start the row's K/V store was last fully refreshed at (-1)
    masked: np.ndarray  # (R, S) bool slots still [MASK]
    stale: np.ndarray  # (R, S) bool slots whose stored K/V was computed from another token
    knobs: np.ndarray  # (R,) the rows' per-row knobs (unmask.engine.batch)
    window_lo: np.ndarray  # (R,) first slot the step may commit in (unmask.engine.layout.window)
    window_hi: np.ndarray  # (R,) one past its last

    @cached_property
    def in_block(self) -> np.ndarray:  # (R, S)
        return (self.slots >= self.block_start[:, None]) & (self.slots < self.block_end[:, None])

    @property
    def block_changed(self) -> np.ndarray:  # (R,)
        return self.block_start != self.store_block


@dataclass(frozen=True)
class StoreKnobs(Knobs):
    block_recompute: str = choice("all", lambda: ("all", "masked"))


@dataclass(frozen=True)
class EntropyKnobs(Knobs):
    # EntropyCache defaults from the `entropy` sweep (BENCHMARKS.md, math at 512): every tau kept
    # accuracy and exact-match; tau=3 does 32% fewer token-forwards than tau=1 and is the
    # largest value that still refreshes on uncertain commits (inf never does); recent_k=4
    # matched 0 in speed and 16 lost a prompt's fidelity. float32: compared with float32
    # entropies.
    entropy_tau: float = knob(3.0, ">= 0 (inf allowed)", at_least(0), per_row=True, dtype="float32")
    recent_k: int = knob(4, ">= 0", at_least(0), per_row=True, dtype="int64")
    refresh_on_block: bool = knob(False, per_row=True, dtype="bool")


@dataclass(frozen=True)
class SubBlockKnobs(Knobs):
    # None: the whole block is one commit window (SDAR, LLaDA2). Decides the batch: the layout
    # of every row of a decoder is one.
    sub_block_length: int | None = knob(None, "a positive integer dividing block_length",
                                        at_least(1))

    def check(self) -> None:
        n, block = self.sub_block_length, getattr(self, "block_length", None)
        if n is not None and block is not None and block % n:
            raise SpecError(f"sub_block_length ({n}) must divide block_length ({block})",
                            "sub_block_length")


class CacheParams(Protocol):
    """What a cache policy reads of the decode parameters (a DecodeParams, which composes the knob
    classes above with every other policy's: unmask/decoding/params.py)."""

    cache: str
    block_length: int
    block_recompute: str
    sub_block_length: int | None


class CachePolicy:
    """Interface: `plan` -> (refresh (R,) bool, recompute (R, S) bool for non-refresh rows)."""

    def __init__(self, params: CacheParams) -> None:
        self.params = params
        self.uses_store = REGISTRY["cache"][params.cache].facts.uses_store

    def plan(self, v: StepView) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    @property
    def reads_stale(self) -> bool:
        """Whether `block` reads `StepView.stale`: the decoder only computes it then."""
        return self.uses_store and self.params.block_recompute == "masked"

    def storable(self, idx: np.ndarray, block_start: np.ndarray) -> np.ndarray | None:
        """(R, T) which forwarded slots idx (R, T) the store keeps, for forwarded canvases whose
        current block starts at block_start (R,); None: all of them."""
        return None

    def block(self, v: StepView) -> np.ndarray:
        """(R, S) the part of the current block a non-refresh step recomputes."""
        if not self.reads_stale:
            return v.in_block
        return (v.in_block & v.masked) | v.stale


class NoCache(CachePolicy):
    def plan(self, v: StepView) -> tuple[np.ndarray, np.ndarray]:
        return np.ones(v.block_start.shape, dtype=bool), v.in_block


class PrefixCache(CachePolicy):
    def plan(self, v: StepView) -> tuple[np.ndarray, np.ndarray]:
        return v.block_changed, self.block(v) | (v.slots >= v.block_end[:, None])


class DualCache(CachePolicy):
    def plan(self, v: StepView) -> tuple[np.ndarray, np.ndarray]:
        return v.block_changed, self.block(v)


class BlockCache(CachePolicy):
    """Exact for block-causal attention: slots before the current block are stored once their
    K/V is final and read from then on; the slots of no final K/V (and the current block) are
    forwarded (unmask.kv.KVStore: a slot never stored holds none)."""

    def plan(self, v: StepView) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(v.block_start.shape, dtype=bool), v.in_block

    def storable(self, idx: np.ndarray, block_start: np.ndarray) -> np.ndarray | None:
        # every block before the forwarded canvas's current one is complete in it
        return idx < block_start[:, None]


class SubBlockCache(CachePolicy):
    """Fast-dLLM v2's block cache. Every forwarded K/V is stored: a finished block's once the
    forward that ends with it (the next block's first slot, SubBlockLayout) recomputes it, the
    current block's as the block cache its later sub-block steps read."""

    def plan(self, v: StepView) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = v.window_lo, v.window_hi  # SubBlockLayout's: the step's sub-block
        first = lo == v.block_start  # (R,) the block's first slot alone: the forward ends before
        # the block, so the previous block, stale in the store, is recomputed (generate()'s store
        # forward)
        previous = (v.slots >= v.block_start[:, None] - self.params.block_length) & (
            v.slots < v.block_start[:, None])
        sub = hi - self.params.sub_block_length  # (R,) the sub-block's first slot
        in_sub = (v.slots >= sub[:, None]) & (v.slots < hi[:, None])
        # generate() forwards the whole block while the sub-block's first slot is masked, or when
        # no K/V of the block is kept yet: then the store holds none for the block's slots, and
        # the decoder forwards every visible slot without stored K/V whatever the plan says
        whole = ((v.slots == sub[:, None]) & v.masked).any(-1)
        recompute = np.where(first[:, None], previous,
                             np.where(whole[:, None], v.in_block, in_sub))
        return np.zeros(v.block_start.shape, dtype=bool), recompute


@dataclass(frozen=True)
class SubBlockCacheKnobs(Knobs):
    def check(self) -> None:
        if getattr(self, "cache", None) == "sub_block" and getattr(self, "sub_block_length",
                                                                   None) is None:
            raise SpecError("cache=sub_block needs sub_block_length (the sub-blocks whose steps "
                            "it caches): set sub_block_length", "sub_block_length")


class EntropyCache(CachePolicy):
    def plan(self, v: StepView) -> tuple[np.ndarray, np.ndarray]:
        tau, recent_k = v.knobs["entropy_tau"], v.knobs["recent_k"]
        refresh = (v.new_entropy > tau) | (v.store_block < 0)
        on_block = v.knobs["refresh_on_block"]
        if on_block.any():
            refresh |= v.block_changed & on_block
        recompute = self.block(v)
        if recent_k.any():
            # The recent_k most recently committed slots: volatility persists after unmasking.
            # Slots committed at the same step tie; `rank` breaks ties by position (topk's
            # order is unspecified and moved with the batch's width).
            recency = np.maximum(v.commit_step, -1).astype(np.float32)
            recent = (rank(recency) < recent_k[:, None]) & (v.commit_step >= 0)
            recompute = recompute | recent
        return refresh, recompute


register("cache", "none", NoCache)
register("cache", "prefix", PrefixCache, (StoreKnobs,), Facts(uses_store=True, stale_keys=True))
register("cache", "dual", DualCache, (StoreKnobs,), Facts(uses_store=True, stale_keys=True))
register("cache", "entropy", EntropyCache, (EntropyKnobs, StoreKnobs),
         Facts(uses_store=True, reads_entropy=True, stale_keys=True))
register("cache", "block", BlockCache, (SubBlockKnobs,), Facts(uses_store=True, block_causal=True))
register("cache", "sub_block", SubBlockCache, (SubBlockKnobs, SubBlockCacheKnobs),
         Facts(uses_store=True, block_causal=True, stale_keys=True))

# name -> policy class, the registry's view
POLICIES = {name: e.impl for name, e in REGISTRY["cache"].items()}
# those for bidirectional models (LLaDA, Dream); the others are for block-causal ones
BIDIRECTIONAL = {name: impl for name, impl in POLICIES.items()
                 if not REGISTRY["cache"][name].facts.block_causal}


def make_cache_policy(params: CacheParams) -> CachePolicy:
    return REGISTRY["cache"][params.cache].impl(params)
