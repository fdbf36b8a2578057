"""Decoding parameters and the one decoder-spec grammar: ``NAME[,key=value]*``.

NAME is a method (static, static-1, threshold, freedave, freedave++) or a preset (exact,
balanced, fast);
keys are DecodeParams fields. The same parser serves the CLI, the bench and the Python API, so
a spec means the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any

from unmask.errors import SpecError  # noqa: F401  (re-exported)

# The names the grammar accepts: the keys of the registries in unmask.decoding.methods,
# unmask.caching and unmask.suffix (a new rule or policy is one class registered there, plus its
# name here). Written out rather than imported so that the CLI's help text does not load torch;
# tests/test_decoding_rules.py checks they match the registries.
METHODS = ("static", "static-1", "threshold", "freedave", "freedave++")
REMASKING = ("low_confidence", "maskgit_plus", "topk_margin", "entropy", "random")
CACHES = ("none", "prefix", "dual", "entropy")
SUFFIXES = ("full", "window", "structured")
BLOCK_RECOMPUTE = ("all", "masked")
MIDDLE_RULES = ("even", "decay", "grid")


@dataclass(frozen=True)
class DecodeParams:
    """Everything that decides which tokens a decoder commits.

    Defaults of the approximate methods' knobs are the measured ones (BENCHMARKS.md).
    """

    method: str = "static-1"
    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None  # static only; None = gen_length (one token per step)
    temperature: float = 0.0
    # Dream's sampling knobs: top_p / top_k restrict the sampled token (temperature > 0 only);
    # alg_temp > 0 draws the positions to commit at random, weighted by confidence / alg_temp
    # (static rules only), instead of taking the most confident.
    top_p: float = 1.0
    top_k: int = 0
    alg_temp: float = 0.0
    seed: int = 0
    remasking: str = "low_confidence"
    threshold: float = 0.9
    draft_steps: int = 4
    # FreeDave drafts only positions at least this confident: verification keeps the output
    # exact whatever it is; it only trims drafts unlikely to be accepted (each costs compute).
    draft_conf: float = 0.0
    early_exit: bool = False
    suppress_eos: bool = False
    # K/V cache policy (unmask.caching). EntropyCache defaults from the `entropy` sweep
    # (BENCHMARKS.md, math at 512): every tau kept accuracy and exact-match; tau=3 does 32% fewer
    # token-forwards than tau=1 and is the largest value that still refreshes on uncertain
    # commits (inf never does); recent_k=4 matched 0 in speed and 16 lost a prompt's fidelity.
    cache: str = "none"
    entropy_tau: float = 3.0
    recent_k: int = 4
    refresh_on_block: bool = False
    block_recompute: str = "all"  # all | masked: see unmask.caching
    # suffix policy (unmask.suffix)
    suffix: str = "full"
    suffix_local: int = 32
    suffix_middle: int = 8
    suffix_tail: int = 8
    suffix_rule: str = "even"
    inject: float = 0.0
    # the spec this came from, for reports
    name: str = ""

    def __post_init__(self) -> None:
        _check_types(self)
        _choice("method", self.method, METHODS)
        _choice("remasking", self.remasking, REMASKING)
        _choice("cache", self.cache, CACHES)
        _choice("suffix", self.suffix, SUFFIXES)
        _choice("block_recompute", self.block_recompute, BLOCK_RECOMPUTE)
        _choice("suffix_rule", self.suffix_rule, MIDDLE_RULES)
        if self.gen_length <= 0:
            raise SpecError(f"gen_length must be a positive integer, got {self.gen_length}")
        if self.block_length <= 0:
            raise SpecError(f"block_length must be a positive integer, got {self.block_length}")
        if self.gen_length % self.block_length:
            raise SpecError(f"gen_length ({self.gen_length}) must be a multiple of block_length "
                            f"({self.block_length})")
        if self.steps is not None:
            if self.method != "static":
                raise SpecError(f"steps applies to the static method only, not {self.method}")
            if not 1 <= self.steps <= self.gen_length or self.steps % self.num_blocks:
                raise SpecError(f"steps ({self.steps}) must be in 1..{self.gen_length} and a "
                                f"multiple of the number of blocks ({self.num_blocks})")
        if not 0 <= self.seed < 1 << 63:  # the server's seed field and training's --seed alike
            raise SpecError(f"seed must be an integer in 0..2**63-1, got {self.seed}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise SpecError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if (self.top_p < 1 or self.top_k > 0) and self.temperature == 0:
            raise SpecError("top_p / top_k restrict sampling, and temperature 0 does not sample: "
                            "set temperature > 0 or drop them",
                            key="top_p" if self.top_p < 1 else "top_k")
        if not (self.alg_temp >= 0 and math.isfinite(self.alg_temp)):
            raise SpecError(f"alg_temp must be a finite number >= 0, got {self.alg_temp}")
        if not 0 < self.threshold <= 1:
            raise SpecError(f"threshold must be in (0, 1], got {self.threshold}")
        # threshold and draft_conf compare a probability; these scores are not one (remasking
        # entropy ranks by -entropy <= 0; alg_temp by log-scores plus noise), so they would
        # never pass and the decoder would quietly commit one token a step.
        unbounded = ("remasking=entropy" if self.remasking == "entropy"
                     else "alg_temp > 0" if self.alg_temp > 0 else None)
        if unbounded and self.method in ("threshold", "freedave++"):
            raise SpecError(f"{unbounded} ranks by a score that is not a probability, which a "
                            "confidence threshold cannot use: use it with static, static-1 or "
                            "freedave")
        if unbounded and self.draft_conf > 0:
            raise SpecError(f"draft_conf is a probability, and {unbounded} ranks by a score "
                            "that is not one: drop draft_conf")
        if self.draft_steps < 1:
            raise SpecError(f"draft_steps must be >= 1, got {self.draft_steps}")
        if not 0 <= self.draft_conf <= 1:
            raise SpecError(f"draft_conf must be in [0, 1], got {self.draft_conf}")
        if not self.entropy_tau >= 0:  # also refuses nan
            raise SpecError(f"entropy_tau must be >= 0 (inf allowed), got {self.entropy_tau}")
        for key in ("recent_k", "suffix_local", "suffix_middle", "suffix_tail"):
            if getattr(self, key) < 0:
                raise SpecError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.inject <= 1:
            raise SpecError(f"inject must be in [0, 1], got {self.inject}")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        """Tokens-per-step schedule of `static`: steps split evenly over blocks."""
        return (self.steps or self.gen_length) // self.num_blocks

    def canvas_for(self, n_tokens: int) -> int:
        """The gen_length of whole blocks that holds n_tokens generated tokens: how a request's
        max_tokens (server, bench-serve) or max_gen_toks (lm-eval) becomes a canvas."""
        # integer ceiling: a float division rounds (or overflows) past 2**53 tokens
        return -(-n_tokens // self.block_length) * self.block_length

    @property
    def spec(self) -> str:
        return self.name or to_spec(self)

    def replace(self, **changes: Any) -> DecodeParams:
        """A copy with `changes`; its spec is rebuilt from the values (the old text no longer
        describes it) unless `name` is given."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise SpecError(f"unknown decoder key {unknown[0]!r}; valid: {', '.join(SPEC_KEYS)}")
        changes.setdefault("name", "")
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, spec: str, explicit: dict[str, Any] | None = None,
              **defaults: Any) -> DecodeParams:
        """Parse ``NAME[,key=value]*``.

        defaults (e.g. a command's default gen_length) win over the preset and lose to keys
        written in the spec. explicit (values the user set outside the spec: a typed flag, a
        request field) win over the preset too, and a key set both there and in the spec to
        different values is an error: neither silently loses. None values are ignored."""
        if not isinstance(spec, str):
            raise SpecError(f"a decoder spec is a string NAME[,key=value]*, got {type(spec).__name__}")
        explicit = {k: v for k, v in (explicit or {}).items() if v is not None}
        defaults = {k: v for k, v in defaults.items() if v is not None}
        unknown = sorted((set(defaults) | set(explicit)) - set(SPEC_KEYS))
        if unknown:
            raise SpecError(f"unknown decoder key {unknown[0]!r}; valid: {', '.join(SPEC_KEYS)}")
        spec = spec.strip()
        if not spec:
            raise SpecError("empty decoder spec; expected NAME[,key=value]*")
        name, *pairs = [p.strip() for p in spec.split(",")]
        if name in PRESETS:
            values = dict(PRESETS[name])
        elif name in METHODS:
            values = {"method": name}
        else:
            raise SpecError(f"unknown decoder {name!r}; valid: {', '.join(METHODS + tuple(PRESETS))}")
        values.update(defaults)
        types = {f.name: f.type for f in fields(cls)}
        written: set[str] = set()
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            key = key.strip()
            if not sep or not key:
                raise SpecError(f"malformed {pair!r} in decoder spec; expected key=value")
            if key not in SPEC_KEYS:
                raise SpecError(f"unknown decoder key {key!r}; valid: {', '.join(SPEC_KEYS)}")
            if key in written:
                raise SpecError(f"{key} is set twice in the decoder spec {spec!r}; keep one")
            written.add(key)
            value = _convert(key, raw.strip(), types[key])
            if key in explicit and explicit[key] != value:
                raise SpecError(f"{key} is set twice: {key}={raw.strip()} in the decoder spec and "
                                f"{explicit[key]} outside it; drop one")
            values[key] = value
        values.update(explicit)
        _check_applies(values, written | set(explicit) | set(defaults))
        return cls(**values, name=spec)


SPEC_KEYS = tuple(f.name for f in fields(DecodeParams) if f.name not in ("method", "name"))

# Keys that only some methods or policies read: key -> (the field that picks them, its values
# that read the key). Written where nothing reads it, a key would change nothing without a word
# (`static-1,threshold=0.5` decodes as static-1), so `parse` refuses it. Presets set such keys
# for their own method and policies only, and a spec that switches a preset's policy off
# (`fast,cache=none`) leaves the preset's now unread keys alone.
APPLIES_TO: dict[str, tuple[str, tuple[str, ...]]] = {
    "steps": ("method", ("static",)),
    "threshold": ("method", ("threshold", "freedave++")),
    "draft_steps": ("method", ("freedave", "freedave++")),
    "draft_conf": ("method", ("freedave", "freedave++")),
    "entropy_tau": ("cache", ("entropy",)),
    "recent_k": ("cache", ("entropy",)),
    "refresh_on_block": ("cache", ("entropy",)),
    "block_recompute": ("cache", ("prefix", "dual", "entropy")),
    "suffix_local": ("suffix", ("window", "structured")),
    "suffix_middle": ("suffix", ("structured",)),
    "suffix_tail": ("suffix", ("structured",)),
    "suffix_rule": ("suffix", ("structured",)),
    "inject": ("suffix", ("window", "structured")),
}


def _check_applies(values: dict[str, Any], keys: set[str]) -> None:
    """Refuse each of `keys` (the ones the user wrote) that the decoder `values` describe does not
    read (APPLIES_TO)."""
    for key in sorted(keys & set(APPLIES_TO)):
        field, readers = APPLIES_TO[key]
        chosen = values.get(field, getattr(DecodeParams, field))
        if chosen not in readers:
            fix = ("start the spec with one of those" if field == "method"
                   else f"set {field}={readers[0]}" if len(readers) == 1 else f"set {field}")
            raise SpecError(f"{key} is read by {field} {' / '.join(readers)} only, and this "
                            f"decoder's {field} is {chosen}: drop {key}, or {fix}")

# Presets are plain parameter sets; `exact` has no approximation, so it is token-identical to
# static-1. `fast` values come from the sweeps in BENCHMARKS.md.
PRESETS: dict[str, dict[str, Any]] = {
    "exact": {"method": "freedave", "draft_steps": 4},
    # From the `fast` sweep (math at 1024, BENCHMARKS.md): draft_conf 0.9 (0.7 drafts more and
    # is slower on CPU), block_recompute=masked + suffix_rule=grid + suffix_local 16 +
    # suffix_tail 4 + recent_k 0 cut cost/token 4.8 -> 3.4 at threshold's accuracy; on the
    # stage-4 model the middle region's 8 picks lost 2-4 points and 16 won them back (seed-1 and
    # seed-0 prompts alike) for 0.1 more cost/token.
    "fast": {"method": "freedave++", "draft_steps": 4, "draft_conf": 0.9, "cache": "entropy",
             "block_recompute": "masked", "recent_k": 0, "suffix": "structured",
             "suffix_rule": "grid", "suffix_local": 16, "suffix_middle": 16, "suffix_tail": 4,
             "early_exit": True},
    # Issue 21 (BENCHMARKS.md § By difficulty, task math-strata, 20 problems per bucket): the
    # approximations that lost problems against static-1 were the caches (entropy, dual) and
    # the structured suffix, on 4-digit operands and sum_list; the commit rule alone did not,
    # and at threshold 0.99 it lost none of 100 (+4/-0). FreeDave++ drafting above 0.9 is
    # token-identical to threshold 0.99; early exit stops at the answer's EOS. No cache here:
    # the dual cache bought 2x speed for 1 problem lost on each of three buckets.
    "balanced": {"method": "freedave++", "threshold": 0.99, "draft_steps": 4, "draft_conf": 0.9,
                 "early_exit": True},
}

# The decoder `unmask generate`, `LLM.generate` and `unmask serve` use when none is given: the
# fastest whose held-out accuracy is within 1 point of static-1 and whose guarantee can be
# stated (README, "Choosing the default"). `balanced` is token-identical to
# threshold,threshold=0.99,early_exit=true (FreeDave++ is exact w.r.t. its threshold rule);
# measured 12-13x static-1's tokens/s at 256 and no problem lost on any difficulty bucket.
# The exact decoders (static-1, exact) measured 0.7x-3.7x. static-1 stays one flag away.
DEFAULT_DECODER = "balanced"

# The decoder each lossless method claims to reproduce token for token.
REFERENCE_METHOD = {"freedave": "static-1", "freedave++": "threshold"}


def reference_of(p: DecodeParams) -> DecodeParams | None:
    """The reference decoder `p` must be token-identical to (same cache, suffix and shared
    parameters; drafting knobs dropped), or None when `p` makes no such claim."""
    if p.method not in REFERENCE_METHOD:
        return None
    default = DecodeParams()
    return dataclasses.replace(p, method=REFERENCE_METHOD[p.method], draft_steps=default.draft_steps,
                               draft_conf=default.draft_conf, name="")


def same_decoder(a: DecodeParams, b: DecodeParams) -> bool:
    """Equal parameters, whatever spec string they were written as."""
    return dataclasses.replace(a, name="") == dataclasses.replace(b, name="")


def to_spec(p: DecodeParams) -> str:
    default = DecodeParams()
    parts = [p.method] + [f"{f.name}={getattr(p, f.name)}" for f in fields(p)
                          if f.name not in ("method", "name", "gen_length", "block_length")
                          and getattr(p, f.name) != getattr(default, f.name)]
    return ",".join(parts)


_KINDS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _check_types(p: DecodeParams) -> None:
    """Refuse values of the wrong type (``threshold=True`` from JSON, a float gen_length) with
    the key's name, before any range check compares them. numpy's integers and floats (a length
    computed with numpy) become Python's, which the spec, reports and JSON expect."""
    for f in fields(p):
        value, kind = getattr(p, f.name), str(f.type).replace(" ", "")
        if value is None and "None" in kind:
            continue
        base = kind.split("|")[0]
        # numpy registers its integers as numbers.Integral and its floats as numbers.Real
        if base in ("int", "float") and type(value) not in (int, float, bool) and isinstance(
                value, numbers.Integral if base == "int" else numbers.Real):
            value = int(value) if base == "int" else float(value)
            object.__setattr__(p, f.name, value)
        ok = isinstance(value, _KINDS[base]) and (base == "bool" or not isinstance(value, bool))
        if not ok:
            raise SpecError(f"{f.name} must be {'an' if base == 'int' else 'a'} {base}, "
                            f"got {value!r} ({type(value).__name__})")


def _choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise SpecError(f"{key} must be one of {', '.join(valid)}; got {value!r}")


def _convert(key: str, raw: str, typ: Any) -> Any:
    typ = str(typ)
    try:
        if "bool" in typ:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if "int" in typ:
            return None if raw.lower() == "none" and "None" in typ else int(raw)
        if "float" in typ:
            return float(raw)
    except ValueError:
        kind = "true/false" if "bool" in typ else typ.split("|")[0].strip()
        raise SpecError(f"{key}={raw!r} is not a valid {kind}") from None
    return raw
