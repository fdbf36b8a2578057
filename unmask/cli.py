"""The `unmask` command line: generate, eval, bench, train.

Every user error (bad spec, bad model folder, bad lengths, empty prompt) is one line on stderr
naming the problem and the valid range, with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from unmask.checkpoint import CheckpointError
from unmask.config import ConfigError
from unmask.decoding.params import SpecError

USER_ERRORS: tuple[type[Exception], ...] = (SpecError, CheckpointError, ConfigError, ValueError,
                                            FileNotFoundError)


def _positive(text: str) -> int:
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
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights/compute dtype (default: the config's torch_dtype)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch CPU threads (default: torch's choice)")


def add_decode_arguments(p: argparse.ArgumentParser, default: str = "static-1") -> None:
    p.add_argument("--decoder", default=default,
                   help=f"decoder spec NAME[,key=value]* (default: {default}); see README")
    p.add_argument("--gen-length", type=_positive, default=None, help="generated positions L")
    p.add_argument("--block-length", type=_positive, default=None, help="semi-AR block length")


def cmd_generate(args: argparse.Namespace) -> int:
    from unmask.api import LLM
    from unmask.decoding.params import DecodeParams

    params = DecodeParams.parse(args.decoder, gen_length=args.gen_length,
                                block_length=args.block_length)
    for prompt in args.prompts:
        if not prompt.strip():
            raise ValueError("empty prompt: give the model something to answer")
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    outs = llm.generate(args.prompts, params, chat=not args.raw)
    for g in outs:
        if args.json:
            print(json.dumps(g.to_dict()))
        else:
            print(g.text)
            print(f"[{params.spec} | NFE {g.nfe} | TPF {g.tpf:.2f} | {g.tps:.1f} tokens/s | "
                  f"{g.seconds:.2f} s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="unmask", description="Fast, exact inference for diffusion LMs.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompts", nargs="+", metavar="PROMPT")
    add_model_arguments(g)
    add_decode_arguments(g)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=cmd_generate)

    from unmask.bench.cli import add_bench_arguments, add_eval_arguments, run_bench, run_eval

    e = sub.add_parser("eval", help="accuracy of a decoder on a task's held-out set")
    add_eval_arguments(e)
    e.set_defaults(func=run_eval)
    b = sub.add_parser("bench", help="decoders side by side: accuracy, speed, cost, plot")
    add_bench_arguments(b)
    b.set_defaults(func=run_bench)

    from unmask.training.train import add_train_arguments, run_train

    t = sub.add_parser("train", help="train a small LLaDA-format model (the embedded model)")
    add_train_arguments(t)
    t.set_defaults(func=_wrap_train(run_train))
    return p


def _wrap_train(run: Callable) -> Callable[[argparse.Namespace], int]:
    def go(args: argparse.Namespace) -> int:
        run(args)
        return 0
    return go


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if isinstance(getattr(args, "threads", None), int):
        import torch

        torch.set_num_threads(args.threads)
    try:
        code = args.func(args)
    except USER_ERRORS as e:
        print(f"unmask: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
