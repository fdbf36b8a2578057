"""`unmask train`'s arguments and canvas buckets: no torch here, so `unmask --help` stays fast.

`unmask.training.train` re-exports everything in this module.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass

from unmask.errors import InputError


@dataclass(frozen=True)
class CanvasBucket:
    """Canvas lengths drawn uniformly from [lo, hi] with probability ``weight``.

    A ``tight`` bucket instead sizes the canvas to the batch: the longest response plus
    U[lo, hi] extra EOS positions.
    """

    lo: int
    hi: int
    weight: float
    tight: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.lo <= self.hi or self.weight < 0:
            raise InputError(f"bad canvas bucket {self}: want 0 <= lo <= hi and weight >= 0")


# Mostly tight (where the answers are) but reaching 1024 so gen_length 256/512/1024 all work.
DEFAULT_BUCKETS = (CanvasBucket(0, 16, 0.65, tight=True), CanvasBucket(100, 320, 0.20),
                   CanvasBucket(321, 1024, 0.15))
# What the shipped model (first run) was trained with: `--buckets 56-144:0.6,145-384:0.27,385-1024:0.13`.


def parse_buckets(spec: str) -> tuple[CanvasBucket, ...]:
    """``LO-HI:WEIGHT[,...]``; prefix ``tight:`` for extra EOS after the batch's longest answer,
    e.g. ``tight:0-16:0.65,100-320:0.2,321-1024:0.15`` (the default)."""
    out = []
    for part in spec.split(","):
        fields = part.strip().split(":")
        tight = fields[0] == "tight"
        try:
            lo_hi, weight = fields[1:] if tight else fields
            lo, hi = (int(v) for v in lo_hi.split("-"))
            out.append(CanvasBucket(lo, hi, float(weight), tight=tight))
        except ValueError as e:
            raise InputError(f"bad canvas bucket {part!r} in {spec!r}: want [tight:]LO-HI:WEIGHT "
                             f"({e})") from e
    if not any(not b.tight for b in out):
        raise InputError(f"{spec!r}: at least one fixed LO-HI bucket is needed (it caps answer length)")
    if not sum(b.weight for b in out) > 0:
        raise InputError(f"{spec!r}: the bucket weights sum to 0; at least one must be positive")
    return tuple(out)


def longest_canvas(buckets: tuple[CanvasBucket, ...]) -> int:
    """The most response positions a batch can have: a tight batch's longest answer is capped by
    the longest fixed canvas, and gets up to its bucket's hi extra EOS."""
    fixed = max(b.hi for b in buckets if not b.tight)
    return fixed + max((b.hi for b in buckets if b.tight), default=0)


DEFAULT_VOCAB = 2048  # of a tokenizer trained by the run (--vocab-size)
MAX_ROWS = 128  # rows of one batch (DataStream.max_batch)
MAX_PROMPT = 512  # tokens of the longest prompt trained on (code prompts are cut there)
# flag -> (whether a value is valid, what is valid); run before anything is built or written.
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "vocab_size": (lambda v: 261 <= v <= 1 << 20,
                   "an integer in 261..1048576 (256 byte tokens and 5 special tokens come first)"),
    "max_seq_len": (lambda v: v >= 1, "an integer >= 1"),
    "max_steps": (lambda v: v >= 0, "an integer >= 0"),
    "batch_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "lr": (lambda v: v > 0, "a number > 0"),
    "warmup": (lambda v: 0 <= v < 1, "a fraction of progress in [0, 1)"),
    "weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "grad_clip": (lambda v: v > 0, "a number > 0 (the gradient norm is clipped to it)"),
    "code_frac": (lambda v: 0 <= v <= 1, "a share of batches in [0, 1]"),
    "code_max_tokens": (lambda v: v >= 0, "an integer >= 0"),
    "pad_weight": (lambda v: v >= 0, "a number >= 0"),
    "digit_weight": (lambda v: v >= 0, "a number >= 0"),
    "semi_ar": (lambda v: 0 <= v <= 1, "a share of rows in [0, 1]"),
    "block_size": (lambda v: v >= 1, "an integer >= 1"),
    "time_budget_min": (lambda v: v > 0, "a number of minutes > 0"),
    "eval_every": (lambda v: v >= 1, "an integer >= 1"),
    "eval_batches": (lambda v: v >= 1, "an integer >= 1"),
    "solve_every": (lambda v: v >= 0, "an integer >= 0 (0: never)"),
    "solve_n": (lambda v: v >= 0, "an integer >= 0"),
    "ckpt_minutes": (lambda v: v >= 0, "a number of minutes >= 0"),
    "log_every": (lambda v: v >= 1, "an integer >= 1"),
    "seed": (lambda v: 0 <= v < 1 << 63, "an integer in 0..2**63-1"),
}


def check_train_args(args: argparse.Namespace) -> None:
    """Refuse flag values that would crash, hang or silently train nonsense, naming the flag and
    what is valid; the model's sizes are ModelConfig's to check."""
    _family_defaults(args)
    for name, (ok, valid) in _RANGES.items():
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise InputError(f"--{name.replace('_', '-')} must be {valid}, got {value}")
    if args.max_steps == 0 and not args.init and not args.resume:
        # 0 steps exports the starting weights as they are: without --init (or a run to resume)
        # those are the random initialisation, exported as if it were a model.
        raise InputError("--max-steps 0 only exports the starting weights: give --init MODEL_DIR "
                         "(or --resume a run), or --max-steps >= 1")
    if args.threads != "auto" and not (args.threads.isdigit() and int(args.threads) >= 1):
        raise InputError(f"--threads must be 'auto' or an integer >= 1, got {args.threads!r}")
    canvas = longest_canvas(args.buckets)
    if canvas > args.max_seq_len:
        raise InputError(f"--buckets reach canvases of {canvas} positions, longer than --max-seq-len "
                         f"{args.max_seq_len}: the model would be trained past its length")
    # A batch holds at most MAX_ROWS rows, so more tokens only pile up unused examples.
    most = MAX_ROWS * (MAX_PROMPT + canvas)
    if args.batch_tokens > most:
        raise InputError(f"--batch-tokens must be at most {most} with these --buckets ({MAX_ROWS} "
                         f"rows of up to {MAX_PROMPT} + {canvas} tokens), got {args.batch_tokens}")


BLOCK_SIZE = 4  # SDAR's: the block_size of JetAstra/SDAR's published SDAR-*-Chat configs
FAMILY_DEFAULTS = {"llada": {"semi_ar": 0.5, "block_size": None},
                   "sdar": {"semi_ar": 0.0, "block_size": BLOCK_SIZE}}


def _family_defaults(args: argparse.Namespace) -> None:
    """Flags whose default depends on --model-type get it; args.json records the value used."""
    if args.model_type not in FAMILY_DEFAULTS:
        raise InputError(f"--model-type must be one of {', '.join(FAMILY_DEFAULTS)}, "
                         f"got {args.model_type!r}")
    if args.model_type != "sdar" and args.block_size is not None:
        raise InputError(f"--block-size is for block-diffusion models (--model-type sdar); "
                         f"{args.model_type} is bidirectional")
    if args.model_type == "sdar" and args.semi_ar:
        raise InputError(f"--semi-ar {args.semi_ar} is for llada: block diffusion already trains "
                         "every block behind its clean prefix; leave --semi-ar out")
    for name, value in FAMILY_DEFAULTS[args.model_type].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _buckets_arg(spec: str) -> tuple[CanvasBucket, ...]:
    """parse_buckets for argparse, which prints an ArgumentTypeError's message as it is."""
    try:
        return parse_buckets(spec)
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class DefaultsShown(argparse.RawDescriptionHelpFormatter):
    """--help names every flag's default (`--out` wrote to runs/default unannounced), unless its
    help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
        return f"{text} (default: %(default)s)" if shown and "default" not in text else text


def add_train_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.formatter_class = DefaultsShown
    g = p.add_argument_group("run")
    g.add_argument("--out", default="runs/default", help="run folder (checkpoints, logs)")
    g.add_argument("--resume", action="store_true",
                   help="continue from OUT/state.pt (required when OUT already holds a run; "
                        "refused when it holds none)")
    g.add_argument("--init", default=None,
                   help="start from the weights of this model folder (same architecture and tokenizer)")
    g.add_argument("--export", default=None, help="also write the final model folder here")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the weights' initialisation, the data order and the masks")
    g.add_argument("--device", default="auto",
                   help="auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    g.add_argument("--threads", default="auto",
                   help="torch CPU threads, or 'auto': re-measure 1 vs 2 threads every 200 steps "
                        "(on a shared 2-core machine 2 threads ran 4x slower than 1 under contention)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer", default=None,
                   help="folder with tokenizer.json (default: the run's own, trained into "
                        "OUT/tokenizer on its first start)")
    g.add_argument("--train-tokenizer", action="store_true",
                   help="train a tokenizer into --tokenizer's folder when it holds none "
                        "(without this flag such a folder is refused: a mistyped path)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help=f"vocabulary of the tokenizer trained here (default: {DEFAULT_VOCAB}); "
                        "with an existing tokenizer it must be that tokenizer's size")
    g = p.add_argument_group("model")
    g.add_argument("--model-type", default="llada", choices=sorted(FAMILY_DEFAULTS),
                   help="llada: masked diffusion on a bidirectional canvas; sdar: block diffusion "
                        "(block-causal attention, a noisy block beside the clean earlier ones)")
    g.add_argument("--block-size", type=int, default=None,
                   help=f"sdar only: positions per block (default: {BLOCK_SIZE}, SDAR-Chat's)")
    g.add_argument("--d-model", type=int, default=256,
                   help="model width")
    g.add_argument("--n-layers", type=int, default=4,
                   help="transformer blocks")
    g.add_argument("--n-heads", type=int, default=4,
                   help="attention heads")
    g.add_argument("--mlp-hidden", type=int, default=768,
                   help="MLP hidden size")
    g.add_argument("--max-seq-len", type=int, default=2048,
                   help="the model's max_sequence_length (prompt + canvas)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--max-steps", type=int, default=10_000,
                   help="optimizer steps (the schedule's length unless --time-budget-min ends "
                        "it first)")
    g.add_argument("--time-budget-min", type=float, default=None,
                   help="stop (with LR fully decayed) after this many minutes of training")
    g.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batch (B x T)")
    g.add_argument("--lr", type=float, default=1.5e-3,
                   help="peak learning rate (AdamW; cosine decay to a tenth)")
    g.add_argument("--warmup", type=float, default=0.03, help="fraction of progress")
    g.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0,
                   help="gradient norm clip")
    g.add_argument("--code-frac", type=float, default=0.25,
                   help="share of batches of code (the rest math)")
    g.add_argument("--code-max-tokens", type=int, default=0,
                   help="train only on functions whose body is at most this many tokens "
                        "(0: every one that fits the canvas); the held-out split is not cut")
    g.add_argument("--buckets", type=_buckets_arg, default=DEFAULT_BUCKETS,
                   help="canvas lengths per batch, [tight:]LO-HI:WEIGHT,... "
                        "(default tight:0-16:0.65,100-320:0.2,321-1024:0.15)")
    g.add_argument("--pad-weight", type=float, default=0.1,
                   help="loss weight of EOS padding after the answer's own EOS (1 = LLaDA's)")
    g.add_argument("--digit-weight", type=float, default=5.0,
                   help="loss weight of digit tokens in responses (1 = LLaDA's)")
    g.add_argument("--semi-ar", type=float, default=None,
                   help="llada only: share of rows masked as semi-AR decoding sees them: clean "
                        "prefix, masked block, masked rest (0 = LLaDA's uniform masking only; "
                        "default: 0.5, and 0 for sdar)")
    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--eval-every", type=int, default=200, help="steps between held-out losses")
    g.add_argument("--eval-batches", type=int, default=8,
                   help="held-out batches each held-out loss averages")
    g.add_argument("--solve-every", type=int, default=2000,
                   help="steps between decoding --solve-n held-out math problems (0: never)")
    g.add_argument("--solve-n", type=int, default=16,
                   help="held-out math problems (and as many code ones) decoded at --solve-every "
                        "and after the last step")
    g.add_argument("--no-final-eval", action="store_true",
                   help="skip the evaluation after the last step (held-out loss, and decoding "
                        "--solve-n math and code problems: minutes on a CPU); the summary then "
                        "holds the last values measured, null where none were")
    g.add_argument("--ckpt-minutes", type=float, default=5.0,
                   help="minutes between checkpoints (OUT/state.pt, OUT/latest)")
    g.add_argument("--log-every", type=int, default=20,
                   help="steps between progress updates and log lines")
    return p
