"""Decoding parameters and the one decoder-spec grammar: ``NAME[,key=value]*``.

NAME is a method (static, static-1, threshold, freedave, freedave++, entropy_bounded) or a
preset (exact, balanced, fast);
keys are DecodeParams fields. The same parser serves the CLI, the bench and the Python API, so
a spec means the same thing everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from unmask.caching import EntropyKnobs, StoreKnobs, SubBlockKnobs
from unmask.decoding.knobs import (
    REGISTRY,
    Knobs,
    applies_to,
    at_least,
    choice,
    entry,
    knob,
    knob_classes,
    knob_of,
    names,
)
from unmask.decoding.methods import FreeDaveKnobs, StaticKnobs, ThresholdKnobs
from unmask.decoding.sampling import SamplingKnobs
from unmask.errors import SpecError
from unmask.suffix import MIDDLE_RULES as _MIDDLE
from unmask.suffix import InjectKnobs, LocalKnobs, MiddleKnobs

# The names the grammar accepts: the registries' keys (unmask.decoding.knobs), as registered by
# the modules above. A policy registered later (a plugin, a test's toy) is valid too: the
# checks read the registry itself; these tuples list the built-in ones for help texts.
METHODS = names("method")
REMASKING = names("remasking")
CACHES = names("cache")
SUFFIXES = names("suffix")
MIDDLE_RULES = tuple(_MIDDLE)


@dataclass(frozen=True)
class _Choices(Knobs):
    """The knobs every decoder reads: which policies, and the lengths."""

    method: str = choice("static-1", lambda: names("method"))
    gen_length: int = knob(128, "a positive integer", at_least(1), per_row=True)
    block_length: int = knob(32, "a positive integer", at_least(1))
    remasking: str = choice("low_confidence", lambda: names("remasking"))
    early_exit: bool = knob(False, per_row=True, dtype="bool")
    cache: str = choice("none", lambda: names("cache"))
    suffix: str = choice("full", lambda: names("suffix"))


# The built-in knob classes in the order their keys are listed (help, errors, `to_spec`).
_BUILT_IN = (_Choices, SamplingKnobs, StaticKnobs, ThresholdKnobs, FreeDaveKnobs, EntropyKnobs,
             StoreKnobs, SubBlockKnobs, LocalKnobs, MiddleKnobs, InjectKnobs)
# Every knob class registered by the time this module is imported joins, after the built-in
# ones: a policy with new knobs needs its `register` call only, in a module imported above
# (or before this one). dataclass fields run from the last base to the first.
_KNOB_CLASSES = _BUILT_IN + tuple(k for k in knob_classes() if k not in _BUILT_IN)


@dataclass(frozen=True)
class DecodeParams(*reversed(_KNOB_CLASSES)):
    """Everything that decides which tokens a decoder commits: the knobs of every registered
    policy (`_KNOB_CLASSES`), each declared beside the policy that reads it.

    Defaults of the approximate methods' knobs are the measured ones (BENCHMARKS.md).
    """

    # the spec this came from, for reports
    name: str = ""
    # The keys the caller chose (in the spec, as flags, overrides or a command's defaults), as
    # against those a preset or the class default filled in: a model may replace only the
    # latter with its own (unmask.engine.layout.for_model). None (built directly): the keys
    # not at their default. Not a knob: two decoders that decode alike are equal.
    chosen: frozenset[str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_types(self)
        super().__post_init__()

    @property
    def chosen_keys(self) -> frozenset[str]:
        """The keys the caller chose (see `chosen`)."""
        if self.chosen is not None:
            return self.chosen
        default = DecodeParams()
        return frozenset(k for k in SPEC_KEYS if getattr(self, k) != getattr(default, k))

    def check_read(self) -> None:
        """Refuse a chosen key that this decoder does not read, once every policy is known (a
        model's own cache included): `parse` leaves to this the keys a model may come to read."""
        _check_applies({f.name: getattr(self, f.name) for f in fields(self)}, set(self.chosen_keys))

    def check(self) -> None:
        """The rules across policies (each knob class checks its own)."""
        if self.gen_length % self.block_length:
            raise SpecError(f"gen_length ({self.gen_length}) must be a multiple of block_length "
                            f"({self.block_length})", "block_length")
        if self.steps is not None:
            if "steps" not in entry("method", self.method).reads:
                readers = applies_to()["steps"][1]
                raise SpecError(f"steps applies to the {' / '.join(readers)} method only, not "
                                f"{self.method}")
            if not 1 <= self.steps <= self.gen_length or self.steps % self.num_blocks:
                raise SpecError(f"steps ({self.steps}) must be in 1..{self.gen_length} and a "
                                f"multiple of the number of blocks ({self.num_blocks})", "steps")
        # threshold and draft_conf compare a probability; these scores are not one (remasking
        # entropy ranks by -entropy <= 0; alg_temp by log-scores plus noise), so they would
        # never pass and the decoder would quietly commit one token a step.
        unbounded = (f"remasking={self.remasking}"
                     if not entry("remasking", self.remasking).facts.probability
                     else "alg_temp > 0" if self.alg_temp > 0 else None)
        if unbounded and entry("method", self.method).facts.needs_probability:
            users = [n for n, e in REGISTRY["method"].items() if not e.facts.needs_probability]
            raise SpecError(f"{unbounded} ranks by a score that is not a probability, which a "
                            "confidence threshold cannot use: use it with "
                            f"{', '.join(users[:-1])} or {users[-1]}")
        if unbounded and self.draft_conf > 0:
            raise SpecError(f"draft_conf is a probability, and {unbounded} ranks by a score "
                            "that is not one: drop draft_conf")

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
        return whole_blocks(n_tokens, self.block_length)

    @property
    def spec(self) -> str:
        return self.name or to_spec(self)

    def replace(self, **changes: Any) -> DecodeParams:
        """A copy with `changes`; its spec is rebuilt from the values (the old text no longer
        describes it) unless `name` is given."""
        unknown = sorted(set(changes) - set(SPEC_KEYS) - {"method", "name"})
        if unknown:
            raise SpecError(f"unknown decoder key {unknown[0]!r}; valid: {', '.join(SPEC_KEYS)}")
        changes.setdefault("name", "")
        if self.chosen is not None:  # a key set here is the caller's choice too
            changes["chosen"] = self.chosen | (set(changes) - {"name"})
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, spec: str, explicit: dict[str, Any] | None = None,
              **defaults: Any) -> DecodeParams:
        """Parse ``NAME[,key=value]*``.

        defaults (e.g. a command's default gen_length) win over the preset and lose to keys
        written in the spec. explicit (values the user set outside the spec: a typed flag, a
        request field) win over the preset too, and a key set both there and in the spec to
        different values is an error: neither silently loses. None values are ignored."""
        values, written = cls._resolve(spec, explicit, defaults)
        _check_applies(values, written - _left_to_the_model(values, written))
        return cls(**values, name=spec.strip(), chosen=frozenset(written))

    @classmethod
    def block_length_of(cls, spec: str, **defaults: Any) -> int:
        """The block_length `spec` resolves to under `defaults`, read before the keys that depend
        on the canvas (steps) are checked against a gen_length: a server turns max_tokens into
        a canvas of whole blocks first (`canvas_for`), then parses the spec for that canvas."""
        values, _ = cls._resolve(spec, None, defaults)
        return int(values.get("block_length", cls.block_length))

    @classmethod
    def _resolve(cls, spec: str, explicit: dict[str, Any] | None,
                 defaults: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
        """(the field values `spec` names under `explicit` and `defaults`, as in `parse`; the keys
        the user wrote), unchecked against each other."""
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
        return values, written | set(explicit) | set(defaults)


# Spec errors that a block-causal model's own block length and cache may resolve (gen_length or
# steps against the default block_length; sub_block_length against its default block_length):
# `check_before_model` leaves them to the model (unmask.engine.layout.for_model).
BLOCK_KEYS = ("block_length", "steps", "sub_block_length")


def check_before_model(spec: str, explicit: dict[str, Any] | None = None,
                       **defaults: Any) -> None:
    """`DecodeParams.parse`'s refusal of `spec` before its model is loaded (a bad spec fails at
    once, not after the load), but for the errors the model's block size may resolve."""
    try:
        DecodeParams.parse(spec, explicit, **defaults)
    except SpecError as e:
        if e.key not in BLOCK_KEYS:
            raise


def whole_blocks(n_tokens: int, block_length: int) -> int:
    """The fewest tokens in whole blocks that hold n_tokens."""
    # integer ceiling: a float division rounds (or overflows) past 2**53 tokens
    return -(-n_tokens // block_length) * block_length


SPEC_KEYS = tuple(f.name for f in fields(DecodeParams) if f.name not in ("method", "name", "chosen"))

# Keys that only some methods or policies read: key -> (the field that picks them, its values
# that read the key), from the knobs each registered policy declares. Written where nothing
# reads it, a key would change nothing without a word (`static-1,threshold=0.5` decodes as
# static-1), so `parse` refuses it. Presets set such keys for their own method and policies
# only, and a spec that switches a preset's policy off (`fast,cache=none`) leaves the preset's
# now unread keys alone. (The built-in policies'; `parse` asks the registry itself.)
APPLIES_TO = applies_to()


def _left_to_the_model(values: dict[str, Any], keys: set[str]) -> set[str]:
    """Those of `keys` that only a cache a block-causal model decodes with reads, while the
    decoder leaves its cache to the model (not in `keys`, at its default): whether they are read
    is known once the model is (`DecodeParams.check_read`). Fast-dLLM v2's
    `threshold,sub_block_length=8` parses before its model is known."""
    if "cache" in keys or values.get("cache", DecodeParams.cache) != DecodeParams.cache:
        return set()
    return block_causal_keys(keys)


def block_causal_keys(keys: set[str] | frozenset[str]) -> set[str]:
    """Those of `keys` that only the caches of block-causal models read (`sub_block_length`)."""
    table = applies_to()
    return {k for k in keys & set(table) if table[k][0] == "cache"
            and all(entry("cache", r).facts.block_causal for r in table[k][1])}


def _check_applies(values: dict[str, Any], keys: set[str]) -> None:
    """Refuse each of `keys` (the ones the user wrote) that the decoder `values` describe does not
    read (`applies_to`)."""
    table = applies_to()
    for key in sorted(keys & set(table)):
        field, readers = table[key]
        chosen = values.get(field, getattr(DecodeParams, field))
        if chosen not in readers:
            fix = ("start the spec with one of those" if field == "method"
                   else f"set {field}={readers[0]}" if len(readers) == 1 else f"set {field}")
            raise SpecError(f"{key} is read by {field} {' / '.join(readers)} only, and this "
                            f"decoder's {field} is {chosen}: drop {key}, or {fix}", key)

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
    # Which decoder `balanced` should be where the model is unsure (BENCHMARKS.md § Balanced on
    # hard problems: the hard buckets of math-strata, 4-digit operands, sum_list and
    # off-template phrasings, 40 problems each, 14 decoders side by side): the fastest decoder
    # within one problem of static-1 on every hard bucket.
    # Threshold 0.95 with an EntropyCache that refreshes the whole canvas whenever a committed
    # token's entropy passes 0.5 nats and at each block start, and recomputes the 8 latest
    # commits: 34.1x static-1 there (30.4x on 4 digits), 22 -> 21, 27 -> 26 and 13 -> 14
    # problems right. The previous balanced (FreeDave++ at 0.99, token-identical to threshold
    # 0.99) was 9.5x: its drafts cost a forward each on a CPU; threshold 0.99 without them 15.0x.
    # EntropyCache at its default knobs lost 2-5 problems on 4 digits and sum_list (§ By difficulty);
    # at these it lost one net on each and won one on off-template.
    "balanced": {"method": "threshold", "threshold": 0.95, "cache": "entropy", "entropy_tau": 0.5,
                 "recent_k": 8, "refresh_on_block": True, "early_exit": True},
}

# The decoder `unmask generate`, `LLM.generate` and `unmask serve` use when none is given: the
# one the protocol of docs/decoders.md "Choosing the default" picks. On the confirmation split
# (200 unseen problems a hard bucket, and held-out code) no approximate candidate's paired 95%
# lower bound reached -2 points against static-1 on every bucket, so the fastest decoder that
# passes is a lossless one, and on a CPU that is static-1 with early exit (FreeDave's drafts cost
# a forward each here). It gives static-1's tokens on every model; `balanced` and `fast` are one
# flag away, with what they cost measured per bucket in the same document.
DEFAULT_DECODER = "static-1,early_exit=true"

# The decoder each lossless method claims to reproduce token for token.
REFERENCE_METHOD = {n: e.facts.reference for n, e in REGISTRY["method"].items() if e.facts.reference}


def reference_of(p: DecodeParams) -> DecodeParams | None:
    """The reference decoder `p` must be token-identical to (same cache, suffix and shared
    parameters; the knobs only `p`'s method reads, its drafting knobs, dropped), or None when
    `p` makes no such claim."""
    method = entry("method", p.method)
    if method.facts.reference is None:
        return None
    own = set(method.reads) - set(entry("method", method.facts.reference).reads)
    default = DecodeParams()
    return dataclasses.replace(p, method=method.facts.reference, name="",
                               **{k: getattr(default, k) for k in own})


# --- per-row knobs --------------------------------------------------------------------------------
# Knobs that the rows of one batch may hold different values of: they change how a row's scores
# are drawn or read, never what a forward looks like. The batch keeps them as row arrays
# (unmask.engine.batch); every other knob decides which batch a request joins (`batch_params`).
PER_ROW = tuple(f.name for f in fields(DecodeParams) if (k := knob_of(f)) is not None and k.per_row)
# those that live in the row arrays (seed, gen_length and steps have their own: the noise key,
# the canvas, the static schedule)
ROW_DTYPE = np.dtype([(f.name, k.dtype) for f in fields(DecodeParams)
                      if (k := knob_of(f)) is not None and k.per_row and k.dtype is not None])
_ROW_INT_MAX = 1 << 62  # a count past every canvas: numpy's int64 cannot hold every Python int


def row_knobs(params: list[DecodeParams]) -> np.ndarray:
    """(R,) ROW_DTYPE records: each request's per-row knobs (once, when rows join a batch)."""
    return np.array([tuple(min(v, _ROW_INT_MAX) if type(v) is int else v
                           for v in (getattr(p, n) for n in ROW_DTYPE.names)) for p in params],
                    dtype=ROW_DTYPE)


@functools.lru_cache(maxsize=256)  # params are frozen; a server sees few distinct ones
def batch_params(p: DecodeParams) -> DecodeParams:
    """`p` with every per-row knob at its default and one block of generation: equal for the
    requests that may share a batch, hence a model call per step."""
    default = DecodeParams()
    reset = {k: getattr(default, k) for k in PER_ROW}
    return dataclasses.replace(p, **{**reset, "gen_length": p.block_length, "name": ""})


def same_decoder(a: DecodeParams, b: DecodeParams) -> bool:
    """Equal parameters, whatever spec string they were written as."""
    return dataclasses.replace(a, name="") == dataclasses.replace(b, name="")


def to_spec(p: DecodeParams) -> str:
    default = DecodeParams()
    parts = [p.method] + [f"{f.name}={getattr(p, f.name)}" for f in fields(p)
                          if f.name not in ("method", "name", "chosen", "gen_length", "block_length")
                          and getattr(p, f.name) != getattr(default, f.name)]
    return ",".join(parts)


_KINDS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _check_types(p: DecodeParams) -> None:
    """Refuse values of the wrong type (``threshold=True`` from JSON, a float gen_length) with
    the key's name, before any range check compares them. numpy's integers and floats (a length
    computed with numpy) become Python's, which the spec, reports and JSON expect."""
    for f in fields(p):
        if f.name == "chosen":  # not a knob: set by parse and replace
            _check_chosen(p.chosen)
            continue
        value, kind = getattr(p, f.name), _type_text(f.type).replace(" ", "")
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


def _check_chosen(chosen: Any) -> None:
    if chosen is not None and not (isinstance(chosen, (set, frozenset))
                                   and chosen <= set(SPEC_KEYS) | {"method"}):
        raise SpecError(f"chosen must be None or a set of decoder keys, got {chosen!r}")


def _type_text(typ: Any) -> str:
    """A field's annotation as written: a string under `from __future__ import annotations`,
    else a class (`int`) or a union (`int | None`), whichever a knob module used."""
    return typ if isinstance(typ, str) else getattr(typ, "__name__", None) or str(typ)


def _convert(key: str, raw: str, typ: Any) -> Any:
    typ = _type_text(typ)
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
