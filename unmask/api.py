"""The Python API: ``LLM(path).generate(prompts, params)``.

This is the edge where tokenization, device and dtype are decided; the engine below works on
token ids only.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from unmask.checkpoint import CheckpointError, load_model
from unmask.compiling import check_compile, compile_model
from unmask.decoding.grammar import (
    Automata,
    Constraint,
    ResponseFormat,
    TokenAutomaton,
    as_format,
    token_bytes,
    with_prior,
)
from unmask.decoding.params import DEFAULT_DECODER, DecodeParams, SpecError
from unmask.engine import Request, StepEvent, decode
from unmask.engine.graphs import CudaGraphs
from unmask.engine.layout import model_defaults
from unmask.engine.prefix_store import make_prefix_store
from unmask.engine.request import useful_length  # noqa: F401  (re-exported for API users)
from unmask.errors import InputError, lone_surrogate  # noqa: F401  (InputError re-exported)
from unmask.hub import DEFAULT_NAME, SHIPPED, model_name, resolve_model
from unmask.int4call import call_int4_directly
from unmask.memory import resident
from unmask.packing import PackedLinear, slow_bf16_note
from unmask.quantize import (
    QUANTIZED_FILE,
    check_quantize,
    float_bytes,
    mib,
    quantized_scheme,
    torchao_version,
    weight_bytes,
)
from unmask.rowint8 import SCHEME as ROW_SCHEME
from unmask.tokens import ChatTokens

DEFAULT_MODEL = SHIPPED[DEFAULT_NAME]
log = logging.getLogger("unmask")


@dataclass
class Generation:
    """One prompt's output and what it cost."""

    text: str
    # The whole canvas: all gen_length generated positions. The answer is the first `useful`;
    # after it comes its EOS, then what the canvas holds past it (EOS padding, or tokens a
    # bidirectional canvas committed past the EOS before it was settled): not the answer.
    token_ids: list[int]
    nfe: int
    token_forwards: int
    tpf: float  # generated positions committed by forwards' decisions, per forward
    tps: float  # useful tokens (up to the first EOS) per second
    seconds: float
    finish_reason: str = "length"  # eos | length | error (see unmask.engine.request)
    useful: int | None = None  # the answer's tokens: token_ids[:useful] (None: all of them)
    cached_tokens: int = 0  # prompt tokens read from the prefix store, not forwarded

    def to_dict(self) -> dict:
        return asdict(self)


def load_tokenizer(path: str | Path):
    """The checkpoint's fast tokenizer (with its chat template), from local files only: the
    folder is local (a hub id was downloaded before, by unmask.hub), so the hub's offline mode
    is left as the user set it."""
    from transformers import PreTrainedTokenizerFast

    folder = Path(path)
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{folder} has no tokenizer.json")
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        tok.encode("a", add_special_tokens=False)  # some bad settings fail only when used
        # Prompts are checked against the model's max_sequence_length by the engine, with an
        # error naming both lengths; the tokenizer's own limit only added transformers' warning
        # that a long prompt "will result in indexing errors" before that error. Never truncated.
        tok.model_max_length = sys.maxsize
        return tok
    # transformers and tokenizers raise many types for a damaged file (JSON, Rust, type errors)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{folder}: tokenizer.json or tokenizer_config.json cannot be "
                              f"loaded ({type(e).__name__}: {_first_line(e)})") from None


def check_tokenizer(tokenizer, config, folder: Path) -> None:
    """Refuse a tokenizer that does not belong with the config: more tokens than the embedding
    has rows (ordinary text would be refused as "not in the vocabulary") or than the model can
    predict, or a mask token other than the config's (an EOS other than the config's is a
    warning). Tokens are compared only where both sides define them: the published LLaDA
    tokenizer names no mask token."""
    n, c = len(tokenizer), config
    if n > c.embedding_size:
        raise CheckpointError(f"{folder}: the tokenizer has {n:,} tokens, more than the model's "
                              f"embedding_size {c.embedding_size:,}; tokenizer and weights do not "
                              f"belong together")
    # The mask token may sit past vocab_size: it is read, never predicted.
    if n > c.vocab_size + (c.vocab_size <= c.mask_token_id < n):
        raise CheckpointError(f"{folder}: the tokenizer has {n:,} tokens, more than the model's "
                              f"vocab_size {c.vocab_size:,} (the tokens it can predict); "
                              f"tokenizer and config.json do not belong together")
    token, tid = tokenizer.mask_token, tokenizer.mask_token_id
    if token is not None and tid is not None and tid != c.mask_token_id:
        # every canvas is filled with the config's id: another token's would decode nonsense
        raise CheckpointError(f"{folder}: config.json's mask_token_id is {c.mask_token_id}, but "
                              f"the tokenizer's mask token {str(token)!r} is id {tid}; tokenizer "
                              f"and config.json do not belong together")
    token, tid = tokenizer.eos_token, tokenizer.eos_token_id
    if token is not None and tid is not None and tid != c.eos_token_id:
        # A warning, not an error: chat checkpoints may name their turn-end token as the
        # tokenizer's EOS while the config keeps the end of text; decoding follows the config.
        warnings.warn(f"{folder}: config.json's eos_token_id is {c.eos_token_id}, but the "
                      f"tokenizer's eos token {str(token)!r} is id {tid}; generation stops at "
                      f"id {c.eos_token_id} (the config's)", stacklevel=3)


def check_text(text: str, which: str) -> None:
    """Refuse text with a lone surrogate, which the tokenizer (a UTF-8 codec) fails on."""
    why = lone_surrogate(text)
    if why is not None:
        raise InputError(f"{which} is not valid UTF-8 text: {why}")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else "no message"


def resolve_device(name: str | torch.device | None) -> torch.device:
    """The torch device to run on: None = cuda when this torch has it, else cpu. Anything this
    machine cannot run (cuda without CUDA, cuda:3 on one GPU, tpu, a typo) is an InputError that
    names what is valid here."""
    valid = ["cpu"]
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_cuda:
        valid += ["cuda"] + [f"cuda:{i}" for i in range(n_cuda)]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        valid.append("mps")
    if name is None:
        return torch.device("cuda" if n_cuda else "cpu")
    choices = ", ".join(valid)
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"unknown device {name!r}; valid here: {choices}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not n_cuda:
            raise InputError(f"device {name!r}: this torch build has no usable CUDA "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
                             f"valid here: {choices}")
        if dev.index is not None and dev.index >= n_cuda:
            raise InputError(f"device {name!r}: this machine has {n_cuda} CUDA device(s); "
                             f"valid here: {choices}")
        return dev
    if dev.type == "mps" and "mps" in valid:
        return dev
    raise InputError(f"device {name!r} is not supported here; valid here: {choices}")


def allowed_cpus() -> set[int]:
    """The CPU numbers this process may run on (its affinity: a container's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def available_cpus() -> int:
    return len(allowed_cpus())


def physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """The physical cores among logical CPUs ``cpus`` (hyperthread siblings share one core: a
    (package, core) pair in the kernel's topology); None where the topology cannot be read."""
    cores = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            return None
    return len(cores) or None


# Below this many parameters a decode runs on one thread by default: on the embedded model (1.4M)
# a second thread gained 17% on free cores and lost 15-100x while another process held one, as
# it waits for a busy core every step (benchmarks/bench/threads.md, docs/cli.md "Threads").
TINY_MODEL_PARAMS = 10_000_000


def default_threads(n_params: int) -> tuple[int, str]:
    """The CPU threads to decode a model of ``n_params`` parameters with, when none are asked
    for, and why (said by --verbose): one per physical core this process may run on (a
    hyperthread sibling shares its core's arithmetic units), one for a tiny model."""
    cpus = allowed_cpus()
    cores = physical_cores(cpus)
    counted = (f"{cores} physical core(s) among the {len(cpus)} CPU(s) this process may use"
               if cores is not None else f"{len(cpus)} CPU(s), the core topology unreadable")
    if n_params < TINY_MODEL_PARAMS:
        return 1, (f"the model has {n_params / 1e6:.1f}M parameters, under "
                   f"{TINY_MODEL_PARAMS / 1e6:g}M, and decodes fastest on one ({counted})")
    return (cores or len(cpus)), f"one per core ({counted})"


def set_threads(n: int, flag: str = "--threads") -> None:
    """torch's CPU threads. More than the CPUs this process may run on is an InputError: extra
    threads only contend for the cores, and a count in the thousands crashes the OpenMP runtime
    (a segfault at ~16,000 threads, measured on a 2-core machine)."""
    cpus = available_cpus()
    if not 1 <= n <= cpus:
        raise InputError(f"{flag} {n}: this process may run on {cpus} CPU(s); valid: 1..{cpus}")
    torch.set_num_threads(n)


class LLM:
    """A dLLM checkpoint ready to generate. path: a model folder, a Hugging Face hub id
    ("org/name", downloaded into the hub cache on first use: unmask.hub), or None for the
    embedded default model."""

    def __init__(self, path: str | Path | None = None, device: str | None = None,
                 dtype: str | None = None, quantize: str | None = None,
                 compile: bool = False, prefix_cache: bool = True,
                 prefix_cache_gib: float | None = None, cuda_graphs: str = "auto") -> None:
        """quantize: None, or "int8" / "int4": the transformer blocks' linear weights quantized
        at load (unmask.quantize); "w8a8": int8 weights and activations (unmask.rowint8).
        A folder saved quantized loads quantized as saved. compile:
        the model's layers compiled with torch.compile after quantization (unmask.compiling;
        the first calls of new shapes then take seconds each). prefix_cache: a block-causal
        model's finished blocks are kept and reused by every engine of this LLM
        (`prefix_store`; docs/engine.md, "Prefix reuse"), under prefix_cache_gib GiB (default
        a share of the memory free after the load). cuda_graphs: "auto", "on" or "off", one
        CUDA graph replayed per shape bucket of a block-causal model's calls (docs/engine.md,
        "CUDA graphs"); "on" where they cannot run is an InputError saying what works instead."""
        if not isinstance(compile, bool):
            raise InputError(f"compile must be True or False, got {compile!r}")
        if path is not None:
            try:
                name = os.fspath(path)
            except TypeError:
                name = None
            if not isinstance(name, str):  # bytes paths too: every message formats the path
                raise InputError(f"the model path must be a folder path (str or os.PathLike), "
                                 f"got {type(path).__name__}")
            if not name.strip():  # Path("") is ".", the working folder
                raise CheckpointError("the model path is empty; give a model folder, or none for "
                                      "the embedded model")
            path = resolve_model(name)  # a hub id "org/name" is downloaded here
        else:
            name, path = None, DEFAULT_MODEL
            if not (path / "model.safetensors").is_file():
                raise CheckpointError(
                    f"the embedded default model is not in this install ({path}); "
                    "pass a model folder with --model / LLM(path=...)")
        self.path = Path(path)
        self.name = model_name(name, self.path)  # as `unmask models` lists it
        self.device = resolve_device(device)
        if quantize is not None:  # before the load: a scheme that cannot run fails at once
            check_quantize(quantize, self.device)
        if compile:  # before the load: a missing compiler is said at once
            check_compile(self.device)
            if quantize == ROW_SCHEME:
                raise InputError(f"quantize {ROW_SCHEME} does not compile (torch.compile fails on "
                                 f"oneDNN's packed int8 product): drop compile, or quantize int8")
        # torch.compile packs the weights it freezes its own way: no oneDNN packing for it
        self.model = load_model(self.path, self.device, dtype, quantize=quantize,
                                pack=not compile)
        self.load_note = self._quantize_note(quantize)
        if not compile:  # torch.compile packs the weights it freezes its own way
            self.load_note += self._pack()
        self.load_memory = resident()  # what the load left resident, and the peak (None off Linux)
        log.info("%s: %s%s", self.path, self.load_note,
                 "" if self.load_memory is None else f"; {self.load_memory.note()}")
        if compile:  # after quantization: the compiled layers trace the weights they will run
            compile_model(self.model)
        self.config = self.model.config
        self.graphs = CudaGraphs(cuda_graphs)
        self.graphs.active(self.model)  # "on" that cannot run: refused before any request
        self.prefix_store = make_prefix_store(self.model, self.device, prefix_cache,
                                              prefix_cache_gib)
        self.tokenizer = load_tokenizer(self.path)
        check_tokenizer(self.tokenizer, self.config, self.path)
        self.chat_tokens = ChatTokens(self.tokenizer)  # encode_messages', its shared pieces kept
        self._automata = Automata()  # LLM.constraint's

    def _quantize_note(self, scheme: str | None) -> str:
        """A line saying what the loaded model's weights hold, and held in their float dtype
        when load_model quantized them as it read them; InputError for a folder saved quantized
        in another scheme than `scheme`."""
        held = weight_bytes(self.model)
        found = quantized_scheme(self.model)
        if (self.path / QUANTIZED_FILE).is_file():
            if scheme not in (None, found):
                raise InputError(f"{self.path} was saved quantized as {found}; load it without "
                                 f"quantize, or quantize its float checkpoint as {scheme}")
            return f"weights {mib(held)} (saved quantized as {found})"
        if scheme is None:
            return f"weights {mib(held)}"
        kernel = "oneDNN" if scheme == ROW_SCHEME else f"torchao {torchao_version()}"
        return (f"weights {mib(held)} quantized {scheme} with {kernel} while loading "
                f"({mib(float_bytes(self.model))} before)")

    def _pack(self) -> str:
        """A note on the block weights set up for their CPU kernel: bfloat16 ones prepacked for
        oneDNN as load_model read them (unmask.packing), int4 ones calling torch's kernel
        directly (unmask.int4call); '' when neither."""
        slow = slow_bf16_note(self.model)
        if slow is not None:
            warnings.warn(slow, stacklevel=3)
        scheme = quantized_scheme(self.model)
        if scheme == "int4":  # torch's int4 CPU kernel called without torchao's dispatch
            n = call_int4_directly(self.model) if self.device.type == "cpu" else 0
            return f", {n} int4 layers calling torch's kernel directly" if n else ""
        n = sum(isinstance(m, PackedLinear) for m in self.model.modules())  # packed by the load
        return f", {n} linear layers prepacked for oneDNN" if n else ""

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        if not isinstance(prompt, str):
            raise InputError(f"the prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise InputError("empty prompt: give the model something to answer")
        check_text(prompt, "the prompt")
        return self._encode(prompt, chat)

    def _encode(self, prompt: str, chat: bool) -> list[int]:
        """encode_prompt past its checks (generate has made them, naming each prompt)."""
        if not isinstance(chat, bool):  # "no" or "false" from a config file is truthy
            raise InputError(f"chat must be True or False, got {chat!r}")
        tok = self.tokenizer
        if chat and tok.chat_template:
            return self.encode_messages([{"role": "user", "content": prompt}])
        if chat:  # shown once per checkpoint (Python's default warning filter)
            warnings.warn(self.no_chat_template_note("chat=False"), stacklevel=2)
        return tok.encode(prompt, add_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.chat_template)

    def no_chat_template_note(self, raw_flag: str | None) -> str:
        """What generating with chat on means for a checkpoint without a template: base models
        have none, so it is a note, not an error, but never a silent change of the prompt.
        raw_flag: how the caller asks for the raw prompt (None: it cannot)."""
        note = (f"{self.path} has no chat template (no chat_template in tokenizer_config.json): "
                f"prompts go to the model as written")
        return note + (f"; pass {raw_flag} to ask for that and silence this note" if raw_flag
                       else "")

    def render_chat(self, messages: list[dict]) -> str:
        """Messages through the checkpoint's chat template, ready for the assistant's turn. A
        template that fails (its own raise_exception, such as roles that must alternate, or a
        broken template) is an InputError carrying its message."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        # jinja2's TemplateError, and whatever a template's expressions raise
        except Exception as e:  # noqa: BLE001
            raise InputError(f"the checkpoint's chat template (tokenizer_config.json's "
                             f"chat_template) failed on these messages: {type(e).__name__}: "
                             f"{_first_line(e)}") from None

    def encode_messages(self, messages: list[dict]) -> list[int]:
        """Token ids of messages through the chat template, ready for the assistant's turn."""
        return self.chat_tokens.encode(self.render_chat(messages))

    def detokenize(self, token_ids: list[int]) -> str:
        """Text of generated tokens (special tokens dropped); the server streams prefixes of it."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def generate(self, prompts: str | list[str], params: DecodeParams | str | None = None,
                 chat: bool = True, batch_size: int = 8,
                 on_event: Callable[[StepEvent], None] | None = None,
                 response_format: Any = None, length_penalty: float | None = None,
                 **overrides) -> list[Generation]:
        """Generate for each prompt. params: a DecodeParams or a decoder spec string; keyword
        overrides (gen_length=..., block_length=...) apply on top of it. batch_size: requests
        decoded at once (the output does not depend on it). on_event: called with every step
        event (progress). response_format: structured output (`grammar.as_format`: OpenAI's
        response_format object, a pydantic model class or a `ResponseFormat`): every output
        matches it, or ends with finish_reason "length" where gen_length cannot hold one.
        length_penalty: the format's length prior weight (`grammar.with_prior`; None: its
        default, 2 for JSON, 0 for a regular expression)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InputError(f"prompts must be a string or a non-empty list of strings, got "
                             f"{type(prompts).__name__}")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise InputError(f"prompt {i} must be a string, got {type(prompt).__name__}")
            if not prompt.strip():
                raise InputError(f"empty prompt (prompt {i}): give the model something to answer")
            check_text(prompt, f"prompt {i}")
        params = resolve_params(params, overrides, model_defaults(self.model))
        fmt = with_prior(as_format(response_format), length_penalty)
        ids = [self._encode(p, chat) for p in prompts]
        constraints = None if fmt is None else [self.constraint(fmt, params.gen_length)] * len(ids)
        return self.generate_ids(ids, params, batch_size=batch_size, on_event=on_event,
                                 constraints=constraints)

    def constraint(self, fmt: ResponseFormat, budget: int) -> Constraint:
        """A request's constraint: `fmt` over its first `budget` generated tokens (the
        automaton is compiled once per format and kept)."""
        c = self.config
        automaton = self._automata.get((fmt.pattern, fmt.kind), lambda: TokenAutomaton.build(
            fmt.pattern, token_bytes(self.tokenizer), c.vocab_size, c.eos_token_id,
            encode=lambda text: self.tokenizer.encode(text, add_special_tokens=False)))
        return Constraint(fmt, automaton, budget, c.mask_token_id)

    def generate_ids(self, prompt_ids: list[list[int]], params: DecodeParams,
                     batch_size: int = 8,
                     on_event: Callable[[StepEvent], None] | None = None,
                     constraints: list[Constraint | None] | None = None) -> list[Generation]:
        """Generate for already tokenized prompts: `batch_size` at a time through the engine
        (constraints: each prompt's structured output, or None)."""
        if not isinstance(params, DecodeParams):
            raise SpecError("params must be a DecodeParams")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        reqs = decode(self.model, params, prompt_ids, max_running=batch_size, on_event=on_event,
                      constraints=constraints, prefix=self.prefix_store, graphs=self.graphs)
        return [self.generation(r) for r in reqs]

    def generation(self, r: Request) -> Generation:
        """A finished request as text and metrics (docs/design.md § Metrics)."""
        if r.finish_reason == "error":
            raise RuntimeError(f"request {r.request_id} failed in the engine: {r.error}")
        return Generation(text=self.detokenize(r.token_ids[: r.useful]), token_ids=r.token_ids,
                          useful=r.useful,
                          nfe=r.nfe, token_forwards=r.token_forwards, tpf=r.tpf, tps=r.tps,
                          seconds=r.seconds, finish_reason=r.finish_reason or "length",
                          cached_tokens=r.cached_tokens)


def resolve_params(params: DecodeParams | str | None, overrides: dict,
                   defaults: dict | None = None) -> DecodeParams:
    """A DecodeParams from a spec string (default DEFAULT_DECODER) or a DecodeParams, with keyword
    overrides on top; unknown keys and bad types are SpecErrors naming the key. defaults: the
    model's (`layout.model_defaults`), under the spec's keys and the overrides."""
    if params is None or isinstance(params, str):
        # "" is an empty spec (an error, as --decoder ''), not a request for the default
        return DecodeParams.parse(DEFAULT_DECODER if params is None else params,
                                  **{**(defaults or {}), **overrides})
    if not isinstance(params, DecodeParams):
        raise SpecError(f"params must be a decoder spec string or a DecodeParams, got "
                        f"{type(params).__name__}")
    return params.replace(**overrides) if overrides else params


