"""The `unmask` command line: generate, eval, bench, train, serve, bench-serve.

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
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from unmask.decoding.params import DEFAULT_DECODER, METHODS, PRESETS, DecodeParams
from unmask.errors import InputError, SpecError, UnmaskError

if TYPE_CHECKING:
    from unmask.api import LLM

EXIT_CODES = """\
exit codes:
  0    success
  1    a bug in unmask (the traceback is printed; please report it)
  2    bad input: one line on stderr says what is wrong and what is valid
  130  interrupted (Ctrl-C)"""

DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda when this torch has it, else cpu)"


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the promise of this module), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"unmask: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights/compute dtype (default: the config's torch_dtype)")
    p.add_argument("--threads", type=positive, default=None,
                   help="torch CPU threads (default: torch's choice)")


def decoder_names() -> str:
    """The spec grammar's names, from the registry the parser itself uses."""
    return f"methods {', '.join(METHODS)}; presets {', '.join(PRESETS)}"


def add_decode_arguments(p: argparse.ArgumentParser, default: str = DEFAULT_DECODER) -> None:
    p.add_argument("--decoder", default=default,
                   help=f"decoder spec NAME[,key=value]* (default: {default}); NAME is one of the "
                        f"{decoder_names()}; keys in README")
    add_length_arguments(p)


def add_length_arguments(p: argparse.ArgumentParser, gen_length: int | None = None,
                         block_length: int | None = None) -> None:
    """--gen-length and --block-length, unset by default (see DECODER_FLAGS); their help names
    the command's defaults (None: DecodeParams')."""
    defaults = {f.name: f.default for f in fields(DecodeParams)}
    for flag, key, what, value in (("--gen-length", "gen_length", "generated positions L", gen_length),
                                   ("--block-length", "block_length", "semi-AR block length",
                                    block_length)):
        p.add_argument(flag, type=positive, default=None,
                       help=f"{what} (a spec that also sets {key} must agree; default: the spec's "
                            f"{key}, else {defaults[key] if value is None else value})")


# Flags whose argparse dest is a decoder key. They default to None so that a value the user typed
# can be told from one left unset: typed, it is explicit (a spec key that disagrees is an error,
# as neither may silently lose); unset, the command's own default applies and the spec's keys win.
DECODER_FLAGS = ("gen_length", "block_length", "seed")


def parse_decoder(spec: str, args: argparse.Namespace, **defaults: Any) -> DecodeParams:
    """``spec`` with the command's decoder-key flags (those of DECODER_FLAGS that ``args`` has)
    as explicit values when typed, and ``defaults`` (the command's defaults) under the spec.
    A command whose flag of one of these names is not a decoder key must not pass its args."""
    typed = {key: getattr(args, key) for key in DECODER_FLAGS if getattr(args, key, None) is not None}
    try:
        return DecodeParams.parse(spec, explicit=typed, **defaults)
    except SpecError as e:  # with several --decoder, say which one
        raise SpecError(f"--decoder {spec!r}: {e}") from None


def check_prompts(prompts: list[str]) -> None:
    """Every prompt is non-empty text. A command-line argument that is not valid UTF-8 reaches
    Python with its bad bytes as lone surrogates, which no tokenizer can encode."""
    for i, prompt in enumerate(prompts, 1):
        which = f"prompt {i} of {len(prompts)}" if len(prompts) > 1 else "the prompt"
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raw = prompt.encode("utf-8", "surrogateescape")  # the bytes the shell passed
            shown = raw.decode("utf-8", "backslashreplace").replace("\n", "\\n").replace("\r", "\\r")
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise InputError(f"{which} is not valid UTF-8 (a bad byte at character {e.start}): "
                             f"\"{shown}\"; pass text in UTF-8") from None
        if not prompt.strip():
            raise InputError(f"empty prompt ({which}): give the model something to answer")


def chat_for(llm: LLM, raw: bool, raw_flag: str | None = "--raw") -> bool:
    """Whether a command applies the chat template: unless --raw, when the checkpoint has one.
    Without one (a base model) the prompt goes as written, and stderr says so (raw_flag: the
    command's flag for the raw prompt, None when it has none)."""
    if not raw and not llm.has_chat_template:
        print(f"note: {llm.no_chat_template_note(raw_flag)}", file=sys.stderr)
    return not raw and llm.has_chat_template


def cmd_generate(args: argparse.Namespace) -> int:
    params = parse_decoder(args.decoder, args)
    check_prompts(args.prompts)
    from unmask.api import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    with decode_progress(len(args.prompts) * params.gen_length) as on_event:
        outs = llm.generate(args.prompts, params, chat=chat_for(llm, args.raw), on_event=on_event)
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
    from unmask.server.run import add_serve_arguments
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
    add_decode_arguments(g)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=cmd_generate)

    # (name, help, adds the arguments, module and function that run it, returns an exit code)
    lazy_commands = [
        ("eval", "accuracy of a decoder on a task's held-out set", add_eval_arguments,
         "unmask.bench.cli", "run_eval", True),
        ("bench", "decoders side by side: accuracy, speed, cost, plot", add_bench_arguments,
         "unmask.bench.cli", "run_bench", True),
        ("train", "train a small LLaDA-format model (the embedded model)", add_train_arguments,
         "unmask.training.train", "run_train", False),
        ("serve", "OpenAI-compatible HTTP server (needs unmask[serve])", add_serve_arguments,
         "unmask.server.run", "run_serve", True),
        ("trace", "record a decode step by step: HTML replay, GIF or PNG", add_trace_arguments,
         "unmask.trace", "run_trace", True),
        ("bench-serve", "load a running server: throughput, TTFT, latency percentiles (needs "
         "httpx)", add_bench_serve_arguments, "unmask.bench.serve", "run_bench_serve", True),
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
        if isinstance(getattr(args, "threads", None), int):
            from unmask.api import set_threads

            set_threads(args.threads)
        code = args.func(args)
    except UnmaskError as e:
        print(f"unmask: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
