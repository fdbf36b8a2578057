"""How a family's config.json maps onto ModelConfig (unmask/config.py): the `JsonKeys` each
format module of this package declares, and what those declarations share."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# The mixture-of-experts fields: LLaDA2's config.json keys of the same names. Every other family
# leaves them None (its JsonKeys omits them).
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "num_shared_experts", "moe_intermediate_size",
              "n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
              "partial_rotary_factor")


@dataclass(frozen=True)
class JsonKeys:
    """How one model_type's config.json keys map onto ModelConfig; each format module has one."""

    # config.json key -> ModelConfig field, where the names differ.
    renamed: dict[str, str]
    # key -> (the values unmask builds, what the key asks for). Any other value is refused;
    # the first value is written on save so the public modeling file builds the same model.
    variants: dict[str, tuple[tuple[Any, ...], str]]
    # Keys with no effect on inference (training setup, dropout, packaging, token ids the
    # tokenizer owns); kept and written back unchanged.
    inert: frozenset[str]
    # ModelConfig fields this format's config.json has no key for.
    omitted: frozenset[str] = frozenset()
    # Fields this format's config.json has no key for, at the value the family's published code
    # uses instead (LLaDA2's mask and EOS ids are its generate()'s defaults); never written.
    fixed: dict[str, Any] = field(default_factory=dict)
    # Variant keys a config.json may leave out: the reference's default is the value unmask
    # builds, so an absent one is not written on save either.
    implied: frozenset[str] = frozenset()
    # Written on save when the config did not come with them.
    written: dict[str, Any] = field(default_factory=dict)
    # Fills what the reference derives from other keys or nulls (e.g. LLaDA's mlp_ratio).
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def json_fields(self, names: Iterable[str]) -> dict[str, str]:
        """config.json key -> field, for each of the fields ``names`` (ModelConfig's) this
        format's config.json carries."""
        inverse = {v: k for k, v in self.renamed.items()}
        skip = ("extra", *self.omitted, *self.fixed)
        return {inverse.get(n, n): n for n in names if n not in skip}


def show(value: Any) -> str:
    """A config value as it reads in config.json, cut to one short line."""
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
