"""Held-out math problems stratified by difficulty (BENCHMARKS.md § By difficulty).

The ``math`` task's held-out set is mostly 1-2 digit operands, where the embedded model is
confident; approximate decoders lose accuracy where it is not. This module draws held-out
problems bucket by bucket, so that each bucket has enough problems to compare decoders on:

- ``digits-1-2``, ``digits-3``, ``digits-4``: the arithmetic families (``add``, ``sub``,
  ``word``) by the digit count of the larger operand;
- ``sum_list``, ``sort``: the list families (their difficulty is the list length, 3-7 items);
- ``off-template``: ``add``, ``sub``, ``sum_list`` and ``sort`` problems asked in words the
  training templates never use (:data:`OFF_TEMPLATES`), with the same worked solutions.

Problems come from the math task's own generators (:data:`unmask.tasks.math.FAMILIES`, mixed by
:data:`~unmask.tasks.math.FAMILY_WEIGHTS`), conditioned on the bucket by rejection, so a bucket
is the training distribution restricted to that bucket — no new template or number range. A
problem is kept only when :func:`unmask.tasks.math.is_heldout` holds for its prompt: the
training stream drops exactly those prompts, so no problem here was seen in training. (The
``word`` family never draws 4-digit operands, so ``digits-4`` is ``add`` and ``sub`` only.)

``off-template`` is the one bucket that leaves the training distribution: its numbers are the
generators' own, its prompt is re-worded. It is not in the default interleave (:data:`BUCKETS`):
the tables in BENCHMARKS.md were measured on the first problems of that interleave, and adding a
bucket to it would change which problems a given ``n`` draws. Ask for it by name
(:func:`parse_buckets`, ``--task math-strata:digits-4,off-template``). Each bucket's stream is
seeded by its own name, so a bucket's problems do not depend on which others are asked for.

Two splits (:data:`SPLITS`) share these generators. ``tuning`` (task ``math-strata``) is what
decoders were compared and chosen on. ``confirm`` (task ``math-confirm``) confirms a choice
once, on problems nobody tuned on: a stream of its own, minus :func:`reserved_prompts` (every
problem the tuning streams and math's held-out split drew, or may have drawn, before it
existed), so its problems are disjoint from training, tuning and every committed run
(tests/test_confirm.py checks the problems themselves). A fresh seed alone would not do: the
held-out space is small for short lists and 1-2 digit operands, and a fresh stream repeats
tuning problems there.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import random
import re
from typing import Literal

import unmask.tasks.math as _math
from unmask.errors import InputError

# The default interleave: the problems of every committed math-strata table.
BUCKETS: tuple[str, ...] = ("digits-1-2", "digits-3", "digits-4", "sum_list", "sort")
OFF_TEMPLATE = "off-template"
ALL_BUCKETS: tuple[str, ...] = (*BUCKETS, OFF_TEMPLATE)
ARITHMETIC = ("add", "sub", "word")
# Rejection sampling needs a bound; the rarest bucket (4-digit subtraction) accepts ~1 in 200.
_MAX_DRAWS = 2_000_000
_OPERANDS_RE = re.compile(r"^(?:Add (\d+) and (\d+)|Subtract (\d+) from (\d+)) column by column",
                          re.MULTILINE)
# The digit list of a sum_list / sort prompt: every template writes it as ", ".join(digits).
_LIST_RE = re.compile(r"\d(?:, \d)+")

# Phrasings that no training template (unmask.tasks.math's _*_TEMPLATES) uses, half of them a
# small step off one (a lost space, a contraction, two training phrases crossed), half far off;
# `{a}`, `{b}`: the operands (a >= b for sub), `{xs}`: the list as the generators write it,
# `{plus}`: the list joined by " + ". tests/test_strata.py checks that none renders to a
# training prompt.
OFF_TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": ("What is {a}+{b}?", "what is {a} + {b}?", "What's {a} + {b}?", "Compute {a} plus {b}.",
            "Calculate the sum of {a} and {b}.",
            "How much is {a} plus {b}?", "{a} + {b} = ?", "Please add {b} to {a}.",
            "Find the total of {a} and {b}.", "Work out {a} + {b} for me."),
    "sub": ("What is {a}-{b}?", "what is {a} - {b}?", "What's {a} - {b}?",
            "Compute {a} minus {b}.", "Calculate the difference between {a} and {b}.",
            "How much is {a} take away {b}?", "{a} - {b} = ?", "Please take {b} away from {a}.",
            "Find {a} less {b}.", "Work out {a} - {b} for me."),
    "sum_list": ("what is the sum of {xs}?", "What's the sum of {xs}?", "Add up the numbers {xs}.",
                 "Compute the total of {xs}.",
                 "Find the total: {xs}.", "How much do {xs} add up to?", "Please sum {xs}.",
                 "{plus} = ?"),
    "sort": ("Sort {xs} from smallest to biggest.", "Sort the numbers {xs} from smallest to largest.",
             "Put {xs} in increasing order.",
             "Arrange {xs} in ascending order.", "Order {xs} from least to greatest.",
             "Please sort these: {xs}."),
}


def operand_digits(problem: _math.Problem) -> int | None:
    """Digits of the larger operand of an arithmetic problem (read from its worked solution);
    None for the list families."""
    if problem.family not in ARITHMETIC:
        return None
    m = _OPERANDS_RE.search(problem.response)
    if m is None:  # every add/sub/word response opens its column work this way
        raise ValueError(f"no operands in the worked solution of {problem.prompt!r}")
    return max(len(g) for g in m.groups() if g is not None)


def bucket_of(problem: _math.Problem) -> str:
    """The difficulty bucket of any math problem (held-out or not)."""
    digits = operand_digits(problem)
    if digits is None:
        return problem.family
    return "digits-1-2" if digits <= 2 else f"digits-{digits}"


def parse_buckets(text: str) -> tuple[str, ...]:
    """Buckets named in ``text`` ("digits-4,sum_list"), in its order; InputError on a name
    that is not a bucket, or one named twice."""
    names = tuple(b.strip() for b in text.split(","))
    for i, b in enumerate(names):
        if b not in ALL_BUCKETS:
            raise InputError(f"unknown math-strata bucket {b!r}; valid: {', '.join(ALL_BUCKETS)}")
        if b in names[:i]:
            raise InputError(f"math-strata bucket {b!r} is named twice; name each once")
    return names


def off_template(problem: _math.Problem, rng: random.Random) -> _math.Problem:
    """``problem`` (add, sub, sum_list or sort) asked in one of :data:`OFF_TEMPLATES`; the worked
    solution and the answer are unchanged."""
    if problem.family in ("sum_list", "sort"):
        xs = _LIST_RE.search(problem.prompt).group(0)
        fields = {"xs": xs, "plus": xs.replace(", ", " + ")}
    else:  # the worked solution names the operands: "Add a and b" / "Subtract b from a"
        add_a, add_b, sub_b, sub_a = _OPERANDS_RE.search(problem.response).groups()
        fields = {"a": add_a or sub_a, "b": add_b or sub_b}
    prompt = rng.choice(OFF_TEMPLATES[problem.family]).format(**fields)
    return dataclasses.replace(problem, prompt=prompt)


def _draw(bucket: str, rng: random.Random) -> _math.Problem | None:
    """One problem of ``bucket`` drawn from the math task's generators, or None when the draw
    falls in another bucket (rejection)."""
    if bucket == OFF_TEMPLATE:
        fams = list(OFF_TEMPLATES)
    else:
        fams = [bucket] if bucket in ("sum_list", "sort") else list(ARITHMETIC)
    fam = rng.choices(fams, weights=[_math.FAMILY_WEIGHTS[f] for f in fams])[0]
    p = _math.FAMILIES[fam](rng)
    if bucket == OFF_TEMPLATE:
        return off_template(p, rng)
    return p if bucket_of(p) == bucket else None


Split = Literal["tuning", "confirm"]
SPLITS: tuple[str, ...] = ("tuning", "confirm")
# Every problem drawn for tuning or reporting before the confirmation split existed came from
# the seed-0 or seed-1 streams (the committed runs: at most 40 problems a bucket of math-strata,
# 96 of math; sweeps.sh's `fast` run used seed 1). The confirmation split leaves out the first
# RESERVE_PER_BUCKET of each bucket's tuning stream and the first RESERVE_MATH of math's held-out
# split under these seeds (ten times what any committed run drew), and the lm-eval set.
RESERVED_SEEDS: tuple[int, ...] = (0, 1)
RESERVE_PER_BUCKET = 400
RESERVE_MATH = 1000


def _bucket_stream(bucket: str, name: str, exclude: frozenset[str] = frozenset()):
    """Endless, de-duplicated stream of held-out problems of one bucket, drawn by the RNG named
    ``name``/``bucket`` and skipping the prompts in ``exclude``."""
    if bucket not in ALL_BUCKETS:
        raise ValueError(f"unknown bucket {bucket!r}; valid: {', '.join(ALL_BUCKETS)}")
    # A per-bucket stream (string seeds hash stably), disjoint in spirit from the training
    # seeds; the held-out hash filter below is the real guarantee.
    rng = random.Random(f"{name}/{bucket}")
    seen: set[str] = set()
    for _ in range(_MAX_DRAWS):
        p = _draw(bucket, rng)
        if p is None or p.prompt in seen or p.prompt in exclude or not _math.is_heldout(p.prompt):
            continue
        seen.add(p.prompt)
        yield p
    raise RuntimeError(f"bucket {bucket!r}: no more distinct held-out problems")


@functools.cache
def reserved_prompts() -> frozenset[str]:
    """Every held-out math prompt the confirmation split must not hold: the problems tuning
    drew or may draw (see :data:`RESERVED_SEEDS`) and the lm-eval math set."""
    from unmask.evaluation import TASKS_DIR

    lm_eval = (TASKS_DIR / "unmask_math_heldout.jsonl").read_text().splitlines()
    out = {json.loads(line)["prompt"] for line in lm_eval if line}
    for seed in RESERVED_SEEDS:
        out.update(p.prompt for p in _math.make_split("heldout", RESERVE_MATH, seed))
        for b in ALL_BUCKETS:
            out.update(p.prompt for p in itertools.islice(
                _bucket_stream(b, f"unmask-strata/{seed}"), RESERVE_PER_BUCKET))
    return frozenset(out)


def _split_stream(bucket: str, seed: int, split: Split):
    """The tuning split: the streams every committed math-strata table drew from. The
    confirmation split: a stream of its own, minus :func:`reserved_prompts`, so none of its
    problems was trained on (held-out hash), tuned on or reported before."""
    if split == "tuning":
        return _bucket_stream(bucket, f"unmask-strata/{seed}")
    if split == "confirm":
        return _bucket_stream(bucket, f"unmask-confirm/{seed}", reserved_prompts())
    raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")


def make_strata(per_bucket: int, seed: int = 0, buckets: tuple[str, ...] = BUCKETS,
                split: Split = "tuning") -> dict[str, list[_math.Problem]]:
    """``per_bucket`` held-out problems of each of ``buckets`` from ``split``; a larger
    ``per_bucket`` extends the smaller one's list (same seed), so results at two sizes are
    comparable."""
    out = {}
    for b in buckets:
        stream = _split_stream(b, seed, split)
        out[b] = [next(stream) for _ in range(per_bucket)]
    return out


def make_heldout(n: int, seed: int = 0, buckets: tuple[str, ...] = BUCKETS,
                 split: Split = "tuning") -> list[tuple[str, _math.Problem]]:
    """``n`` (bucket, problem) pairs, ``buckets`` interleaved round-robin, so that every prefix
    is balanced: with the five default buckets the first 5k problems hold k of each."""
    per = -(-n // len(buckets))
    strata = make_strata(per, seed, buckets, split)
    rows = [(b, strata[b][i]) for i in range(per) for b in buckets]
    return rows[:n]
