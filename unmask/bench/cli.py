"""`unmask bench` (decoders side by side) and `unmask eval` (one decoder's accuracy).

Both go through :func:`measure`: load the task and model, run the decoders interleaved with a
rich progress bar, reduce to metrics. eval is the one-decoder, no-warm-up case.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unmask.cli_args import (
    BLOCK_KEYS,
    add_length_arguments,
    add_model_arguments,
    chat_for,
    fit_to_model,
    load_llm,
    parse_decoder,
    positive,
)
from unmask.decoding.params import DecodeParams, same_decoder
from unmask.errors import InputError, SpecError

if TYPE_CHECKING:
    from unmask.bench.runner import Sample
    from unmask.bench.tasks import BenchTask

DEFAULT_GEN_LENGTH = 256
DEFAULT_BLOCK_LENGTH = 32
DEFAULT_SEED = 0


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_common(p: argparse.ArgumentParser, n_default: int, batch_default: int) -> None:
    add_model_arguments(p)
    p.add_argument("--task", default=None,
                   help="math, math-strata, code, gsm8k:PATH or humaneval (see --list-tasks)")
    p.add_argument("--stratify", action="store_true",
                   help="also report accuracy per difficulty bucket (math; math-strata always "
                        "does): operand digits 1-2, 3, 4, sum_list, sort")
    p.add_argument("--list-tasks", action="store_true", help="list the tasks and exit")
    p.add_argument("--n", type=positive, default=n_default,
                   help=f"number of prompts (default: {n_default})")
    add_length_arguments(p, DEFAULT_GEN_LENGTH, DEFAULT_BLOCK_LENGTH)
    p.add_argument("--batch-size", type=positive, default=batch_default,
                   help=f"prompts per model call (default: {batch_default})")
    p.add_argument("--seed", type=int, default=None,
                   help=f"selects the task's prompts and the decoders' sampling seed (default: "
                        f"{DEFAULT_SEED}; a spec's own seed key then sets its sampling seed, and "
                        f"one that disagrees with a typed --seed is an error)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--samples", default=None, metavar="FILE",
                   help="write each decoder's output for each prompt as JSON lines (prompt, "
                        "text, correct, useful tokens): what a score alone cannot show")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="allow tasks that execute generated code (humaneval)")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p, n_default=20, batch_default=1)
    p.add_argument("--decoder", action="append", default=None, metavar="SPEC",
                   help="decoder spec NAME[,key=value]*; repeat for each decoder; the first is "
                        "the baseline for speedup and exact-match")
    p.add_argument("--warmup", type=_non_negative, default=1,
                   help="prompts each decoder decodes untimed before measuring (default: 1)")
    p.add_argument("--plot", default=None, metavar="FILE", help="speedup-vs-accuracy plot (PNG)")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="write a BENCHMARKS.md section: header, command line, table")


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p, n_default=100, batch_default=8)
    p.add_argument("--decoder", default="static-1", metavar="SPEC",
                   help="decoder spec NAME[,key=value]* (default: static-1)")


# --------------------------------------------------------------------------- shared core


def _print_tasks() -> int:
    from unmask.bench.tasks import list_tasks

    width = max(len(name) for name, _ in list_tasks())
    for name, help_ in list_tasks():
        print(f"{name.ljust(width)}  {help_}")
    return 0


def _parse_decoders(specs: list[str], args: argparse.Namespace,
                    model: dict[str, Any] | None = None) -> list[DecodeParams]:
    """The decoders of `specs`, the command's defaults under them; model: the loaded model's
    (unmask.engine.layout.model_defaults: a block-causal model's blocks and cache)."""
    defaults = {"gen_length": DEFAULT_GEN_LENGTH, "block_length": DEFAULT_BLOCK_LENGTH,
                "seed": DEFAULT_SEED, **(model or {})}
    decoders = [parse_decoder(s, args, **defaults) for s in specs]
    for i, d in enumerate(decoders):  # a repeat is a row measured twice under two names
        first = next(j for j, e in enumerate(decoders) if same_decoder(d, e))
        if first < i:
            also = "" if specs[first] == specs[i] else f" (as {specs[first]!r}: the same parameters)"
            raise InputError(f"--decoder {specs[i]!r} is given twice{also}; each is one row of "
                             f"the table")
    lengths = {d.gen_length for d in decoders}
    if len(lengths) > 1:
        # Outputs of different lengths are never token-identical, and TPS over different
        # canvases is not a like-for-like comparison.
        raise InputError(f"all decoders must share one gen_length; got {sorted(lengths)}")
    return decoders


def prompt_seed(args: argparse.Namespace) -> int:
    """The seed that selects the task's prompts (a decoder's sampling seed can differ: its spec's)."""
    return DEFAULT_SEED if args.seed is None else args.seed


def shared(decoders: list[DecodeParams], key: str) -> Any:
    """The value of ``key`` that every decoder has, or None when they differ."""
    values = {getattr(d, key) for d in decoders}
    return values.pop() if len(values) == 1 else None


def command_line(args: argparse.Namespace, command: str, specs: list[str],
                 model_keys: dict[str, Any] | None = None) -> str:
    """The canonical command that reproduces these measurements (output files left out);
    model_keys: the decoder keys the model set (`measure`'s doc["model_keys"])."""
    argv = ["unmask", command]
    if args.model:
        argv += ["--model", str(args.model)]
    for flag in ("device", "dtype", "quantize"):
        if getattr(args, flag):
            argv += [f"--{flag}", getattr(args, flag)]
    if args.compile:
        argv.append("--compile")
    argv += ["--task", args.task]
    for s in specs:
        argv += ["--decoder", s]
    # A flag's value goes in only when every decoder used it: then it agrees with any spec that
    # sets the key too. When they differ, no flag was typed (it would have been explicit for all),
    # so leaving it out reproduces the run: each spec's own value, else the command's default.
    decoders = _parse_decoders(specs, args, model_keys)
    argv += ["--n", str(args.n), "--gen-length", str(decoders[0].gen_length)]
    # a block-causal model's own block length needs no flag (any other is refused)
    if shared(decoders, "block_length") is not None and "block_length" not in (model_keys or {}):
        argv += ["--block-length", str(shared(decoders, "block_length"))]
    argv += ["--batch-size", str(args.batch_size)]
    if shared(decoders, "seed") == prompt_seed(args):  # --seed sets the prompts' seed as well
        argv += ["--seed", str(prompt_seed(args))]
    if command == "bench":
        argv += ["--warmup", str(args.warmup)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.allow_code_execution:
        argv += ["--allow-code-execution"]
    if getattr(args, "stratify", False):
        argv += ["--stratify"]
    return shlex.join(argv)


def measure(args: argparse.Namespace, specs: list[str], warmup: int,
            ) -> tuple[dict[str, Any], str]:
    """Run ``specs`` side by side as the arguments say; (JSON document, metric name)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from unmask.bench.report import machine_info
    from unmask.bench.runner import early_exit_baseline, reference_indices, run_side_by_side, summarize
    from unmask.bench.tasks import load_task

    if not args.task:
        raise InputError("--task is required (see --list-tasks)")
    try:  # before loading anything: a bad spec fails fast
        _parse_decoders(specs, args)
    except SpecError as e:  # but for what a block model's own block size may resolve
        if e.key not in BLOCK_KEYS:
            raise
    task = load_task(args.task, args.n, seed=prompt_seed(args),
                     allow_code_execution=args.allow_code_execution,
                     stratify=getattr(args, "stratify", False))
    llm = load_llm(args)
    from unmask.engine.layout import model_defaults

    model_keys = model_defaults(llm.model)
    decoders = [fit_to_model(s, d, llm)
                for s, d in zip(specs, _parse_decoders(specs, args, model_keys), strict=True)]
    chat = chat_for(llm, raw=False, raw_flag=None)

    total = len(task.examples) * len(decoders)
    started = time.perf_counter()
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[spec]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=console, transient=False) as progress:
        bar = progress.add_task(f"{args.task}", total=total, spec="warm-up")
        samples = run_side_by_side(
            llm, task, decoders, batch_size=args.batch_size, warmup=warmup, chat=chat,
            on_progress=lambda done, spec: progress.update(bar, completed=done, spec=spec))

    wall = time.perf_counter() - started
    if args.samples:
        _write_samples(args.samples, task, decoders, samples)
    refs = reference_indices(decoders)
    results = [{"decoder": d.spec, **m, "reference": None if r is None else decoders[r].spec,
                "block_length": d.block_length, "seed": d.seed}
               for d, m, r in zip(decoders, summarize(samples, references=refs,
                                                      early_exit=early_exit_baseline(decoders)),
                                  refs, strict=True)]
    if task.stratified:
        from unmask.bench.strata import stratify

        per = stratify([e.stratum for e in task.examples],
                       [[s.correct for s in runs] for runs in samples],
                       [[s.tps for s in runs] for runs in samples])
        for r, st in zip(results, per, strict=True):
            r["strata"] = st
    doc = {
        "machine": machine_info(llm.device),
        "model": str(args.model) if args.model else "embedded default model",
        "weights": llm.load_note,
        "task": args.task,
        "gen_length": decoders[0].gen_length,
        "block_length": shared(decoders, "block_length"),  # None: per decoder, in its result
        "model_keys": model_keys,  # decoder keys the model sets (a block model's blocks, cache)
        "batch_size": args.batch_size,
        "seed": prompt_seed(args),  # the prompts'; each result has its decoder's sampling seed
        "metric": task.metric,
        "wall_seconds": wall,  # the whole run, warm-up included
        "results": results,
    }
    return doc, task.metric


def check_output_path(path: str, flag: str) -> None:
    """Fail before a run, not after it: ``path``'s folder exists and ``path`` can be written.
    Nothing is created: a file this check makes to prove it can is removed again."""
    out = Path(path)
    # A symbolic link is written through: check (and clean up) where it points, never the link
    # itself (a dangling link's target was created, then the user's link was removed).
    if out.is_symlink():
        out = out.resolve()
    parent = out.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise InputError(f"{flag} {path}: the folder {parent} {what}; create it first")
    if out.is_dir():
        raise InputError(f"{flag} {path} is a folder; give a file name")
    existed = out.exists()
    try:
        with out.open("a"):
            pass
    except OSError as e:
        raise InputError(f"{flag} {path} cannot be written: {e.strerror or e}") from None
    if not existed:
        os.unlink(out)


def check_outputs(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    """Every output file the arguments name (``--plot`` also by its extension), before the run.
    ``--plot`` is checked as the file matplotlib writes (``out`` is written as ``out.png``)."""
    given = [(f, getattr(args, f)) for f in flags if getattr(args, f, None) is not None]
    written: list[str] = []
    for flag, path in given:
        if not str(path).strip():  # `--json ""` (an unset shell variable) must not skip the output
            raise InputError(f"--{flag} needs a file name, got an empty string")
        target = str(path)
        if flag == "plot":
            from unmask.bench.plot import plot_formats, plot_path

            ext = Path(target).suffix.lower().lstrip(".")
            if ext and ext not in plot_formats():
                raise InputError(f"--plot {path}: matplotlib cannot write .{ext} files; valid: "
                                 f"{', '.join(plot_formats())}")
            target = plot_path(target)
        check_output_path(target, f"--{flag}")
        written.append(target)
    paths = [os.path.realpath(p) for p in written]
    if len(set(paths)) < len(paths):
        raise InputError("two output flags name the same file: " + ", ".join(
            f"--{f} {p}" + (f" (written as {w})" if str(p) != w else "")
            for (f, p), w in zip(given, written, strict=True)))


def _write_samples(path: str, task: BenchTask, decoders: list[DecodeParams],
                   samples: list[list[Sample]]) -> None:
    """One JSON line per (decoder, prompt), in the order the score was computed from."""
    with Path(path).open("w") as f:
        for d, runs in zip(decoders, samples, strict=True):
            for i, (ex, s) in enumerate(zip(task.examples, runs, strict=True)):
                f.write(json.dumps({"decoder": d.spec, "index": i, "prompt": ex.prompt,
                                    "stratum": ex.stratum, "text": s.text, "correct": s.correct,
                                    "useful_tokens": s.useful,
                                    "nfe": s.nfe, "tps": s.tps, "seconds": s.seconds}) + "\n")


def _write_json(path: str, doc: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


# --------------------------------------------------------------------------- commands


def run_bench(args: argparse.Namespace) -> int:
    from unmask.bench.report import METRIC_LABELS, markdown_section, markdown_table

    if args.list_tasks:
        return _print_tasks()
    if not args.decoder:
        raise InputError("give at least one --decoder SPEC (the first is the baseline)")
    check_outputs(args, ("json", "samples", "markdown", "plot"))
    doc, metric = measure(args, args.decoder, warmup=args.warmup)
    cmd = command_line(args, "bench", args.decoder, doc["model_keys"])
    doc["command"] = cmd
    print(markdown_table(doc["results"], metric))
    if doc["results"][0].get("strata"):
        from unmask.bench.strata import strata_tables

        print("\n" + strata_tables(doc["results"]))
    sys.stdout.flush()
    if args.json:
        _write_json(args.json, doc)
    if args.markdown:
        Path(args.markdown).write_text(markdown_section(doc, cmd, metric))
    if args.plot:
        from unmask.bench.plot import plot_speedup_accuracy

        n = doc["results"][0]["n"]
        plot_speedup_accuracy(doc["results"], args.plot,
                              title=f"{doc['task']}, gen_length {doc['gen_length']}, n {n} — "
                                    f"{doc['model']}",
                              metric_label=METRIC_LABELS.get(metric, metric))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from unmask.bench.report import METRIC_LABELS

    if args.list_tasks:
        return _print_tasks()
    check_outputs(args, ("json", "samples"))
    doc, metric = measure(args, [args.decoder], warmup=0)
    doc["command"] = command_line(args, "eval", [args.decoder], doc["model_keys"])
    r = doc["results"][0]
    correct = round(r["accuracy"] * r["n"])
    print(f"{doc['task']} {METRIC_LABELS.get(metric, metric)}: {100 * r['accuracy']:.1f}% "
          f"({correct}/{r['n']}) | {r['decoder']} | gen_length {doc['gen_length']} | "
          f"{r['useful_tokens']:.1f} tokens per answer | NFE {r['nfe']:.1f} | "
          f"TPF {r['tpf']:.2f} | {doc['wall_seconds']:.1f} s")
    if r.get("strata"):
        from unmask.bench.strata import eval_strata_lines

        print("\n".join(eval_strata_lines(r["strata"])))
    if args.json:
        _write_json(args.json, doc)
    return 0
