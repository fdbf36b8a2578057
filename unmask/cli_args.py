"""The command line's shared arguments and checks: model and decoder flags, prompt checks.

Imported by the commands that add them (generate in cli.py; bench, eval, serve, bench-serve and
trace in their own modules), so those modules never import `unmask.cli`, the command that imports
them. Torch-free: building the parser must not load torch (`unmask --help` answers at once).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unmask.decoding.params import (
    BLOCK_KEYS,  # noqa: F401  (the commands' name for it)
    DEFAULT_DECODER,
    METHODS,
    PRESETS,
    DecodeParams,
    check_before_model,
)
from unmask.errors import InputError, SpecError

if TYPE_CHECKING:
    from unmask.api import LLM

DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda when this torch has it, else cpu)"


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint folder, or a Hugging Face hub id org/name (downloaded into "
                        "the hub cache on first use; default: the embedded model)")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights/compute dtype (default: the config's torch_dtype)")
    p.add_argument("--threads", type=positive, default=None,
                   help="torch CPU threads (default: one per physical core, one for a model under "
                        "10M parameters; docs/cli.md, \"Threads\")")
    p.add_argument("--quantize", default=None, metavar="int8|int4|w8a8",
                   help="quantization of the transformer blocks' linear layers at load: int8, "
                        "int4 weight-only with torchao (needs unmask[quant]); w8a8 int8 weights "
                        "and activations on the CPU (oneDNN; default: none)")
    p.add_argument("--compile", action="store_true",
                   help="compile the model's layers with torch.compile, after --quantize "
                        "(docs/checkpoints.md, \"Compiled layers\")")
    p.add_argument("--verbose", action="store_true",
                   help="say on stderr how the model is run: threads chosen and why")


def gib(text: str) -> float:
    """A memory budget in GiB: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not 0 < value < float("inf"):  # NaN fails both
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text}")
    return value


def add_prefix_arguments(p: argparse.ArgumentParser) -> None:
    """Prefix reuse across requests (docs/engine.md, "Prefix reuse"): commands whose requests
    may share prompts (generate, chat, serve). Others (bench, eval) run without it."""
    p.add_argument("--prefix-cache-gib", type=gib, default=None, metavar="GIB",
                   help="memory for the K/V of finished blocks that later requests starting "
                        "with the same tokens reuse (block-causal models; default: 10%% of the "
                        "memory free after loading)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="recompute every prompt from scratch (no reuse across requests)")


# unmask.engine.graphs.MODES, spelled here too: that module loads torch, which `unmask --help`
# must not (tests/test_cuda_graphs_doors.py checks they agree)
CUDA_GRAPH_MODES = ("auto", "on", "off")


def add_graph_arguments(p: argparse.ArgumentParser) -> None:
    """CUDA graphs (docs/engine.md, "CUDA graphs"): the commands that run an engine for long
    (generate, serve)."""
    p.add_argument("--cuda-graphs", choices=CUDA_GRAPH_MODES, default="auto",
                   help="replay one CUDA graph per shape bucket of a block-causal model's calls "
                        "(auto: where they can run, a CUDA device; on: refuse to start where "
                        "they cannot; default: auto)")


def load_llm(args: argparse.Namespace) -> LLM:
    """The model the arguments of add_model_arguments name, run on --threads CPU threads, else
    on unmask.api.default_threads' choice; with --quantize, a note on stderr says what its
    weights hold before and after, with --verbose, one says the threads and why."""
    from unmask.api import LLM, default_threads, set_threads

    if args.threads is not None:  # before the load: a count this machine cannot run fails at once
        set_threads(args.threads)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize,
              compile=args.compile, prefix_cache=getattr(args, "prefix_cache", False),
              prefix_cache_gib=getattr(args, "prefix_cache_gib", None),
              cuda_graphs=getattr(args, "cuda_graphs", "auto"))
    if args.threads is None:
        n, why = default_threads(sum(p.numel() for p in llm.model.parameters()))
        set_threads(n)
    else:
        n, why = args.threads, "--threads"
    if args.quantize is not None:
        memory = "" if llm.load_memory is None else f"; {llm.load_memory.note()}"
        print(f"note: {llm.load_note}{memory}", file=sys.stderr)
    if args.compile:  # the first calls compile, in silence, before any token (unmask/compiling.py)
        print("note: --compile: compiling the model's layers on their first calls (15-30 s on a "
              "CPU) before the first tokens; later calls reuse the compiled code", file=sys.stderr)
    if args.verbose:
        print(f"note: {n} CPU thread(s): {why}", file=sys.stderr)
    return llm


def decoder_names() -> str:
    """The spec grammar's names, from the registry the parser itself uses."""
    return f"methods {', '.join(METHODS)}; presets {', '.join(PRESETS)}"


def add_decode_arguments(p: argparse.ArgumentParser, default: str = DEFAULT_DECODER) -> None:
    p.add_argument("--decoder", default=default,
                   help=f"decoder spec NAME[,key=value]* (default: {default}); NAME is one of the "
                        f"{decoder_names()}; keys in docs/decoders.md")
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
    with _naming(spec):
        return DecodeParams.parse(spec, explicit=_typed(args), **defaults)


def _typed(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key) for key in DECODER_FLAGS if getattr(args, key, None) is not None}


@contextlib.contextmanager
def _naming(spec: str) -> Iterator[None]:
    """A spec error names the --decoder it is about (a command may take several)."""
    try:
        yield
    except SpecError as e:
        raise type(e)(f"--decoder {spec!r}: {e}", e.key) from None


def check_decoder(spec: str, args: argparse.Namespace, **defaults: Any) -> None:
    """`parse_decoder`'s refusal of a spec before the model loads (a bad spec fails at once),
    but for the errors the model's block size may resolve (`params.check_before_model`)."""
    with _naming(spec):
        check_before_model(spec, _typed(args), **defaults)


def decoder_for(spec: str, args: argparse.Namespace, llm: LLM, **defaults: Any) -> DecodeParams:
    """`parse_decoder` for the loaded model (with its own keys under the spec's: a block-causal
    model's blocks and cache, unmask.engine.layout.model_defaults), checked against it
    (`fit_to_model`): the one check of a command's decoder against its model, made once before
    anything is decoded (generate, chat, serve, trace)."""
    from unmask.engine.layout import model_defaults

    params = parse_decoder(spec, args, **{**defaults, **model_defaults(llm.model)})
    return fit_to_model(spec, params, llm)


def fit_to_model(spec: str, params: DecodeParams, llm: LLM) -> DecodeParams:
    """`params` (parsed from --decoder `spec`) as the loaded model decodes them, or the
    DecoderMismatch naming the key that cannot apply (unmask.engine.layout.for_model)."""
    from unmask.engine.layout import for_model

    with _naming(spec):
        return for_model(params, llm.model)


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


def add_format_arguments(p: argparse.ArgumentParser) -> None:
    """Structured output: --json-schema or --regex, and --grammar-mode."""
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE|JSON",
                       help="every answer is JSON valid against this schema (a file, or the "
                            "schema itself)")
    shape.add_argument("--regex", metavar="PATTERN",
                       help="every answer matches this regular expression in full")
    p.add_argument("--grammar-mode", choices=["complete", "prefix"], default="complete",
                   help="how --json-schema / --regex constrain the canvas: complete (slots in "
                        "any order, the canvas kept completable) or prefix (the "
                        "longest-valid-prefix baseline, left to right)")
    p.add_argument("--length-penalty", type=float, metavar="W", default=None,
                   help="the length prior's weight: an allowed token loses W in log-weight per "
                        "slot it pushes the end of the shortest word (default: 2 with "
                        "--json-schema, 0 with --regex; 0 turns it off)")


def response_format_of(args: argparse.Namespace):
    """The structured output --json-schema (a file, or the schema's JSON) or --regex asks for,
    in --grammar-mode, with --length-penalty's weight; None without either."""
    from unmask.decoding.grammar import with_prior

    return with_prior(_format_of(args), args.length_penalty)


def _format_of(args: argparse.Namespace):
    from unmask.decoding.grammar import GrammarError, ResponseFormat

    if args.regex is not None:
        return ResponseFormat.regex(args.regex, args.grammar_mode)
    if args.json_schema is None:
        return None
    text = args.json_schema
    if not text.lstrip().startswith("{"):
        try:
            text = Path(text).read_text()
        except OSError as e:
            raise GrammarError(f"--json-schema {args.json_schema!r}: neither a JSON object nor a "
                               f"readable file ({e.strerror})") from None
    return ResponseFormat.json_schema(text, args.grammar_mode)
