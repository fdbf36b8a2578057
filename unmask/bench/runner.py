"""Run decoders side by side on the same prompts and reduce the runs to the metrics of
docs/design.md § Metrics.

Timing on a shared CPU drifts (another process, thermal state, allocator warm-up), so decoders
are never run one after another over the whole set: for each prompt (or batch) every decoder
runs, in an order rotated per prompt so none is always first, after an untimed warm-up. Speedup
is then the median of per-prompt ratios, each taken between two runs seconds apart.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from unmask.api import LLM
from unmask.bench.tasks import BenchTask
from unmask.decoding.params import DecodeParams, reference_of, same_decoder
from unmask.engine.request import useful_length
from unmask.errors import InputError


@dataclass(frozen=True)
class Sample:
    """One decoder's run on one prompt."""

    token_ids: list[int]
    text: str
    nfe: int
    token_forwards: int
    tpf: float
    tps: float
    seconds: float
    useful: int  # tokens up to the first EOS
    correct: bool


def decoder_order(k: int, i: int) -> list[int]:
    """Decoder indices for prompt (batch) i: 0..k-1 rotated left by i."""
    return [(j + i) % k for j in range(k)]


def run_side_by_side(llm: LLM, task: BenchTask, decoders: Sequence[DecodeParams],
                     batch_size: int = 1, warmup: int = 1,
                     on_progress: Callable[[int, str], None] | None = None,
                     chat: bool = True) -> list[list[Sample]]:
    """samples[d][p] = decoder d on prompt p. on_progress(prompts_done, spec) is called after
    each decoder finishes a batch (prompts_done counts prompt x decoder runs). chat: prompts go
    through the checkpoint's chat template."""
    if not decoders:
        raise InputError("give at least one --decoder")
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    ids = [llm.encode_prompt(ex.prompt, chat=chat) for ex in task.examples]
    limit = llm.config.max_sequence_length
    longest = max(map(len, ids))
    for params in decoders:
        if longest + params.gen_length > limit:
            raise InputError(f"longest prompt ({longest} tokens) + gen_length ({params.gen_length})"
                             f" exceeds the model's max_sequence_length {limit}; use a smaller "
                             "--gen-length or fewer/shorter prompts")

    # Warm-up: every decoder on the first prompts, untimed, so the first measured run does not
    # pay for allocator growth and lazy initialisation.
    for params in decoders:
        for i in range(0, min(warmup, len(ids)), batch_size):
            llm.generate_ids(ids[i : min(i + batch_size, warmup)], params)

    eos = llm.config.eos_token_id
    samples: list[list[Sample | None]] = [[None] * len(ids) for _ in decoders]
    done = 0
    for b, start in enumerate(range(0, len(ids), batch_size)):
        batch = ids[start : start + batch_size]
        for d in decoder_order(len(decoders), b):
            for j, g in enumerate(llm.generate_ids(batch, decoders[d])):
                ex = task.examples[start + j]
                samples[d][start + j] = Sample(
                    token_ids=g.token_ids, text=g.text, nfe=g.nfe, token_forwards=g.token_forwards,
                    tpf=g.tpf, tps=g.tps, seconds=g.seconds,
                    useful=useful_length(g.token_ids, eos), correct=bool(task.check(ex, g.text)))
            done += len(batch)
            if on_progress is not None:
                on_progress(done, decoders[d].spec)
    return [[s for s in row if s is not None] for row in samples]


# --------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def reference_indices(decoders: Sequence[DecodeParams]) -> list[int | None]:
    """For each decoder, the index of the decoder it claims to reproduce (FreeDave -> static-1,
    FreeDave++ -> threshold, same other parameters) when that one is in the table."""
    out: list[int | None] = []
    for d in decoders:
        ref = reference_of(d)
        out.append(next((i for i, r in enumerate(decoders) if ref and same_decoder(r, ref)), None))
    return out


def _exact(runs: Sequence[Sample], ref: Sequence[Sample]) -> float:
    return sum(s.token_ids == r.token_ids for s, r in zip(runs, ref, strict=True)) / len(runs)


def early_exit_baseline(decoders: Sequence[DecodeParams]) -> int | None:
    """Index of vanilla with early exit (`static-1,early_exit=true`) among the decoders, if one
    is there: the baseline a fair reader asks for, since plain static-1 forwards the whole
    canvas long after the answer's EOS."""
    d0 = decoders[0] if decoders else DecodeParams()
    want = DecodeParams.parse("static-1,early_exit=true", gen_length=d0.gen_length,
                              block_length=d0.block_length, seed=d0.seed)
    return next((i for i, d in enumerate(decoders) if same_decoder(d, want)), None)


def _speedup(runs: Sequence[Sample], base: Sequence[Sample]) -> float | None:
    """Median over prompts of the TPS ratio against `base` on the same prompt (prompts where
    the base produced no useful token have no ratio)."""
    ratios = [s.tps / b.tps for s, b in zip(runs, base, strict=True) if b.tps > 0]
    return statistics.median(ratios) if ratios else None


def summarize(samples: list[list[Sample]], baseline: int = 0,
              references: Sequence[int | None] | None = None,
              early_exit: int | None = None) -> list[dict[str, Any]]:
    """One dict per decoder with the docs/design.md § Metrics metrics, measured against decoder
    ``baseline`` (exact_match, speedup); ``exact_ref`` is the exact-match rate against the
    decoder's own reference (``references[d]``), None without one; ``speedup_ee`` is the
    speedup against decoder ``early_exit`` (vanilla with early exit) when given. Undefined
    values (e.g. cost per token when no decoder produced a useful token) are None."""
    base = samples[baseline]
    references = references or [None] * len(samples)
    out = []
    for runs, ref in zip(samples, references, strict=True):
        n = len(runs)
        useful = sum(s.useful for s in runs)
        # Per-prompt TPS ratio against the baseline on the same prompt. A prompt where the
        # baseline produced no useful token has no defined ratio and is left out.
        ratios = [s.tps / b.tps for s, b in zip(runs, base, strict=True) if b.tps > 0]
        seconds = [s.seconds for s in runs]
        out.append({
            "n": n,
            "accuracy": sum(s.correct for s in runs) / n,
            "exact_match": _exact(runs, base),
            "exact_ref": None if ref is None else _exact(runs, samples[ref]),
            "nfe": statistics.fmean(s.nfe for s in runs),
            "tpf": statistics.fmean(s.tpf for s in runs),
            "token_forwards": statistics.fmean(s.token_forwards for s in runs),
            "cost_per_token": _ratio(sum(s.token_forwards for s in runs), useful),
            "tps": statistics.median(s.tps for s in runs),
            "latency_p50": percentile(seconds, 50),
            "latency_p95": percentile(seconds, 95),
            "speedup": statistics.median(ratios) if ratios else None,
            "speedup_ee": None if early_exit is None else _speedup(runs, samples[early_exit]),
            # extras, not in the required set
            "useful_tokens": useful / n,
            "seconds_total": sum(seconds),
            "speedup_prompts": len(ratios),
        })
    return out
