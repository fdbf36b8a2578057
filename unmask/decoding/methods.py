"""Decoding methods: a commit rule, optionally wrapped by FreeDave's draft-and-verify.

A `Rule` says how many of the current block's masked positions one reference step commits
(the positions themselves are always the most confident ones, `select_top`). A `Method` is a
rule plus the number of drafts a step forwards: one for the plain decoders, `draft_steps` for
FreeDave, which verifies the drafts against the same rule (docs/design.md § FreeDave). The
spec grammar's method names are this registry's keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from unmask.decoding.rules import static_count, threshold_count

if TYPE_CHECKING:
    from unmask.decoding.params import DecodeParams


class Rule:
    """How many candidates (R, S) one reference step commits per row (host arrays)."""

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None) -> np.ndarray:
        raise NotImplementedError


@dataclass
class BlockSchedule:
    """Per-row state of LLaDA's fixed schedule within the current block (static only).

    masked_at_start: (R,) masked positions when the block started; step: (R,) steps taken in
    it; steps_per_block: (R,) the row's steps per block.
    """

    masked_at_start: np.ndarray
    step: np.ndarray
    steps_per_block: np.ndarray


class OneToken(Rule):
    """static-1: one token per step."""

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None) -> np.ndarray:
        return cand.any(-1).astype(np.int64)


class Threshold(Rule):
    """Fast-dLLM: every candidate with confidence >= tau, at least one."""

    def __init__(self, tau: float) -> None:
        self.tau = tau

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None) -> np.ndarray:
        return threshold_count(conf, cand, self.tau)


class Static(Rule):
    """LLaDA's reference schedule: a block's M masked positions over s steps."""

    def count(self, conf: np.ndarray, cand: np.ndarray, schedule: BlockSchedule | None) -> np.ndarray:
        assert schedule is not None, "the static rule needs its block schedule"
        n = static_count(schedule.masked_at_start, schedule.steps_per_block, schedule.step)
        return np.maximum(n, 1)


@dataclass(frozen=True)
class Method:
    """A rule and how many drafts each step forwards (1 = the rule alone)."""

    rule: Rule
    n_drafts: int = 1
    draft_conf: float = 0.0  # drafts only add positions at least this confident
    uses_schedule: bool = False

    @property
    def drafts(self) -> bool:
        return self.n_drafts > 1


def _static(p: DecodeParams) -> Method:
    return Method(Static(), uses_schedule=True)


def _freedave(rule: Callable[..., Rule]) -> Callable[..., Method]:
    """FreeDave wraps a rule: its drafts commit more of the rule's ranking, verified by it."""
    return lambda p: Method(rule(p), n_drafts=p.draft_steps, draft_conf=p.draft_conf)


METHODS: dict[str, Callable[..., Method]] = {
    "static": _static,
    "static-1": lambda p: Method(OneToken()),
    "threshold": lambda p: Method(Threshold(p.threshold)),
    "freedave": _freedave(lambda p: OneToken()),
    "freedave++": _freedave(lambda p: Threshold(p.threshold)),
}



def make_method(params: DecodeParams) -> Method:
    return METHODS[params.method](params)
