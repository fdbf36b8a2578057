"""Structured output on the shipped models: held-out math answered as `{"answer": <integer>}`,
as `{"steps": [string], "answer": <integer>}`, and in the models' own trained format held to a
regular expression (a worked solution, then `#### <integer>`), unconstrained (then parsed) against the
constraint (complete: out-of-order commits kept completable, with the JSON formats' length prior
and without it; prefix: the longest-valid-prefix baseline, no prior), side by side on the same
prompts. Reports schema-valid %, answer accuracy, TPF, NFE,
and the constraint's CPU time as a share of the decode's at batch 1 and 16 (the median of
--repeats runs; the tokens do not change between them). Then the length prior's weight swept on
the JSON schemas (batch 16). One thread, CPU clock. Writes the Structured output section of
BENCHMARKS.md (benchmarks/extra/, assembled by `ASSEMBLE_ONLY=1 bash scripts/benchmarks.sh`).

    python scripts/bench/structured_output.py [--n 24] [--gen-length 64] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from unmask import LLM
from unmask.decoding.grammar import Constraint, ResponseFormat
from unmask.tasks.math import check, make_split

SCHEMAS = {
    "answer": {"type": "object", "properties": {"answer": {"type": "integer"}},
               "required": ["answer"]},
    "steps+answer": {"type": "object", "properties": {
        "steps": {"type": "array", "items": {"type": "string"}}, "answer": {"type": "integer"}},
        "required": ["steps", "answer"]},
}
PRIOR_WEIGHTS = (0.0, 1.0, 2.0, 3.0, 4.0)  # the length prior's weights swept
OWN_FORMAT = r"[^#]*#### -?[0-9]+"  # the trained format: no '#' before the answer mark
MODELS = {"unmask-llada": "threshold,threshold=0.9", "unmask-sdar": "threshold,threshold=0.9"}
# mode label -> (grammar mode, length prior: None = the format's default)
MODES = {"unconstrained": None, "complete": ("complete", None),
         "complete, no prior": ("complete", 0.0), "prefix": ("prefix", 0.0)}


class GrammarClock:
    """CPU seconds spent in the constraint's work (masks, commit checks, draft checks,
    settling)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("weights", "write_weights", "allowed", "restrict", "feasible", "settle"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        inner = getattr(Constraint, name)
        clock = self

        def timed(self, *a, **kw):
            if getattr(clock, "_inside", False):  # restrict calls feasible: count once
                return inner(self, *a, **kw)
            clock._inside = True
            t = time.process_time()
            try:
                return inner(self, *a, **kw)
            finally:
                clock.seconds += time.process_time() - t
                clock._inside = False

        setattr(Constraint, name, timed)


def answer_of(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return str(value.get("answer")) if isinstance(value, dict) else None


def run(llm: LLM, spec: str, prompts: list[str], fmt: ResponseFormat | None, batch: int,
        clock: GrammarClock, gen_length: int) -> tuple[list, float, float]:
    before = clock.seconds
    t = time.process_time()
    outs = llm.generate(prompts, spec, batch_size=batch, response_format=fmt,
                        gen_length=gen_length)
    return outs, time.process_time() - t, clock.seconds - before


def shares(llm: LLM, spec: str, prompts: list[str], fmt: ResponseFormat | None,
           clock: GrammarClock, args: argparse.Namespace) -> tuple[list, dict]:
    """The batch-16 outputs, and per batch size the median grammar share and CPU seconds of
    `args.repeats` runs, batch sizes interleaved."""
    got: dict[int, list[tuple[float, float]]] = {1: [], 16: []}
    outs = None
    for _ in range(args.repeats):
        for batch in got:
            o, total, spent = run(llm, spec, prompts, fmt, batch, clock, args.gen_length)
            got[batch].append((spent / total if total else 0.0, total))
            outs = o if batch == 16 else outs
    row = {}
    for batch, vals in got.items():
        row[f"share_b{batch}"] = statistics.median(v[0] for v in vals)
        row[f"cpu_b{batch}"] = statistics.median(v[1] for v in vals)
    return outs, row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/extra/zz-Structured output.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = GrammarClock()
    problems = [p for p in make_split("heldout", 4 * args.n) if p.answer.lstrip("-").isdigit()]
    problems = problems[: args.n]
    prompts = [p.prompt for p in problems]
    rows, sweep = [], []
    for model, spec in MODELS.items():
        llm = LLM(model)
        free = {}  # the unconstrained decode, one per model: it reads no format
        for sname in (*SCHEMAS, "own format (regex)"):
            check_fmt = (ResponseFormat.json_schema(SCHEMAS[sname]) if sname in SCHEMAS
                         else ResponseFormat.regex(OWN_FORMAT))
            for mode, how in MODES.items():
                if sname not in SCHEMAS and mode == "complete, no prior":
                    continue  # a regex has no prior by default: "complete" is this run
                fmt = None if how is None else replace(
                    check_fmt, mode=how[0],
                    length_penalty=check_fmt.length_penalty if how[1] is None else how[1])
                row = {"model": model, "schema": sname, "mode": mode}
                if how is None and "outs" in free:
                    outs, timing = free["outs"], free["timing"]
                else:
                    outs, timing = shares(llm, spec, prompts, fmt, clock, args)
                    if how is None:
                        free.update(outs=outs, timing=timing)
                row.update(timing)
                rows.append(measure(row, outs, problems, check_fmt))
                print(json.dumps(row), file=sys.stderr)
        sweep += prior_sweep(llm, model, spec, prompts, problems, args)
    write(rows, sweep, args)
    return 0


def prior_sweep(llm: LLM, model: str, spec: str, prompts: list[str], problems: list,
                args: argparse.Namespace) -> list[dict]:
    """The complete mode on the JSON schemas at each length prior weight (batch 16)."""
    out = []
    for sname, schema in SCHEMAS.items():
        for weight in PRIOR_WEIGHTS:
            fmt = ResponseFormat.json_schema(schema, length_penalty=weight)
            outs = llm.generate(prompts, spec, batch_size=16, response_format=fmt,
                                gen_length=args.gen_length)
            row = measure({"model": model, "schema": sname, "weight": weight}, outs,
                          problems, fmt)
            out.append(row)
            print(json.dumps(row), file=sys.stderr)
    return out


def measure(row: dict, outs: list, problems: list, check_fmt: ResponseFormat) -> dict:
    texts = [o.text for o in outs]
    row["valid"] = sum(check_fmt.accepts(t) for t in texts) / len(texts)
    row["acc_json"] = sum(answer_of(t) == p.answer
                          for t, p in zip(texts, problems, strict=True)) / len(texts)
    row["acc_free"] = sum(check(t, p.answer)
                          for t, p in zip(texts, problems, strict=True)) / len(texts)
    row["tpf"] = statistics.mean(o.tpf for o in outs)
    row["nfe"] = statistics.mean(o.nfe for o in outs)
    row["useful"] = statistics.mean(o.useful for o in outs)
    row["length"] = sum(o.finish_reason == "length" for o in outs)
    row["example"] = texts[0][:70]
    return row


def write(rows: list[dict], sweep: list[dict], args: argparse.Namespace) -> None:
    lines = [f"Produced by `python scripts/bench/structured_output.py --n {args.n} --gen-length "
             f"{args.gen_length} --repeats {args.repeats}` (one thread, CPU clock; held-out math",
             "problems with integer answers, chat template, decoder `threshold,threshold=0.9`).",
             "valid: the output parses and validates against the schema; accuracy (JSON): its",
             "`answer` equals the problem's; accuracy (own format): the model's trained",
             "`#### answer` line is right (what the unconstrained model is good at; the regex rows",
             "hold it to `[^#]*#### -?[0-9]+`). complete: the out-of-order constraint with the JSON",
             "formats' length prior (weight 2, docs/decoders.md § Structured output); complete, no",
             "prior: weight 0; prefix: the longest-valid-prefix baseline, no prior. TPF and NFE per",
             "output (TPF counts what forwards decided: the scaffold, what settling wrote after a",
             "commit and early exit's EOS fill are not counted), with their ratio to the model's",
             "unconstrained decode of the same",
             "prompts; useful tokens: the output's, up to its EOS; length: outputs that ended",
             "without EOS. Grammar share: the constraint's CPU time (masks and weights, commit",
             "checks, settling) over the whole decode's, all prompts at batch 1 and at batch 16, the",
             f"median of {args.repeats} runs. The grammar libraries compared:",
             "[benchmarks/bench/grammar-libraries.md](benchmarks/bench/grammar-libraries.md)",
             "(`python scripts/bench/grammar_libraries.py`).",
             "",
             "| model | schema | mode | valid | accuracy (JSON) | accuracy (own format) | TPF "
             "| TPF vs unconstrained | NFE | NFE vs unconstrained | grammar share b1 "
             "| grammar share b16 | useful tokens | length | first output |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["model"]: r for r in rows if r["mode"] == "unconstrained"}
    for r in rows:
        b = base[r["model"]]
        lines.append(f"| {r['model']} | {r['schema']} | {r['mode']} | {r['valid']:.0%} | "
                     f"{r['acc_json']:.0%} | {r['acc_free']:.0%} | {r['tpf']:.2f} | "
                     f"{r['tpf'] / b['tpf']:.2f}x | {r['nfe']:.1f} | {r['nfe'] / b['nfe']:.2f}x | "
                     f"{r['share_b1']:.1%} | {r['share_b16']:.1%} | {r['useful']:.1f} | "
                     f"{r['length']} | `{_shown(r['example'])}` |")
    lines += ["", "The length prior's weight (complete mode, batch 16; 0 is no prior):", "",
              "| model | schema | weight | valid | accuracy (JSON) | TPF | TPF vs unconstrained "
              "| NFE | useful tokens | first output |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sweep:
        b = base[r["model"]]
        lines.append(f"| {r['model']} | {r['schema']} | {r['weight']:g} | {r['valid']:.0%} | "
                     f"{r['acc_json']:.0%} | {r['tpf']:.2f} | {r['tpf'] / b['tpf']:.2f}x | "
                     f"{r['nfe']:.1f} | {r['useful']:.1f} | `{_shown(r['example'])}` |")
    Path(args.out).write_text("\n".join(lines) + "\n")


def _shown(text: str) -> str:
    """An output in a table cell: pipes escaped, newlines shown as \\n."""
    return text.replace("|", "\\|").replace("\n", "\\n")


if __name__ == "__main__":
    sys.exit(main())
