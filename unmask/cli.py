"""The `unmask` command line: generate, chat, eval, bench, train, serve, bench-serve, trace,
models, show.

Exit codes: 0 success; 2 the caller's input is wrong (an `UnmaskError`: bad spec, bad model
folder, bad lengths, empty or undecodable prompt, unusable device or output path, or an argparse
usage error), printed as one line on stderr naming the problem and what is valid; 130
interrupted. Anything else is a bug in unmask: Python prints its traceback and exits with 1.

Only argparse and the torch-free argument modules are imported to build the parser, so
`unmask --help` answers without loading torch; each command imports what it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator

from unmask.cli_args import (
    add_decode_arguments,
    add_format_arguments,
    add_graph_arguments,
    add_model_arguments,
    add_prefix_arguments,
    chat_for,
    check_decoder,
    check_prompts,
    decoder_for,
    load_llm,
    response_format_of,
)
from unmask.errors import UnmaskError

EXIT_CODES = """\
exit codes:
  0    success
  1    a bug in unmask (the traceback is printed; please report it)
  2    bad input: one line on stderr says what is wrong and what is valid
  130  interrupted (Ctrl-C)"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the promise of this module), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"unmask: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def cmd_generate(args: argparse.Namespace) -> int:
    check_decoder(args.decoder, args)  # before the load: a bad spec fails at once
    check_prompts(args.prompts)
    fmt = response_format_of(args)  # before the load too: a bad schema or regex fails at once
    llm = load_llm(args)
    params = decoder_for(args.decoder, args, llm)
    with decode_progress(len(args.prompts) * params.gen_length) as on_event:
        outs = llm.generate(args.prompts, params, chat=chat_for(llm, args.raw), on_event=on_event,
                            response_format=fmt)
    several = len(outs) > 1
    for i, (prompt, g) in enumerate(zip(args.prompts, outs, strict=True), 1):
        if args.json:
            print(json.dumps(g.to_dict()))
            continue
        if several:  # a header per answer: answers are free text, often several lines each
            if i > 1:
                print()
            print(f"=== [{i}/{len(outs)}] {prompt.strip()}")
        print(g.text)
        print(f"[{params.spec} | NFE {g.nfe} | TPF {g.tpf:.2f} | {g.tps:.1f} tokens/s | "
              f"{g.seconds:.2f} s]", file=sys.stderr)
    return 0


@contextlib.contextmanager
def decode_progress(total: int) -> Iterator[Callable | None]:
    """A progress bar of committed positions on stderr when it is a terminal (stdout stays clean
    for pipes and --json); yields the engine-event callback, or None when there is no terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TextColumn("positions"),
               TextColumn("NFE {task.fields[nfe]}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("decode", total=total, nfe=0)
        nfe: dict[str, int] = {}

        def on_event(ev) -> None:
            nfe[ev.request_id] = ev.nfe
            bar.update(task, advance=len(ev.positions), nfe=sum(nfe.values()))

        yield on_event


def build_parser() -> argparse.ArgumentParser:
    from unmask.bench.cli import add_bench_arguments, add_eval_arguments
    from unmask.bench.serve import add_bench_serve_arguments
    from unmask.catalog import add_models_arguments
    from unmask.chat import add_chat_arguments
    from unmask.server.run import add_serve_arguments
    from unmask.show import add_show_arguments
    from unmask.trace import add_trace_arguments
    from unmask.training.args import add_train_arguments

    p = _Parser(prog="unmask", description="Fast, exact inference for diffusion LMs.",
                epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    g = sub.add_parser("generate", help="generate text for one or more prompts", epilog=EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("prompts", nargs="+", metavar="PROMPT",
                   help="one or more prompts; with several, each answer gets a '=== [i/n] PROMPT' "
                        "header line")
    add_model_arguments(g)
    add_prefix_arguments(g)
    add_graph_arguments(g)
    add_decode_arguments(g)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_format_arguments(g)
    g.set_defaults(func=cmd_generate)

    # (name, help, adds the arguments, module and function that run it, returns an exit code)
    lazy_commands = [
        ("eval", "accuracy of a decoder on a task's held-out set", add_eval_arguments,
         "unmask.bench.cli", "run_eval", True),
        ("bench", "decoders side by side: accuracy, speed, cost, plot", add_bench_arguments,
         "unmask.bench.cli", "run_bench", True),
        ("train", "train a small LLaDA- or SDAR-format model (the shipped ones)", add_train_arguments,
         "unmask.training.train", "run_train", False),
        ("serve", "OpenAI-compatible HTTP server (needs unmask[serve])", add_serve_arguments,
         "unmask.server.run", "run_serve", True),
        ("trace", "record a decode step by step: HTML replay, GIF or PNG", add_trace_arguments,
         "unmask.trace", "run_trace", True),
        ("bench-serve", "load a running server: throughput, TTFT, latency percentiles (needs "
         "httpx)", add_bench_serve_arguments, "unmask.bench.serve", "run_bench_serve", True),
        ("models", "the models this machine has: embedded, hub cache, --dir / $UNMASK_MODELS",
         add_models_arguments, "unmask.catalog", "run_models", True),
        ("chat", "a multi-turn chat with a model, answers streamed as they are committed",
         add_chat_arguments, "unmask.chat", "run_chat", True),
        ("show", "a model's architecture, parameters, tokens, and whether it fits in memory",
         add_show_arguments, "unmask.show", "run_show", True),
    ]
    for name, help_, add_arguments, module, function, returns_code in lazy_commands:
        c = sub.add_parser(name, help=help_, epilog=EXIT_CODES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(c)
        c.set_defaults(func=_lazy(module, function, returns_code=returns_code))
    return p


def _lazy(module: str, name: str, returns_code: bool = True) -> Callable[[argparse.Namespace], int]:
    """A command that imports ``module`` (and with it torch) only when it runs."""

    def go(args: argparse.Namespace) -> int:
        import importlib

        result = getattr(importlib.import_module(module), name)(args)
        return int(result or 0) if returns_code else 0
    return go


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except UnmaskError as e:
        print(f"unmask: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
