"""Per-bucket accuracy with confidence intervals, and each decoder's loss against the baseline.

Accuracy: Wilson score interval (95%). Loss against the baseline (the bench's first decoder,
``static-1`` in the shipped scripts) on the same problems: a paired comparison, since both
decoders answer the same problems. Reported as the count of problems won and lost (the
discordant pairs), the difference in accuracy with Newcombe's interval for paired proportions
(Newcombe 1998, method 10: Wilson intervals of both rates combined through their correlation),
and the exact two-sided McNemar p-value (a binomial test on the discordant pairs). When the net
difference is a single problem, the report says so: such a difference is one coin flip.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from unmask.bench.markdown import aligned_table

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials."""
    if n <= 0:
        return (math.nan, math.nan)
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(a: int, b: int, c: int, d: int, z: float = Z95) -> tuple[float, float, float]:
    """Difference p1 - p2 of two paired proportions and Newcombe's interval (method 10).

    a: both right, b: first right and second wrong, c: first wrong and second right,
    d: both wrong; p1 = (a+b)/n, p2 = (a+c)/n.
    """
    n = a + b + c + d
    if n == 0:
        return (math.nan, math.nan, math.nan)
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    theta = p1 - p2
    prod = (a + b) * (c + d) * (a + c) * (b + d)
    if prod == 0:
        phi = 0.0
    else:
        ad_bc = a * d - b * c
        # the continuity-corrected correlation Newcombe uses
        phi = (max(ad_bc - n / 2, 0.0) if ad_bc > 0 else ad_bc) / math.sqrt(prod)
    dl1, du1, dl2, du2 = p1 - l1, u1 - p1, p2 - l2, u2 - p2
    lo = theta - math.sqrt(max(dl1 * dl1 - 2 * phi * dl1 * du2 + du2 * du2, 0.0))
    hi = theta + math.sqrt(max(du1 * du1 - 2 * phi * du1 * dl2 + dl2 * dl2, 0.0))
    return (theta, max(-1.0, lo), min(1.0, hi))


def mcnemar_exact(won: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: P(a split at least this uneven | no difference)."""
    m = won + lost
    if m == 0:
        return 1.0
    k = min(won, lost)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m
    return min(1.0, 2 * tail)


def bucket_stats(correct: Sequence[bool], base: Sequence[bool],
                 tps: Sequence[float] | None = None,
                 base_tps: Sequence[float] | None = None) -> dict[str, Any]:
    """One decoder on one bucket against the baseline on the same problems."""
    n = len(correct)
    k = sum(map(bool, correct))
    won = sum(1 for s, r in zip(correct, base, strict=True) if s and not r)
    lost = sum(1 for s, r in zip(correct, base, strict=True) if r and not s)
    both = sum(1 for s, r in zip(correct, base, strict=True) if s and r)
    lo, hi = wilson(k, n)
    diff, dlo, dhi = paired_difference(both, won, lost, n - both - won - lost)
    out: dict[str, Any] = {
        "n": n, "correct": k, "accuracy": k / n if n else math.nan,
        "accuracy_lo": lo, "accuracy_hi": hi,
        "won": won, "lost": lost, "delta": diff, "delta_lo": dlo, "delta_hi": dhi,
        "mcnemar_p": mcnemar_exact(won, lost),
        # the net difference is at most one problem: too small to tell anything apart
        "one_problem": abs(won - lost) <= 1,
    }
    if tps is not None and base_tps is not None:
        ratios = [t / b for t, b in zip(tps, base_tps, strict=True) if b > 0]
        out["speedup"] = statistics.median(ratios) if ratios else None
        out["tps"] = statistics.median(tps) if tps else None
    return out


def stratify(strata: Sequence[str | None], correct: Sequence[Sequence[bool]],
             tps: Sequence[Sequence[float]], baseline: int = 0) -> list[dict[str, dict[str, Any]]]:
    """Per decoder, {bucket: bucket_stats} over the buckets in first-seen order, plus ``all``
    (every problem). ``correct[d][p]`` / ``tps[d][p]``: decoder d on problem p."""
    names = list(dict.fromkeys(s for s in strata if s is not None))
    groups = {b: [i for i, s in enumerate(strata) if s == b] for b in names}
    groups["all"] = list(range(len(strata)))
    out = []
    for d in range(len(correct)):
        row = {}
        for b, idx in groups.items():
            row[b] = bucket_stats([correct[d][i] for i in idx], [correct[baseline][i] for i in idx],
                                  [tps[d][i] for i in idx], [tps[baseline][i] for i in idx])
        out.append(row)
    return out


# --------------------------------------------------------------------------- choosing a default

# What a decoder promises about its text, weakest first: an approximate K/V cache (keys from an
# older canvas) can change any token; without one, only the commit rule departs from static-1;
# lossless: static-1's text.
GUARANTEES: tuple[str, ...] = ("approximate cache", "no approximate cache", "lossless")


def guarantee_of(spec: str) -> int:
    """A decoder spec's index in GUARANTEES, read from its parameters: an approximate
    (stale-key) cache or suffix is the weakest; static-1, or a method exact w.r.t. it
    (FreeDave), without either is lossless."""
    from unmask.decoding.knobs import entry
    from unmask.decoding.params import DecodeParams, reference_of

    p = DecodeParams.parse(spec)
    if entry("cache", p.cache).facts.stale_keys or p.suffix != DecodeParams().suffix:
        return 0
    ref = reference_of(p)
    return 2 if "static-1" in (p.method, ref and ref.method) else 1


@dataclass(frozen=True)
class Rule:
    """docs/decoders.md, "Choosing the default": the fastest candidate whose paired 95% interval
    against the baseline has its lower bound at ``floor`` or above on every bucket; among those
    within ``within``x of its speed, the strongest guarantee (then the fastest)."""

    floor: float = -0.02  # a fraction: -0.02 is -2 points
    within: float = 1.3

    def __post_init__(self) -> None:
        if not -1.0 <= self.floor <= 0.0:
            raise ValueError(f"floor must be a loss in [-1, 0], got {self.floor}")
        if self.within < 1.0:
            raise ValueError(f"within must be a speed ratio >= 1, got {self.within}")


@dataclass(frozen=True)
class Candidate:
    """A decoder measured against the baseline: {bucket: bucket_stats}, a speed (any unit, the
    same for every candidate) and its guarantee (an index into GUARANTEES)."""

    name: str
    strata: dict[str, dict[str, Any]]
    speed: float
    guarantee: int

    def __post_init__(self) -> None:
        if not 0 <= self.guarantee < len(GUARANTEES):
            raise ValueError(f"guarantee must index GUARANTEES, got {self.guarantee}")

    def failing(self, buckets: Sequence[str], floor: float) -> list[str]:
        """The buckets whose interval's lower bound is below ``floor`` (or unmeasured)."""
        return [b for b in buckets if not self.strata[b]["delta_lo"] >= floor]


def underpowered(baseline: dict[str, dict[str, Any]], buckets: Sequence[str],
                 rule: Rule = Rule()) -> list[str]:
    """The buckets on which the rule cannot pass any decoder: the baseline's interval against
    itself (``baseline``: its {bucket: bucket_stats} against itself) already reaches below the
    floor there, so even a decoder with the baseline's very answers fails; more problems are
    needed (about 200 a bucket at -2 points)."""
    return [b for b in buckets if not baseline[b]["delta_lo"] >= rule.floor]


def choose_default(candidates: Sequence[Candidate], buckets: Sequence[str],
                   rule: Rule = Rule()) -> tuple[Candidate | None, dict[str, str]]:
    """The candidate ``rule`` picks over ``buckets`` (None when none passes), and a one-line
    verdict per candidate."""
    verdicts: dict[str, str] = {}
    passing = []
    for c in candidates:
        if failing := c.failing(buckets, rule.floor):
            verdicts[c.name] = f"out: lower bound below {100 * rule.floor:+.0f} on {', '.join(failing)}"
        else:
            passing.append(c)
    if not passing:
        return None, verdicts
    fastest = max(passing, key=lambda c: c.speed)
    close = [c for c in passing if c.speed * rule.within >= fastest.speed]
    chosen = max(close, key=lambda c: (c.guarantee, c.speed))
    for c in passing:
        verdicts[c.name] = (
            "chosen" if c is chosen
            else f"passes; within {rule.within}x of the fastest that passes, but not the "
                 "strongest guarantee there (or slower at the same)"
            if c in close else f"passes; more than {rule.within}x slower than the fastest that passes")
    return chosen, verdicts


# --------------------------------------------------------------------------- tables


def _pct(x: float) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def accuracy_cell(s: dict[str, Any]) -> str:
    """'37.5% (18/48) [25.3, 51.6]'"""
    return (f"{_pct(s['accuracy'])}% ({s['correct']}/{s['n']}) "
            f"[{_pct(s['accuracy_lo'])}, {_pct(s['accuracy_hi'])}]")


def delta_cell(s: dict[str, Any], is_baseline: bool = False) -> str:
    """'-8.3 (+1/-5) [-18.9, +1.5]' — points against the baseline, problems won/lost, 95% CI;
    a trailing '*' when the net difference is a single problem or none."""
    if is_baseline:
        return "baseline"
    sign = "+" if s["delta"] >= 0 else ""
    lo, hi = s["delta_lo"], s["delta_hi"]
    mark = "*" if s["one_problem"] else ""
    return (f"{sign}{100 * s['delta']:.1f}{mark} (+{s['won']}/-{s['lost']}) "
            f"[{100 * lo:+.1f}, {100 * hi:+.1f}]")


def strata_tables(results: Sequence[dict[str, Any]], baseline: int = 0) -> str:
    """Two markdown tables from results carrying ``strata``: accuracy per bucket (Wilson 95%),
    then the difference against the baseline per bucket (paired 95%, problems won/lost)."""
    rows = [r for r in results if r.get("strata")]
    if not rows:
        return ""
    buckets = list(rows[0]["strata"])
    heads = ["decoder"] + [f"{b} (n {rows[0]['strata'][b]['n']})" for b in buckets]
    acc = [[f"`{r['decoder']}`"] + [accuracy_cell(r["strata"][b]) for b in buckets] for r in rows]
    delta = [[f"`{r['decoder']}`"] + [delta_cell(r["strata"][b], i == baseline) for b in buckets]
             for i, r in enumerate(results) if r.get("strata")]
    speed = [[f"`{r['decoder']}`"] + [_speed_cell(r["strata"][b]) for b in buckets] for r in rows]
    base = results[baseline]["decoder"]
    return "\n\n".join([
        "Accuracy per bucket, % (correct/n) [Wilson 95% interval]:",
        aligned_table(heads, acc, left={0}),
        f"Difference against `{base}` per bucket, points (problems won/lost on the same problems) "
        "[Newcombe paired 95% interval]; `*`: the net difference is one problem or none:",
        aligned_table(heads, delta, left={0}),
        f"Speedup against `{base}` per bucket (median over problems of the TPS ratio):",
        aligned_table(heads, speed, left={0}),
    ])


def _speed_cell(s: dict[str, Any]) -> str:
    v = s.get("speedup")
    return "n/a" if v is None else f"{v:.2f}x"


def eval_strata_lines(stats: dict[str, dict[str, Any]]) -> list[str]:
    """`unmask eval`'s per-bucket lines: '  digits-3    37.5% (18/48) [25.3, 51.6]'."""
    width = max(map(len, stats))
    return [f"  {b.ljust(width)}  {accuracy_cell(s)}" for b, s in stats.items()]
