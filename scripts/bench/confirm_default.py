"""The default decoder's confirmation run (docs/decoders.md, "Choosing the default").

Every candidate for the default, `fast`, and the baseline `static-1,early_exit=true` (static-1's
text at a fraction of its cost) side by side on the confirmation split: the hard buckets of
`math-confirm` (4-digit operands, sum_list, off-template) and `code-confirm`, one problem at a
time, one thread. Plain `static-1` (and the previous `balanced`, FreeDave++ at 0.99) run on
the first --speed-per-bucket problems of each bucket only: plain static-1 decodes every one of
its 256 positions, too slow for the whole split; the speeds against it come from those.

Each problem's rows are appended to OUT/confirm-GEN.jsonl as soon as they are measured, so a
run cut off still leaves numbers, and a rerun with the same arguments resumes where the file
ends. The report (OUT/confirm-GEN.md and .json) is written after every --report-every problems
and at the end: per bucket n, accuracy, the paired difference against the baseline with its
95% interval, speeds, and the rule of unmask.bench.strata.choose_default applied to the
candidates (`fast` is reported, never a candidate). The baseline is a candidate too: it is
lossless (static-1's very tokens), so it passes whenever the run is large enough for any decoder
to pass, and the rule picks it when no faster candidate is confirmed.

    .venv/bin/python scripts/bench/confirm_default.py                  # the full size: 200 a bucket
    .venv/bin/python scripts/bench/confirm_default.py --per-bucket 5 --code 2 --out /tmp/c  # a smoke run
    .venv/bin/python scripts/bench/confirm_default.py --report-only    # the report from the jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HARD = ("digits-4", "sum_list", "off-template")
EE = "early_exit=true"
BASELINE = f"static-1,{EE}"
ENTROPY_SAFE = "cache=entropy,entropy_tau=0.5,recent_k=8,refresh_on_block=true"


@dataclass(frozen=True)
class Decoder:
    spec: str
    role: str  # "baseline", "candidate", "reported" (fast) or "speed" (the subset only)
    note: str = ""


DECODERS = (
    Decoder(BASELINE, "baseline", "static-1's text"),
    Decoder("balanced", "candidate", "the preset (threshold 0.95 + conservative EntropyCache)"),
    Decoder(f"threshold,threshold=0.95,{EE}", "candidate"),
    Decoder(f"threshold,{EE}", "candidate", "threshold 0.9"),
    Decoder(f"threshold,threshold=0.99,{EE}", "candidate",
            "the previous balanced's tokens (FreeDave++ at 0.99 is exact w.r.t. it)"),
    Decoder(f"factor,factor=0.5,{EE}", "candidate"),
    Decoder("fast", "reported", "not a default candidate"),
    Decoder("static-1", "speed", "the speed reference"),
    Decoder(f"freedave++,threshold=0.99,draft_conf=0.9,{EE}", "speed", "the previous balanced"),
)


# --------------------------------------------------------------------------- the problems


def problems(per_bucket: int, n_code: int) -> list[tuple[str, Any, Any]]:
    """(bucket, BenchExample, check) in run order: the hard buckets interleaved, the code
    functions spread among them, so that any prefix of the run is balanced."""
    from unmask.bench.tasks import load_task

    math = load_task(f"math-confirm:{','.join(HARD)}", len(HARD) * per_bucket)
    code = load_task("code-confirm", n_code) if n_code else None
    rows = [(e.stratum, e, math.check) for e in math.examples]
    if code is None:
        return rows
    step = len(rows) / n_code
    for k, e in reversed(list(enumerate(code.examples))):  # from the end: indices stay valid
        rows.insert(int(k * step) + 1, ("code", e, code.check))
    return rows


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace, jsonl: Path, lane_file: Path) -> None:
    """Measure this lane's problems (every problem when one lane), appending to ``lane_file``;
    report over every lane's file (``jsonl``'s stem) as it goes."""
    from unmask import LLM
    from unmask.api import set_threads
    from unmask.bench.runner import run_side_by_side
    from unmask.bench.tasks import BenchTask
    from unmask.decoding.params import DecodeParams

    set_threads(args.threads)
    llm = LLM()
    rows = problems(args.per_bucket, args.code)
    done = _done(jsonl, rows)
    main = [d for d in DECODERS if d.role != "speed"]
    seen: dict[str, int] = {}
    started, measured = time.process_time(), 0
    with lane_file.open("a") as out:
        for i, (bucket, ex, check) in enumerate(rows):
            seen[bucket] = seen.get(bucket, 0) + 1
            # lanes split each bucket's problems, so that every lane runs every bucket
            if i in done or (seen[bucket] - 1) % args.lanes != args.lane:
                continue
            chosen = main + ([d for d in DECODERS if d.role == "speed"]
                             if seen[bucket] <= args.speed_per_bucket else [])
            params = [DecodeParams.parse(d.spec, gen_length=args.gen_length,
                                         block_length=args.block_length) for d in chosen]
            task = BenchTask("confirm", [ex], check)
            samples = run_side_by_side(llm, task, params, warmup=1 if measured == 0 else 0)
            for d, runs in zip(chosen, samples, strict=True):
                s = runs[0]
                out.write(json.dumps({"problem": i, "bucket": bucket, "prompt": ex.prompt,
                                      "decoder": d.spec,
                                      "correct": s.correct, "tps": s.tps, "seconds": s.seconds,
                                      "nfe": s.nfe, "token_forwards": s.token_forwards,
                                      "useful": s.useful}) + "\n")
            out.flush()
            measured += 1
            print(f"problem {i + 1}/{len(rows)} ({bucket}): {time.process_time() - started:.0f} s "
                  "of CPU so far", file=sys.stderr)
            if measured % args.report_every == 0:
                report(args, jsonl)


def _done(jsonl: Path, rows: list[tuple[str, Any, Any]]) -> set[int]:
    """The problems every lane's file already has every row of; exits with a message when a
    file holds other problems (another size or version of the split)."""
    decoders: dict[int, set[str]] = {}
    for line in _lines(jsonl):
        r = json.loads(line)
        if r["problem"] >= len(rows) or rows[r["problem"]][1].prompt != r["prompt"]:
            sys.exit(f"{jsonl} holds problem {r['problem']} of another run (other sizes?); "
                     "move it away or pass the sizes it was made with")
        decoders.setdefault(r["problem"], set()).add(r["decoder"])
    main = {d.spec for d in DECODERS if d.role != "speed"}
    return {p for p, ds in decoders.items() if main <= ds}


# --------------------------------------------------------------------------- the report


def _lines(jsonl: Path) -> list[str]:
    """The rows of every lane's file."""
    return [line for f in sorted(jsonl.parent.glob(f"{jsonl.stem}*.jsonl"))
            for line in f.read_text().splitlines()]


def _load(jsonl: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """{decoder: {problem: row}}; a problem counts only once every main decoder has its row."""
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for line in _lines(jsonl):
        r = json.loads(line)
        by.setdefault(r["decoder"], {})[r["problem"]] = r
    complete = set.intersection(*(set(by.get(d.spec, {})) for d in DECODERS if d.role != "speed"))
    return {d: {p: r for p, r in rows.items() if p in complete} for d, rows in by.items()}


def _stats(rows: dict[int, dict[str, Any]], base: dict[int, dict[str, Any]],
           buckets: list[str]) -> dict[str, dict[str, Any]]:
    """{bucket: bucket_stats} over the problems both decoders ran, plus "all"."""
    from unmask.bench.strata import bucket_stats

    out = {}
    for b in [*buckets, "all"]:
        ids = sorted(p for p in rows if p in base and (b == "all" or rows[p]["bucket"] == b))
        out[b] = bucket_stats([rows[p]["correct"] for p in ids], [base[p]["correct"] for p in ids],
                              [rows[p]["tps"] for p in ids], [base[p]["tps"] for p in ids])
    return out


def _speed(rows: dict[int, dict[str, Any]], ref: dict[int, dict[str, Any]]) -> float | None:
    """Median over the problems both ran of the TPS ratio."""
    from statistics import median

    ratios = [rows[p]["tps"] / ref[p]["tps"] for p in rows if p in ref and ref[p]["tps"] > 0]
    return median(ratios) if ratios else None


def _calls(rows: dict[int, dict[str, Any]], ref: dict[int, dict[str, Any]]) -> float:
    """How many times fewer model calls than ``ref`` on the problems both ran (the cost on a
    device where a call's time hardly depends on its width, a GPU at batch 1)."""
    ids = [p for p in rows if p in ref]
    return sum(ref[p]["nfe"] for p in ids) / max(1, sum(rows[p]["nfe"] for p in ids))


def report(args: argparse.Namespace, jsonl: Path) -> dict[str, Any]:
    from unmask.bench.strata import (
        GUARANTEES,
        Candidate,
        Rule,
        choose_default,
        guarantee_of,
        strata_tables,
        underpowered,
    )

    by = _load(jsonl)
    base = by[BASELINE]
    buckets = [b for b in (*HARD, "code") if any(r["bucket"] == b for r in base.values())]
    plain = by.get("static-1", {})
    results, cands = [], []
    for d in DECODERS:
        rows = by.get(d.spec, {})
        if not rows:
            continue
        st = _stats(rows, base, buckets)
        speed_ee, speed_plain = st["all"].get("speedup"), _speed(rows, plain)
        results.append({"decoder": d.spec, "role": d.role, "note": d.note,
                        "guarantee": GUARANTEES[guarantee_of(d.spec)], "strata": st,
                        "speed_vs_static1_ee": speed_ee, "speed_vs_static1": speed_plain,
                        "speed_problems": len([p for p in rows if p in plain]),
                        "calls_vs_static1_ee": _calls(rows, base)})
        if d.role in ("baseline", "candidate") and speed_ee is not None:
            cands.append(Candidate(d.spec, st, speed_ee, guarantee_of(d.spec)))
    rule = Rule()
    chosen, verdicts = choose_default(cands, buckets, rule)
    doc = {"command": " ".join(sys.argv), "gen_length": args.gen_length,
           "block_length": args.block_length, "threads": args.threads,
           "per_bucket_asked": args.per_bucket, "code_asked": args.code,
           "rule": {"floor": rule.floor, "within": rule.within, "buckets": buckets},
           "chosen": None if chosen is None else chosen.name, "verdicts": verdicts,
           "underpowered": underpowered(results[0]["strata"], buckets, rule),
           "results": results}
    stem = jsonl.with_suffix("")
    Path(f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(doc, strata_tables([r for r in results
                                                               if r["role"] != "speed"])))
    return doc


def markdown(doc: dict[str, Any], tables: str) -> str:
    rule = doc["rule"]
    ns = ", ".join(f"{b} {doc['results'][0]['strata'][b]['n']}" for b in rule["buckets"])
    head = ["decoder", "role", "guarantee", "lowest bound (bucket)", "speed vs static-1,EE (all)",
            "speed vs static-1 (subset)", "fewer model calls than static-1,EE", "verdict"]
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    for r in doc["results"]:
        lows = {b: r["strata"][b]["delta_lo"] for b in rule["buckets"]}
        worst = min(lows, key=lambda b: lows[b])
        ee, plain = r["speed_vs_static1_ee"], r["speed_vs_static1"]
        cells = [f"`{r['decoder']}`", r["role"], r["guarantee"],
                 f"{100 * lows[worst]:+.1f} ({worst})" if r["role"] != "baseline" else "-",
                 "n/a" if ee is None else f"{ee:.2f}x",
                 "n/a" if plain is None else f"{plain:.2f}x ({r['speed_problems']} problems)",
                 f"{r['calls_vs_static1_ee']:.2f}x",
                 doc["verdicts"].get(r["decoder"], "")]
        lines.append(f"| {' | '.join(cells)} |")
    weak = doc["underpowered"]
    chosen = (f"none can pass at this size: on {', '.join(weak)} `{BASELINE}`'s own interval "
              f"against itself reaches below {100 * rule['floor']:+.0f} points" if weak
              else "none passes: no candidate is confirmed (the rule names no fallback)")
    return "\n\n".join([
        "# The default decoder on the confirmation split",
        f"Produced by `{doc['command']}` (scripts/bench/confirm_default.py): gen_length "
        f"{doc['gen_length']}, block_length {doc['block_length']}, {doc['threads']} thread; "
        f"problems per bucket: {ns} (asked: {doc['per_bucket_asked']} a hard bucket, "
        f"{doc['code_asked']} code). Baseline `{BASELINE}`. The rule: the fastest candidate "
        f"whose paired 95% interval against the baseline has its lower bound at "
        f"{100 * rule['floor']:+.0f} points or above on every bucket ({', '.join(rule['buckets'])}); "
        f"within {rule['within']}x of it in speed, the strongest guarantee.",
        "\n".join(lines),
        f"**Chosen: {'`' + doc['chosen'] + '`' if doc['chosen'] else chosen}**",
        tables, ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-bucket", type=int, default=200, help="problems a hard bucket")
    p.add_argument("--code", type=int, default=200, help="code-confirm functions")
    p.add_argument("--speed-per-bucket", type=int, default=8,
                   help="problems a bucket that plain static-1 runs on too")
    p.add_argument("--gen-length", type=int, default=256)
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--report-every", type=int, default=20)
    p.add_argument("--lane", default="0/1",
                   help="K/N: run problems K, K+N, K+2N... (N processes side by side, one a core)")
    p.add_argument("--out", default="benchmarks/strata")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    args.lane, _, lanes = args.lane.partition("/")
    args.lane, args.lanes = int(args.lane), int(lanes or 1)
    if not 0 <= args.lane < args.lanes:
        p.error(f"--lane K/N needs 0 <= K < N, got {args.lane}/{args.lanes}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / f"confirm-{args.gen_length}.jsonl"
    if not args.report_only:
        lane = f"-lane{args.lane}of{args.lanes}" if args.lanes > 1 else ""
        run(args, jsonl, jsonl.with_name(f"{jsonl.stem}{lane}.jsonl"))
    doc = report(args, jsonl)
    print(f"chosen: {doc['chosen']}")


if __name__ == "__main__":
    main()
