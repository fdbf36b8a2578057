"""Held-out math problems stratified by difficulty (issue #21).

The ``math`` task's held-out set is mostly 1-2 digit operands, where the embedded model is
confident; approximate decoders lose accuracy where it is not. This module draws held-out
problems bucket by bucket, so that each bucket has enough problems to compare decoders on:

- ``digits-1-2``, ``digits-3``, ``digits-4``: the arithmetic families (``add``, ``sub``,
  ``word``) by the digit count of the larger operand;
- ``sum_list``, ``sort``: the list families (their difficulty is the list length, 3-7 items).

Problems come from the math task's own generators (:data:`unmask.tasks.math.FAMILIES`, mixed by
:data:`~unmask.tasks.math.FAMILY_WEIGHTS`), conditioned on the bucket by rejection, so a bucket
is the training distribution restricted to that bucket — no new template or number range. A
problem is kept only when :func:`unmask.tasks.math.is_heldout` holds for its prompt: the
training stream drops exactly those prompts, so no problem here was seen in training. (The
``word`` family never draws 4-digit operands, so ``digits-4`` is ``add`` and ``sub`` only.)
"""

from __future__ import annotations

import random
import re

from unmask.tasks import math as _math

BUCKETS: tuple[str, ...] = ("digits-1-2", "digits-3", "digits-4", "sum_list", "sort")
ARITHMETIC = ("add", "sub", "word")
# Rejection sampling needs a bound; the rarest bucket (4-digit subtraction) accepts ~1 in 200.
_MAX_DRAWS = 2_000_000
_OPERANDS_RE = re.compile(r"^(?:Add (\d+) and (\d+)|Subtract (\d+) from (\d+)) column by column",
                          re.MULTILINE)


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


def _bucket_stream(bucket: str, seed: int):
    """Endless, de-duplicated stream of held-out problems of one bucket."""
    if bucket not in BUCKETS:
        raise ValueError(f"unknown bucket {bucket!r}; valid: {', '.join(BUCKETS)}")
    fams = [bucket] if bucket in ("sum_list", "sort") else list(ARITHMETIC)
    weights = [_math.FAMILY_WEIGHTS[f] for f in fams]
    # A per-bucket stream (string seeds hash stably), disjoint in spirit from the training
    # seeds; the held-out hash filter below is the real guarantee.
    rng = random.Random(f"unmask-strata/{seed}/{bucket}")
    seen: set[str] = set()
    for _ in range(_MAX_DRAWS):
        fam = rng.choices(fams, weights=weights)[0]
        p = _math.FAMILIES[fam](rng)
        if p.prompt in seen or not _math.is_heldout(p.prompt) or bucket_of(p) != bucket:
            continue
        seen.add(p.prompt)
        yield p
    raise RuntimeError(f"bucket {bucket!r}: no more distinct held-out problems")


def make_strata(per_bucket: int, seed: int = 0) -> dict[str, list[_math.Problem]]:
    """``per_bucket`` held-out problems of each bucket; a larger ``per_bucket`` extends the
    smaller one's list (same seed), so results at two sizes are comparable."""
    out = {}
    for b in BUCKETS:
        stream = _bucket_stream(b, seed)
        out[b] = [next(stream) for _ in range(per_bucket)]
    return out


def make_heldout(n: int, seed: int = 0) -> list[tuple[str, _math.Problem]]:
    """``n`` (bucket, problem) pairs, buckets interleaved round-robin, so that every prefix is
    balanced: the first 5k problems hold k of each bucket."""
    per = -(-n // len(BUCKETS))
    strata = make_strata(per, seed)
    rows = [(b, strata[b][i]) for i in range(per) for b in BUCKETS]
    return rows[:n]
