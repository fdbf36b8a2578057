"""Task registry used by training and benchmarks.

Each task exposes the same two calls:

- ``TASKS[name].load(split, n, seed=0) -> list[Example]`` with ``split`` in {"train", "heldout"};
  held-out examples never appear in training (see each module for how that is guaranteed).
- ``TASKS[name].check(example, text) -> bool``: is the generated ``text`` (the assistant's reply,
  special tokens removed) a correct answer for ``example``.

``math``: worked arithmetic, checked by the final ``#### answer`` line.
``math-strata``: held-out math problems in difficulty buckets (``unmask.tasks.strata``),
interleaved round-robin so any ``n`` is balanced; each example's ``stratum`` names its bucket.
:func:`strata_task` builds it over other buckets (the ``off-template`` one, or a few).
``code``: stdlib function bodies, checked by parsing the body under the prompt's signature.
``math-confirm``, ``code-confirm``: the confirmation split of math-strata and code: held-out
problems that no tuning run drew (``unmask.tasks.strata``), for confirming a choice made on the
tuning split (docs/decoders.md, "Choosing the default").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from unmask.errors import InputError
from unmask.tasks import code as _code
from unmask.tasks import math as _math
from unmask.tasks import strata as _strata


@dataclass(frozen=True)
class Example:
    """A prompt (user message), its reference response, and the answer a checker compares to."""

    prompt: str
    response: str
    answer: str | None
    family: str
    stratum: str | None = None  # difficulty bucket, for stratified reports (math tasks)


@dataclass(frozen=True)
class Task:
    name: str
    _load: Callable[[str, int | None, int], list[Example]]
    _check: Callable[[Example, str], bool]

    def load(self, split: str, n: int | None = None, seed: int = 0) -> list[Example]:
        if split not in ("train", "heldout"):
            raise InputError(f"split must be 'train' or 'heldout', got {split!r}")
        return self._load(split, n, seed)

    def check(self, example: Example, text: str) -> bool:
        return self._check(example, text)


def _load_math(split: str, n: int | None, seed: int) -> list[Example]:
    ps = _math.make_split(split, 500 if n is None else n, seed=seed)  # type: ignore[arg-type]
    return [Example(p.prompt, p.response, p.answer, p.family, _strata.bucket_of(p)) for p in ps]


def _check_math(ex: Example, text: str) -> bool:
    return _math.check(text, ex.answer or "")


def strata_task(buckets: tuple[str, ...] = _strata.BUCKETS, split: _strata.Split = "tuning") -> Task:
    """math-strata (``split`` "tuning") or math-confirm ("confirm") over ``buckets``
    (``unmask.tasks.strata.parse_buckets`` reads a list), interleaved in their order; 100
    problems a bucket when no ``n`` is given."""
    name = STRATA_TASKS[split]

    def load(task_split: str, n: int | None, seed: int) -> list[Example]:
        if task_split != "heldout":
            raise InputError(f"{name} is an evaluation set: held-out split only")
        rows = _strata.make_heldout(len(buckets) * 100 if n is None else n, seed, buckets, split)
        return [Example(p.prompt, p.response, p.answer, p.family, b) for b, p in rows]

    return Task(name, load, _check_math)


# The math-strata split each task name draws from (unmask.tasks.strata: tuning, confirmation).
STRATA_TASKS: dict[str, str] = {"tuning": "math-strata", "confirm": "math-confirm"}


def _code_examples(cs: list[_code.CodeExample]) -> list[Example]:
    return [Example(c.prompt, c.response, None, "code") for c in cs]


def _load_code(split: str, n: int | None, seed: int) -> list[Example]:
    return _code_examples(_code.make_split(split, n, seed=seed))  # type: ignore[arg-type]


def _load_code_confirm(split: str, n: int | None, seed: int) -> list[Example]:
    if split != "heldout":
        raise InputError("code-confirm is an evaluation set: held-out split only")
    return _code_examples(_code.make_confirm(n, seed))


def _check_code(ex: Example, text: str) -> bool:
    return _code.check(ex.prompt, text)


TASKS: dict[str, Task] = {
    "math": Task("math", _load_math, _check_math),
    "math-strata": strata_task(),
    "math-confirm": strata_task(split="confirm"),
    "code": Task("code", _load_code, _check_code),
    "code-confirm": Task("code-confirm", _load_code_confirm, _check_code),
}

__all__ = ["Example", "Task", "TASKS", "STRATA_TASKS", "strata_task"]
