"""Knobs and the policy registry: each policy declares the knobs it reads and registers once.

A policy (a commit rule, FreeDave, a ranking rule, a cache or a suffix policy) declares a frozen
dataclass of the knobs it reads, each a `knob` (default, range, whether it may differ per row)
or a `choice`, and registers itself once with `register(kind, name, impl, knobs, facts)`. The
spec grammar (unmask.decoding.params) composes DecodeParams from those classes and derives
from this registry its name lists, which keys each decoder reads, what a reference decoder is
and which knobs decide a batch. Facts are what other code asks of a policy, so that no one
tests its name.

No torch here, nor in the modules that declare knobs: the CLI's help imports them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from unmask.errors import SpecError

KINDS = ("method", "remasking", "cache", "suffix")  # the DecodeParams fields that pick a policy


@dataclass(frozen=True)
class Knob:
    """What a knob's field carries besides its default (in the field's metadata)."""

    valid: str  # its range, as the error message states it ("in (0, 1]")
    ok: Callable[[Any], bool] | None  # the range check (None: any value of its type)
    per_row: bool  # rows of one batch may hold different values (unmask.engine.batch)
    # numpy dtype of its row array: float32 for a knob compared with float32 scores, so that
    # the comparison is the one a Python float made (numpy and torch cast a Python scalar to
    # the array's float32; a float64 array would compare in float64)
    dtype: str | None = None
    options: Callable[[], Iterable[str]] | None = None  # a choice's valid values


def knob(default: Any, valid: str = "", ok: Callable[[Any], bool] | None = None,
         per_row: bool = False, dtype: str | None = None) -> Any:
    return field(default=default, metadata={"knob": Knob(valid, ok, per_row, dtype)})


def choice(default: str, options: Callable[[], Iterable[str]]) -> Any:
    """A knob naming one of `options()` (read when checked: a registry may still grow)."""
    return field(default=default, metadata={"knob": Knob("", None, False, options=options)})


def at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low  # also refuses nan


def finite_at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low and math.isfinite(v)


def within(low: float, high: float, open_low: bool = False) -> Callable[[Any], bool]:
    return (lambda v: low < v <= high) if open_low else (lambda v: low <= v <= high)


def knob_of(f: dataclasses.Field) -> Knob | None:
    return f.metadata.get("knob")


class Knobs:
    """Base of the knob classes: range and choice checks of every knob field, then each class's
    own `check` (cross-knob rules), on construction."""

    def __post_init__(self) -> None:
        check_ranges(self)
        for cls in type(self).__mro__:
            own = cls.__dict__.get("check")
            if own is not None:
                own(self)


def check_ranges(obj: Any) -> None:
    for f in fields(obj):
        k = knob_of(f)
        value = getattr(obj, f.name)
        if k is None or value is None:
            continue
        if k.options is not None:
            valid = tuple(k.options())
            if value not in valid:
                raise SpecError(f"{f.name} must be one of {', '.join(valid)}; got {value!r}",
                                key=f.name)
        elif k.ok is not None and not k.ok(value):
            raise SpecError(f"{f.name} must be {k.valid}, got {value}", key=f.name)


@dataclass(frozen=True)
class Facts:
    """What other code asks of a policy (each kind reads its own)."""

    reference: str | None = None  # method: the method it reproduces token for token
    drafts: bool = False  # method: forwards FreeDave drafts (draft_steps of them)
    uses_schedule: bool = False  # method: reads LLaDA's per-block schedule
    needs_probability: bool = False  # method: compares the ranking score with a probability
    probability: bool = True  # remasking: its ranking score is a probability
    needs_noise: bool = False  # remasking: draws from the sampling noise
    reads_entropy: bool = False  # method, remasking, cache: reads the predictive entropy
    uses_store: bool = False  # cache: keeps a K/V store
    block_causal: bool = False  # cache: for block-causal models (and only those)
    stale_keys: bool = False  # cache: reads K/V computed from an older canvas (approximate)


@dataclass(frozen=True)
class Policy:
    name: str
    impl: Any  # the class (or function) that does the work
    knobs: tuple[type, ...]  # the knob classes it reads
    facts: Facts

    @cached_property
    def reads(self) -> tuple[str, ...]:
        """The knobs it reads, in declaration order."""
        return tuple(dict.fromkeys(f.name for k in self.knobs for f in fields(k)))


REGISTRY: dict[str, dict[str, Policy]] = {kind: {} for kind in KINDS}


def register(kind: str, name: str, impl: Any, knobs: tuple[type, ...] = (),
             facts: Facts = Facts()) -> Policy:
    """Register a policy of `kind` under `name` (its spec value). A name is registered once."""
    if kind not in REGISTRY:
        raise ValueError(f"unknown policy kind {kind!r}; valid: {', '.join(KINDS)}")
    if name in REGISTRY[kind]:
        raise ValueError(f"{kind} {name!r} is already registered")
    entry = Policy(name, impl, knobs, facts)
    REGISTRY[kind][name] = entry
    applies_to.cache_clear()
    return entry


def knob_classes() -> tuple[type, ...]:
    """Every registered policy's knob classes, each once, in registration order."""
    return tuple(dict.fromkeys(k for kind in REGISTRY.values() for p in kind.values()
                               for k in p.knobs))


def names(kind: str) -> tuple[str, ...]:
    return tuple(REGISTRY[kind])


def entry(kind: str, name: str) -> Policy:
    return REGISTRY[kind][name]


@functools.lru_cache(maxsize=1)  # every parse asks; `register` clears it
def applies_to() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Keys that only some policies of a kind read: key -> (the kind, the names that read it).
    The caller must not change it (it is cached)."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for kind, policies in REGISTRY.items():
        keys = dict.fromkeys(k for p in policies.values() for k in p.reads)
        for key in keys:
            readers = tuple(p.name for p in policies.values() if key in p.reads)
            if len(readers) < len(policies):
                out[key] = (kind, readers)
    return out
