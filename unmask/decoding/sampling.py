"""Sampling: the knobs that turn a position's logits into a token and a ranking score, and the
ranking rules (`remasking`) registered by name.

The scoring itself runs on the model's device (unmask.decoding.scoring); this module declares
what it reads. Every sampling knob may differ per row: rows of one batch that differ only in
them share a model call, each scored with its own values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from unmask.decoding.knobs import Facts, Knobs, at_least, finite_at_least, knob, register, within
from unmask.errors import SpecError

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class SamplingKnobs(Knobs):
    temperature: float = knob(0.0, "a finite number >= 0", finite_at_least(0), per_row=True,
                              dtype="float64")
    # Dream's sampling knobs: top_p / top_k restrict the sampled token (temperature > 0 only);
    # alg_temp > 0 draws the positions to commit at random, weighted by confidence / alg_temp
    # (static rules only), instead of taking the most confident.
    top_p: float = knob(1.0, "in (0, 1]", within(0, 1, open_low=True), per_row=True,
                        dtype="float32")  # compared with float32 probability mass
    top_k: int = knob(0, ">= 0 (0 = off)", at_least(0), per_row=True, dtype="int64")
    alg_temp: float = knob(0.0, "a finite number >= 0", finite_at_least(0), per_row=True,
                           dtype="float64")
    # the request's noise key (unmask.engine.request), not a row array
    seed: int = knob(0, "an integer in 0..2**63-1", lambda v: 0 <= v < 1 << 63, per_row=True)
    suppress_eos: bool = knob(False)  # the scorer's suppressed ids are the batch's

    def check(self) -> None:
        if (self.top_p < 1 or self.top_k > 0) and self.temperature == 0:
            raise SpecError("top_p / top_k restrict sampling, and temperature 0 does not sample: "
                            "set temperature > 0 or drop them",
                            key="top_p" if self.top_p < 1 else "top_k")


# --- ranking rules: the score that orders a step's candidate positions ---------------------------
# Each takes (p (N, V) probabilities, token (N,) the tokens a commit would write, entropy (N,),
# noise_u (N, V + 1) uniforms or None) and returns (N,) scores; tensor methods only (no torch
# import here).
def _confidence(p: Tensor, token: Tensor, entropy: Tensor, noise_u: Tensor | None) -> Tensor:
    return p.gather(-1, token[:, None]).squeeze(-1)


def _margin(p: Tensor, token: Tensor, entropy: Tensor, noise_u: Tensor | None) -> Tensor:
    top2 = p.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def _neg_entropy(p: Tensor, token: Tensor, entropy: Tensor, noise_u: Tensor | None) -> Tensor:
    return -entropy


def _random(p: Tensor, token: Tensor, entropy: Tensor, noise_u: Tensor | None) -> Tensor:
    # A uniform draw, from the (seeded) noise when there is one; torch.rand's own draw if not.
    return noise_u[:, -1].float() if noise_u is not None else p.new_empty(len(token)).uniform_()


_PROBABILITY = Facts(probability=True)
register("remasking", "low_confidence", _confidence, (SamplingKnobs,), _PROBABILITY)
register("remasking", "maskgit_plus", _confidence, (SamplingKnobs,), _PROBABILITY)
register("remasking", "topk_margin", _margin, (SamplingKnobs,), _PROBABILITY)
# -entropy <= 0 is not a probability: a confidence threshold would never pass
register("remasking", "entropy", _neg_entropy, (SamplingKnobs,),
         Facts(probability=False, reads_entropy=True))
register("remasking", "random", _random, (SamplingKnobs,), Facts(needs_noise=True))
