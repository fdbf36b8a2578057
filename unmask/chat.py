"""`unmask chat`: a multi-turn prompt through the model's chat template, with its history.

An answer streams as its tokens are committed: the committed-contiguous prefix as text, the same
stream the server sends (`unmask.server.output.TextStream`), so what is printed never changes
afterwards. One `Engine` serves the whole session, one request at a time; Ctrl-C during an answer
aborts that request (the session goes on), Ctrl-D or `/bye` leaves. With stdin not a terminal
there is no banner and no prompt: each line of input is one message, its answer on stdout.

`/watch` draws the canvas as it fills (`CanvasView`, drawn with rich from the step dicts of
`unmask.trace.Lane`): a rich Live view on a terminal, one plain-text frame per step otherwise.
Commands are in HELP; docs/cli.md ("unmask chat") describes the session.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from unmask.cli_args import (
    add_decode_arguments,
    add_model_arguments,
    add_prefix_arguments,
    check_prompts,
)
from unmask.decoding.params import DecodeParams
from unmask.errors import CanvasTooLong, InputError, UnmaskError

if TYPE_CHECKING:  # the module is imported for the CLI's arguments: no torch until it runs
    from rich.console import Console, RenderResult

    from unmask.api import LLM
    from unmask.engine import Request

HELP = """\
/decoder SPEC  decode the next answers with SPEC (no SPEC: show the current one)
/length N      generated positions per answer (gen_length)
/seed N        sampling seed
/reset         forget the conversation
/stats         NFE, TPF and tokens/s of the last answer
/watch         show the canvas filling while an answer is generated (again: stop)
/bye           leave (so does Ctrl-D); Ctrl-C stops the answer being generated
//TEXT         send TEXT starting with "/" as a message"""
COMMANDS = ("/decoder", "/length", "/seed", "/reset", "/stats", "/watch", "/bye", "/help")


@dataclass(frozen=True)
class AnswerStats:
    """What the last answer cost (docs/design.md § Metrics)."""

    nfe: int
    tpf: float
    tokens: int  # tokens of the answer shown (up to EOS, or what was committed before a stop)
    seconds: float
    finish_reason: str
    cached_tokens: int = 0  # prompt tokens (the history) read from the prefix store

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (f"NFE {self.nfe} | TPF {self.tpf:.2f} | {self.tps:.1f} tokens/s | "
                f"{self.tokens} tokens | {self.seconds:.2f} s | {self.finish_reason}")


class Chat:
    """A conversation with one model: its history, decoder, and the engine that answers."""

    def __init__(self, llm: LLM, params: DecodeParams, out: TextIO,
                 console: Console | None = None, typed: dict[str, Any] | None = None,
                 keep_history: bool = True) -> None:
        """typed: decoder keys set outside the spec (the command's flags); `/decoder` keeps them,
        `/length` and `/seed` add to them, and a spec's own keys win over them. keep_history:
        False answers each message alone (`keeps_history`)."""
        from unmask.engine import Engine, SchedulerConfig

        self.llm, self.params, self.out = llm, params, out
        self.console = console
        self.typed = dict(typed or {})
        # the LLM's prefix store: a turn reads the history's blocks the last turn left there
        self.engine = Engine(llm.model, SchedulerConfig(max_running=1), prefix=llm.prefix_store,
                             graphs=llm.graphs)
        self.history: list[dict[str, str]] = []
        self.keep_history = keep_history
        self.stats: AnswerStats | None = None
        self.watch = False
        self._stop = threading.Event()

    # --- an answer ---------------------------------------------------------------------------
    def interrupt(self) -> None:
        """Stop the answer being generated (Ctrl-C's handler while one is): the engine aborts
        it before its next step, and what was committed stays the answer shown."""
        self._stop.set()

    def prompt_ids(self, text: str) -> list[int]:
        """The conversation so far and `text` as the next user turn, through the template."""
        if not self.llm.has_chat_template:  # a base model: no turns, the text as written
            return self.llm.encode_prompt(text, chat=False)
        earlier = self.history if self.keep_history else []
        return self.llm.encode_messages([*earlier, {"role": "user", "content": text}])

    def answer(self, text: str) -> str:
        """Generate the answer to `text`, printing it as it is committed; returns it. An
        interrupted answer is shown as far as it got and left out of the history."""
        from unmask.server.output import TextStream

        check_prompts([text])
        try:
            req = self.engine.add_request(self.prompt_ids(text), self.params)
        except CanvasTooLong as e:
            raise CanvasTooLong(f"{e}; /reset forgets the conversation, /length N shortens the "
                                f"answer") from None
        stream = TextStream(self.llm, req.gen_length, None)
        self._stop.clear()
        with self._watching(req, text) as view, _on_sigint(self.interrupt):
            while self.engine.has_unfinished:
                if self._stop.is_set() and not req.finished:
                    self.engine.abort(req.request_id)
                for ev in self.engine.step():
                    delta = stream.update(ev)
                    if view is None:
                        self._write(delta)
                    else:
                        view.feed(ev)
        if req.finish_reason == "error":
            raise RuntimeError(f"request {req.request_id} failed in the engine: {req.error}")
        stopped = req.finish_reason == "abort"
        rest = stream.finish(None if stopped else req.token_ids)
        self._write(stream.sent if view is not None else rest)
        self._write("\n")
        self.stats = AnswerStats(req.nfe, req.tpf, stream.n_tokens, req.seconds,
                                 req.finish_reason or "length", req.cached_tokens)
        if stopped:
            print("(stopped: this turn is left out of the conversation)", file=sys.stderr)
        elif self.llm.has_chat_template and self.keep_history:
            self.history += [{"role": "user", "content": text},
                             {"role": "assistant", "content": stream.sent}]
        return stream.sent

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    @contextlib.contextmanager
    def _watching(self, req: Request, text: str) -> Iterator[CanvasView | None]:
        """The canvas view while `req` decodes when /watch is on (else None): a rich Live on a
        terminal, a plain frame per step otherwise."""
        if not self.watch:
            yield None
            return
        from rich.console import Console
        from rich.live import Live

        from unmask.trace import Lane

        console = self.console or Console(file=self.out)
        view = CanvasView(Lane(self.llm, 0, text, req))
        if not console.is_terminal:
            view.on_frame = console.print
            yield view
            return
        with Live(view, console=console, auto_refresh=False) as live:
            view.on_frame = lambda _: live.refresh()
            yield view

    # --- commands ----------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; False when it ends the session. Bad input is an UnmaskError."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name == "/bye":
            return False
        if name not in COMMANDS:
            raise InputError(f"unknown command {name!r}; valid: {', '.join(COMMANDS)}")
        getattr(self, "_" + name[1:])(arg)
        return True

    def _decoder(self, spec: str) -> None:
        if spec:
            from unmask.engine.layout import parse_for

            self.params = parse_for(spec, self.llm.model, **self.typed)
        self.say(f"decoder {self.params.spec}: gen_length {self.params.gen_length}, block_length "
                 f"{self.params.block_length}, seed {self.params.seed}")

    def _length(self, arg: str) -> None:
        self._set("gen_length", _integer("/length", arg, minimum=1))

    def _seed(self, arg: str) -> None:
        self._set("seed", _integer("/seed", arg, minimum=0))

    def _set(self, key: str, value: int) -> None:
        self.params = self.params.replace(**{key: value})  # validated: SpecError if it does not fit
        self.typed[key] = value
        self._decoder("")

    def _reset(self, _: str) -> None:
        self.history.clear()
        self.say("conversation cleared")

    def _stats(self, _: str) -> None:
        self.say(self.stats.line() if self.stats else "no answer yet")

    def _watch(self, _: str) -> None:
        self.watch = not self.watch
        self.say(f"watch {'on' if self.watch else 'off'}")

    def _help(self, _: str) -> None:
        self.say(HELP)

    def say(self, text: str) -> None:
        self._write(text + "\n")


def _integer(command: str, arg: str, minimum: int) -> int:
    try:
        value = int(arg)
    except ValueError:
        raise InputError(f"{command} takes an integer >= {minimum}, got {arg!r}") from None
    if value < minimum:
        raise InputError(f"{command} takes an integer >= {minimum}, got {value}")
    return value


@contextlib.contextmanager
def _on_sigint(handler: Any) -> Iterator[None]:
    """Ctrl-C calls `handler` instead of raising KeyboardInterrupt (in the main thread only:
    Python delivers signals there), so a step is never cut in the middle."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: handler())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# --- the canvas view -----------------------------------------------------------------------------
MASKED, IN_BLOCK, EOS = "\u2591", "\u2592", "\u00b7"


class CanvasView:
    """The canvas of one answer as it fills, a rich renderable: a header (decoder, step, NFE,
    TPF, committed positions) and the generated positions as one wrapped line of text, each
    committed token as its text (newlines as \u21b5), the tokens of the last step highlighted,
    EOS as a dot, masked positions as \u2591 (\u2592 inside the current block). Wrapped to the
    console's width, so it reads at 80 columns and at 20."""

    def __init__(self, lane: Any) -> None:
        self.lane = lane
        self.pieces: dict[int, str] = {}
        self.last: dict[str, Any] | None = None
        self.on_frame: Any = None  # called with the view after each step

    def feed(self, ev: Any) -> None:
        for d in self.lane.feed(ev, 0.0):
            if d["event"] != "step":
                continue
            eos = set(d["eos"])
            for pos, piece in zip(d["positions"], d["tokens"], strict=True):
                self.pieces[pos] = EOS if pos in eos else (piece.replace("\n", "\u21b5") or "\u2205")
            self.last = d
            if self.on_frame is not None:
                self.on_frame(self)

    def __rich_console__(self, console: Console, options: Any) -> RenderResult:
        from rich.text import Text

        d, n = self.last, self.lane.request.gen_length
        header = Text(f"{self.lane.request.params.spec}  ", style="bold")
        if d is not None:
            tpf = d["decided"] / d["nfe"] if d["nfe"] else 0.0
            header.append(f"step {d['step']}  NFE {d['nfe']}  TPF {tpf:.2f}  "
                          f"{len(self.pieces)}/{n} committed", style="dim")
        yield header
        new = set(d["positions"]) if d else set()
        block = range(*d["block"]) if d else range(0)
        canvas = Text(overflow="fold")
        for pos in range(n):
            if pos in self.pieces:
                style = "black on yellow" if pos in new else ("dim" if self.pieces[pos] == EOS else "")
                canvas.append(self.pieces[pos], style=style)
            else:
                canvas.append(IN_BLOCK if pos in block else MASKED,
                              style="cyan" if pos in block else "dim")
        yield canvas


# --- the command ---------------------------------------------------------------------------------
def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="the model, as --model takes it (`unmask chat org/name`)")
    add_model_arguments(p)
    add_prefix_arguments(p)
    add_decode_arguments(p)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the spec's)")
    p.add_argument("--history", action=argparse.BooleanOptionalAction, default=None,
                   help="send the conversation so far with each message (--no-history: answer "
                        "each message alone; default: history, unless the model's folder says "
                        "it was trained on single questions, as the shipped ones do)")


def run_chat(args: argparse.Namespace) -> int:
    from unmask.cli_args import chat_for, check_decoder, decoder_for, load_llm

    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise InputError(f"the model is given twice: {args.model_arg!r} and --model "
                             f"{args.model!r}; give one")
        args.model = args.model_arg
    check_decoder(args.decoder, args)  # before the load: a bad spec fails at once
    llm = load_llm(args)
    params = decoder_for(args.decoder, args, llm)
    chat_for(llm, raw=False, raw_flag=None)  # a base model: a note that there are no turns
    typed = {k: getattr(args, k) for k in ("gen_length", "block_length", "seed")
             if getattr(args, k) is not None}
    chat = Chat(llm, params, sys.stdout, typed=typed, keep_history=keeps_history(llm, args.history))
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"unmask chat: {llm.name}, decoder {params.spec}. /help for commands, "
              f"Ctrl-D or /bye to leave.")
    while (line := read_line(interactive)) is not None:
        if not turn(chat, line):
            break
    return 0


def keeps_history(llm: LLM, asked: bool | None) -> bool:
    """Whether a chat sends its history: as asked (--history / --no-history), else unless the
    model was trained on single questions (unmask.catalog.trained_on_single_turns), which a
    note on stderr then says, with the flag that keeps it anyway. Such a model answers a second
    message with its history badly (an empty answer, or the first question's)."""
    from unmask.catalog import SINGLE_TURN_KEY, trained_on_single_turns

    if asked is not None:
        return asked
    if not trained_on_single_turns(llm.path):
        return True
    print(f"note: {llm.name} was trained on single questions (generation_config.json: "
          f"{SINGLE_TURN_KEY}), so each message is answered alone; --history sends the "
          f"conversation anyway", file=sys.stderr)
    return False


def turn(chat: Chat, line: str) -> bool:
    """One line of input: a command or a message. False when the session ends. Bad input is
    one line on stderr and the session goes on."""
    line = line.rstrip("\r\n")
    try:
        if line.startswith("/") and not line.startswith("//"):
            return chat.command(line)
        if line.strip():
            chat.answer(line[1:] if line.startswith("//") else line)
    except UnmaskError as e:
        print(f"error: {e}", file=sys.stderr)
    return True


def read_line(interactive: bool) -> str | None:
    """The next line of input, None at its end. On a terminal: with a prompt and line editing,
    Ctrl-C gives an empty line. Piped: bytes decoded as UTF-8 (a line that is not is refused
    by check_prompts with the bad byte named), a last line without its newline included."""
    if not interactive:
        raw = sys.stdin.buffer.readline()
        return raw.decode("utf-8", "surrogateescape") if raw else None
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input(); absent on Windows)
    try:
        return input(">>> ")
    except KeyboardInterrupt:
        print()
        return ""
    except EOFError:
        print()
        return None
