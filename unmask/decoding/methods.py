"""Decoding methods: a commit rule, optionally wrapped by FreeDave's draft-and-verify.

A `Rule` says how many of the current block's masked positions one reference step commits
(the positions themselves are always the most confident ones, `select_top`). A `Method` is a
rule plus the number of drafts a step forwards: one for the plain decoders, `draft_steps` for
FreeDave, which verifies the drafts against the same rule (docs/design.md § FreeDave). Each
rule declares its knobs and registers once; a FreeDave method registers as the rule it wraps
(`register_freedave`). The spec grammar's method names are this registry's keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from unmask.decoding.knobs import REGISTRY, Facts, Knobs, at_least, entry, knob, register, within
from unmask.decoding.rules import candidate_ranks, larger, static_count, threshold_count


# --- knobs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StaticKnobs(Knobs):
    # static: its schedule; threshold: a floor of that schedule's count a step. None =
    # gen_length (one token per step); its range depends on the lengths
    # (DecodeParams checks it). Per row: each row's schedule is its own (steps_per_block).
    steps: int | None = knob(None, per_row=True)


@dataclass(frozen=True)
class ThresholdKnobs(Knobs):
    # float32: compared with the float32 confidences
    threshold: float = knob(0.9, "in (0, 1]", within(0, 1, open_low=True), per_row=True,
                            dtype="float32")


@dataclass(frozen=True)
class EntropyBoundKnobs(Knobs):
    # SDAR generate.py's default; float32: compared with float32 entropy sums (nats)
    eb_threshold: float = knob(0.35, ">= 0", at_least(0), per_row=True, dtype="float32")


@dataclass(frozen=True)
class FactorKnobs(Knobs):
    # Fast-dLLM's factor rule (its paper's default f = 1); float32: its thresholds are compared
    # with the float32 confidences
    factor: float = knob(1.0, "in (0, 1]", within(0, 1, open_low=True), per_row=True,
                         dtype="float32")


@dataclass(frozen=True)
class FreeDaveKnobs(Knobs):
    draft_steps: int = knob(4, ">= 1", at_least(1))  # drafts a row forwards: the call's shape
    # FreeDave drafts only positions at least this confident: verification keeps the output
    # exact whatever it is; it only trims drafts unlikely to be accepted (each costs compute).
    draft_conf: float = knob(0.0, "in [0, 1]", within(0, 1), per_row=True, dtype="float32")


# --- rules ---------------------------------------------------------------------------------------
@dataclass
class BlockSchedule:
    """Per-row state of LLaDA's fixed schedule within the current block (static only).

    masked_at_start: (R,) masked positions when the block started; step: (R,) steps taken in
    it; steps_per_block: (R,) the row's steps per block.
    """

    masked_at_start: np.ndarray
    step: np.ndarray
    steps_per_block: np.ndarray


class Rule:
    """How many candidates (R, S) one reference step commits per row; knobs: (R,) the rows'
    per-row knobs (unmask.engine.batch). A rule registered with Facts(reads_entropy=True) also
    gets entropy=(R, S), the predictive entropies. Host arrays; `on_device` rules take torch
    tensors too (conf, cand, the schedule's fields and each knob a tensor: knobs a dict) and
    give the same counts on the tensors' device (tests/test_device_rules.py)."""

    on_device = False

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None,
              knobs: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class OneToken(Rule):
    """static-1: one token per step."""

    on_device = True

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None,
              knobs: np.ndarray) -> np.ndarray:
        return cand.any(-1) * 1  # int64, as arrays and as tensors


class Threshold(Rule):
    """Fast-dLLM: every candidate with confidence >= the row's threshold, at least one; with
    `steps`, at least the count `static` commits at this step of the block (the threshold with
    a static floor of LLaDA2's generate() and SDAR's low_confidence_dynamic, docs/decoders.md,
    "Block-diffusion decoding"). Without `steps` that floor is one a step: plain threshold."""

    on_device = True

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None,
              knobs: np.ndarray) -> np.ndarray:
        n = threshold_count(conf, cand, knobs["threshold"])
        if schedule is None:  # FreeDave++ (drafts and targets): the rule without its schedule
            return n
        return larger(n, static_count(schedule.masked_at_start, schedule.steps_per_block,
                                      schedule.step))


class Static(Rule):
    """LLaDA's reference schedule: a block's M masked positions over s steps."""

    on_device = True

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None,
              knobs: np.ndarray) -> np.ndarray:
        assert schedule is not None, "the static rule needs its block schedule"
        n = static_count(schedule.masked_at_start, schedule.steps_per_block, schedule.step)
        return n + (n == 0)  # at least one


class EntropyBounded(Rule):
    """The EB-sampler's bound: the best-ranked candidates, as many as keep their summed entropy
    below the row's eb_threshold, at least one. Ranked by `remasking` (the EB-sampler's error
    proxy; remasking=entropy ranks by entropy itself). SDAR's generate.py names this rule
    `entropy_bounded` but cannot run it, and patched it computes another quantity
    (docs/decoders.md, "Block-diffusion decoding")."""

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None,
              knobs: np.ndarray, entropy: np.ndarray | None = None) -> np.ndarray:
        assert entropy is not None, "entropy_bounded needs the predictive entropies"
        # candidates first, in commit order; entropies are >= 0, so the sums only grow
        order = np.argsort(candidate_ranks(conf, cand), axis=-1, kind="stable")
        ent = np.take_along_axis(np.where(cand, entropy, np.float32(0)), order, -1)
        within = np.cumsum(ent, -1) < knobs["eb_threshold"][:, None]
        n = (within & np.take_along_axis(cand, order, -1)).sum(-1)
        return np.maximum(n, cand.any(-1))


class Factor(Rule):
    """Fast-dLLM's factor rule, a threshold that adapts to each position's rank: the n most
    confident candidates commit when the n-th confidence is at least 1 - factor / (n + 1), at
    least one. The more a step commits at once, the surer each must be: one confident position
    passes at 1 - f/2, ten only above 1 - f/11 (f = 1: 0.5, 0.91). Confidences fall with the
    rank while the bar rises, so the positions that pass are the best n."""

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None,
              knobs: np.ndarray) -> np.ndarray:
        n = candidate_ranks(conf, cand) + 1  # (R, S) each candidate's place in the order, 1-based
        bar = np.float32(1) - knobs["factor"][:, None] / (n + 1).astype(np.float32)
        return np.maximum(((conf >= bar) & cand).sum(-1), cand.any(-1))


register("method", "static", Static, (StaticKnobs,), Facts(uses_schedule=True))
register("method", "static-1", OneToken)
register("method", "threshold", Threshold, (ThresholdKnobs, StaticKnobs),
         Facts(needs_probability=True, uses_schedule=True))


def register_freedave(name: str, rule: str) -> None:
    """FreeDave over the registered rule `rule`: its drafts commit more of the rule's ranking,
    verified by it, so it reproduces that rule token for token. It wraps the rule without its
    schedule (`steps`): a target is one more step of the rule from a draft, and which step of
    the block's schedule that is depends on the chain not yet walked."""
    base = entry("method", rule)
    facts = Facts(reference=rule, drafts=True, needs_probability=base.facts.needs_probability)
    knobs = tuple(k for k in base.knobs if k is not StaticKnobs)
    register("method", name, base.impl, (*knobs, FreeDaveKnobs), facts)


register_freedave("freedave", "static-1")
register_freedave("freedave++", "threshold")
register("method", "entropy_bounded", EntropyBounded, (EntropyBoundKnobs,),
         Facts(reads_entropy=True))
register("method", "factor", Factor, (FactorKnobs,), Facts(needs_probability=True))

METHODS = REGISTRY["method"]


@dataclass(frozen=True)
class Method:
    """A rule and how many drafts each step forwards (1 = the rule alone)."""

    rule: Rule
    n_drafts: int = 1
    uses_schedule: bool = False
    reads_entropy: bool = False

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None,
              knobs: np.ndarray, entropy: np.ndarray) -> np.ndarray:
        """The rule's count; the entropies go only to a rule that reads them."""
        if self.reads_entropy:
            return self.rule.count(conf, cand, schedule, knobs, entropy=entropy)
        return self.rule.count(conf, cand, schedule, knobs)

    @property
    def drafts(self) -> bool:
        return self.n_drafts > 1


class MethodParams(Protocol):
    """What `make_method` reads of the decode parameters (a DecodeParams, which composes the knob
    classes above with every other policy's: unmask/decoding/params.py)."""

    method: str
    draft_steps: int


def make_method(params: MethodParams) -> Method:
    e = METHODS[params.method]
    return Method(e.impl(), n_drafts=params.draft_steps if e.facts.drafts else 1,
                  uses_schedule=e.facts.uses_schedule, reads_entropy=e.facts.reads_entropy)
