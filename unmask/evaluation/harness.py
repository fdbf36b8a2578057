"""unmask as an lm-evaluation-harness model, registered as ``unmask``.

    lm_eval --model unmask --model_args pretrained=DIR,decoder=fast,gen_length=256 \
        --tasks unmask_math --include_path unmask/eval_tasks --apply_chat_template

(lm-eval finds this class through the hook in ``_unmask_lm_eval.py``; ``unmask-lm-eval`` imports
it itself.)

``--model_args`` keys: ``pretrained`` (model folder; default the embedded model), ``decoder`` (a
decoder spec NAME; its keys go in as further model args, e.g. ``decoder=threshold,threshold=0.8``),
any decoder key (``gen_length``, ``block_length``, ``seed``, ...), ``dtype``, ``quantize``
(``int8``/``int4``, as ``--quantize``), ``compile`` (``true``: as ``--compile``), ``mc_num`` and
``mc_batch_size`` (the likelihood estimate), ``greedy_check``; ``--device``, ``--batch_size``
and ``--max_batch_size`` (a cap on what ``batch_size=auto`` picks) come from lm-eval's own flags,
or from ``--model_args``, which win. Every request is checked (empty context, the mask token,
lengths, ``steps`` against its canvas) before the first is decoded or scored.

- ``generate_until``: batches of ``batch_size`` prompts through ``LLM.generate`` with the decoder
  spec. The canvas is the request's ``max_gen_toks`` rounded up to ``block_length`` (the spec's
  ``gen_length`` when the task sets none); the text is cut to ``max_gen_toks`` tokens, then at the
  first ``until`` string. Prompts are used as lm-eval gives them (``chat=False``): with
  ``--apply_chat_template`` lm-eval has already formatted them with the checkpoint's template.
  Sampling follows the decoder spec (``temperature``, ``seed``), not the task's ``do_sample``.
- ``loglikelihood``: the Monte Carlo bound the model is trained on, ``mc_num`` samples per
  request: the masked-diffusion bound (``unmask.evaluation.likelihood``), or for a
  block-diffusion model (SDAR, LLaDA2, Fast-dLLM v2) the block-diffusion bound, each of its blocks
  noised given the clean ones before (``unmask.evaluation.block_likelihood``). ``is_greedy``:
  static-1 decoding after the context reproduces the continuation token for token, on a canvas
  as long as the continuation (a block model: in its own blocks, up to the end of the one
  holding the continuation's last token) (``greedy_check=false`` skips it and reports False; an
  empty continuation is greedy).
- ``loglikelihood_rolling``: the same bound for the whole document given only BOS, in one window.
  Neither bound is computed in rolling windows (a bidirectional model's positions see the whole
  window), so a document longer than the model's ``max_sequence_length`` is an error, not
  chunked.
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models first: see below)
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string
from tqdm import tqdm

from unmask.api import LLM, Generation, check_text
from unmask.decoding.params import SPEC_KEYS, DecodeParams, check_before_model, whole_blocks
from unmask.engine.layout import parse_for
from unmask.errors import InputError, UnmaskError
from unmask.evaluation.block_likelihood import estimate_block_bound
from unmask.evaluation.likelihood import Bound, estimate_bound

log = logging.getLogger(__name__)


def _cli_name() -> str | None:
    """The name to report under lm-eval's own command line: its console scripts (`lm_eval`,
    `lm-eval`) or `python -m lm_eval`, whose argv[0] is lm_eval's __main__.py; None elsewhere."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if name in ("lm_eval", "lm-eval"):
        return name
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(spec, "name", None) == "lm_eval.__main__":
        return "lm_eval"
    return None


def _one_line_errors() -> None:
    """Under lm-eval's own command line, bad input of ours (an unknown --model_args key, a bad
    decoder spec, a missing folder) ends the run with one line naming it, as `unmask` and
    `unmask-lm-eval` do, instead of a traceback. Other exceptions, and Python callers, keep
    theirs."""
    name = _cli_name()
    if name is None:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, UnmaskError):
            print(f"{name}: error: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)
    sys.excepthook = hook


_one_line_errors()

# unmask eval's defaults, so `--model_args decoder=X` means what `unmask eval --decoder X` means.
DEFAULT_GEN_LENGTH = 256
DEFAULT_BLOCK_LENGTH = 32
DEFAULT_MC_NUM = 128  # LLaDA's evaluation default
AUTO_BATCH_SIZE = 8  # what batch_size=auto means: no memory probing, a fixed batch
MODEL_KEYS = ("pretrained", "decoder", "device", "dtype", "quantize", "compile", "batch_size",
              "max_batch_size", "mc_num", "mc_batch_size", "greedy_check")
# generate_until kwargs that are honoured; sampling ones are answered by the decoder spec.
GEN_KWARGS = ("until", "max_gen_toks")
SAMPLING_KWARGS = ("do_sample", "temperature", "top_p", "top_k")
GREEDY_KWARGS = {"do_sample": False, "temperature": 0}  # values that ask for greedy decoding


# lm-eval's get_model imports lm_eval.models (its built-in models) only while the registry is
# empty, so registering `unmask` into an empty registry would hide them: hence the import above.
# Where unmask_lm_eval.pth's hook registered the placeholder for this class, this replaces it.
@register_model("unmask")
class UnmaskLM(LM):
    @classmethod
    def create_from_arg_string(cls, arg_string: str,
                               additional_config: dict[str, Any] | None = None) -> UnmaskLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any],
                            additional_config: dict[str, Any] | None = None) -> UnmaskLM:
        """lm-eval's own merge passes a key set in both --model_args and its flags twice (a
        TypeError). Its command line always sends batch_size and device (its defaults 1 and
        cuda:0 when not typed), so a conflict cannot be told from a default: --model_args win,
        the model's own arguments being the more specific, with a warning naming both."""
        args = dict(arg_dict)
        for key, value in (additional_config or {}).items():
            if value is None:
                continue
            if key not in args:
                args[key] = value
            elif str(args[key]) != str(value):
                log.warning("unmask uses --model_args %s=%s, not lm-eval's %s %s (--%s or its "
                            "default)", key, args[key], key, value, key)
        return cls(**args)

    def __init__(self, pretrained: str | None = None, decoder: str = "static-1",
                 device: str | None = None, dtype: str | None = None,
                 quantize: str | None = None, compile: bool = False, batch_size: int | str = 1,
                 max_batch_size: int | None = None, mc_num: int = DEFAULT_MC_NUM,
                 mc_batch_size: int = 32, greedy_check: bool = True, **decoder_keys: Any) -> None:
        super().__init__()
        unknown = [k for k in decoder_keys if k not in SPEC_KEYS]
        if unknown:
            raise InputError(f"unknown --model_args key {unknown[0]!r}; valid: "
                             f"{', '.join(MODEL_KEYS + SPEC_KEYS)}")
        # The spec first: a bad one fails before a model is loaded.
        spec = ",".join([str(decoder)] + [f"{k}={_spec_value(v)}" for k, v in decoder_keys.items()])
        defaults = {"gen_length": DEFAULT_GEN_LENGTH, "block_length": DEFAULT_BLOCK_LENGTH}
        check_before_model(spec, **defaults)
        # lm-eval's --max_batch_size bounds only what batch_size=auto picks, as in its HF model.
        cap = None if max_batch_size is None else _positive_int("max_batch_size", max_batch_size)
        auto = AUTO_BATCH_SIZE if cap is None else min(AUTO_BATCH_SIZE, cap)
        self.batch_size = _positive_int("batch_size", batch_size, auto=auto)
        self.mc_num = _positive_int("mc_num", mc_num)
        self.mc_batch_size = _positive_int("mc_batch_size", mc_batch_size)
        for key, flag in (("greedy_check", greedy_check), ("compile", compile)):
            if not isinstance(flag, bool):
                raise InputError(f"{key} must be true or false, got {flag!r}")
        self.greedy_check = greedy_check
        self.llm = LLM(pretrained, device=_device(device), dtype=dtype, quantize=quantize,
                       compile=compile)
        self._device = self.llm.device
        # as the model decodes it (a block-causal model's blocks and cache), as `unmask eval` does
        self.params = parse_for(spec, self.llm.model, **defaults)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ chat template
    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.llm.tokenizer.chat_template or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        tok = self.llm.tokenizer
        if not tok.chat_template:
            raise InputError(f"{self.llm.path} has no chat_template in tokenizer_config.json; "
                             "run without --apply_chat_template")
        return tok.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                       tokenize=False)

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        # Every request is checked before the first is decoded: one found bad mid-run would
        # throw away the batches already decoded.
        by_canvas: dict[int, list[int]] = defaultdict(list)
        params: dict[int, DecodeParams] = {}
        limits: list[int] = []
        stops: list[list[str]] = []
        prompts: list[list[int]] = []
        window = self.llm.config.max_sequence_length
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            limit = self._max_gen_toks(gen_kwargs)
            limits.append(limit)
            stops.append(_until(gen_kwargs))
            canvas = self.params.canvas_for(limit)
            if canvas >= window:  # named here: the engine would blame a gen_length nobody set
                key = "gen_length" if gen_kwargs.get("max_gen_toks") is None else "max_gen_toks"
                raise InputError(f"{key} {limit} (a canvas of {canvas}: a multiple of block_length "
                                 f"{self.params.block_length}) leaves no room for the prompt in the "
                                 f"model's max_sequence_length {window}; valid: the canvas plus the "
                                 f"prompt's tokens <= {window}")
            if canvas not in params:
                params[canvas] = self._params_for(canvas, limit, _which(i, req))
            prompt = self._context_ids(context, _which(i, req))
            if len(prompt) + canvas > window:
                raise InputError(f"generate_until {_which(i, req)}: the context's {len(prompt)} "
                                 f"tokens and a canvas of {canvas} exceed the model's "
                                 f"max_sequence_length {window}")
            prompts.append(prompt)
            by_canvas[canvas].append(i)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="unmask generate_until")
        for canvas, idxs in by_canvas.items():
            for start in range(0, len(idxs), self.batch_size):
                chunk = idxs[start : start + self.batch_size]
                # the prompts as LLM.generate(chat=False) encodes them
                gens = self.llm.generate_ids([prompts[i] for i in chunk], params[canvas],
                                             batch_size=len(chunk))
                for i, g in zip(chunk, gens, strict=True):
                    text = cut_at_stops(self._text(g, limits[i]), stops[i])
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return [t for t in out if t is not None]

    def _params_for(self, canvas: int, limit: int, which: str) -> DecodeParams:
        """The spec with the canvas of a request's max_gen_toks as its gen_length."""
        try:
            return self.params.replace(gen_length=canvas)
        except UnmaskError as e:
            p = self.params
            if p.steps is None:  # steps is the only key whose validity depends on the canvas
                raise InputError(f"generate_until {which}: max_gen_toks {limit}: {e}") from None
            # Scaling steps to each canvas would decode with a step count nobody wrote.
            raise InputError(
                f"generate_until {which}: its max_gen_toks {limit} makes a canvas of {canvas} "
                f"tokens ({_blocks(canvas // p.block_length)} of {p.block_length}) that steps="
                f"{p.steps}, written for gen_length {p.gen_length}, does not fit (steps must be in "
                f"1..{canvas} and a multiple of the blocks); give every request that canvas with "
                f"--gen_kwargs max_gen_toks={p.gen_length}, or drop steps") from None

    def _context_ids(self, context: Any, which: str) -> list[int]:
        if not isinstance(context, str):
            raise InputError(f"generate_until {which}: the context must be a string, got "
                             f"{type(context).__name__}")
        if not context.strip():
            raise InputError(f"generate_until {which}: the context is empty; give the model "
                             "something to answer")
        prompt = self._encode(context, f"generate_until {which}")
        self._refuse_mask("generate_until", which, context=prompt)
        return prompt

    def _max_gen_toks(self, gen_kwargs: dict[str, Any]) -> int:
        if not isinstance(gen_kwargs, dict):
            raise InputError(f"generate_until takes (context, gen_kwargs) with gen_kwargs a dict "
                             f"(until, max_gen_toks), got {gen_kwargs!r}")
        for key, value in gen_kwargs.items():
            # Asking for greedy decoding needs no warning: the spec decides either way.
            if key in GEN_KWARGS or key in self._warned or GREEDY_KWARGS.get(key, ...) == value:
                continue
            self._warned.add(key)
            why = (f"sampling follows the decoder spec (temperature={self.params.temperature}, "
                   f"seed={self.params.seed})" if key in SAMPLING_KWARGS else "not supported")
            log.warning("unmask ignores generation kwarg %s=%r: %s", key, value, why)
        value = gen_kwargs.get("max_gen_toks")
        return self.params.gen_length if value is None else _positive_int("max_gen_toks", value)

    def _text(self, g: Generation, limit: int) -> str:
        """g.text, or the text of its first `limit` tokens when the canvas was rounded up."""
        if len(g.token_ids) <= limit:
            return g.text
        eos = self.llm.config.eos_token_id
        ids = g.token_ids[:limit]
        ids = ids[: ids.index(eos)] if eos in ids else ids
        return self.llm.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ likelihood
    def loglikelihood(self, requests: list[Instance],
                      disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # All encoded and checked first: scoring is the slow part, a bad request is found at once.
        pairs = []
        for i, req in enumerate(requests):
            prompt, target = self._encode_pair(*req.args, which=_which(i, req))
            self._refuse_mask("loglikelihood", _which(i, req), context=prompt, continuation=target)
            pairs.append((prompt, target))
        out = []
        for req, (prompt, target) in zip(tqdm(requests, disable=disable_tqdm,
                                              desc="unmask loglikelihood"), pairs, strict=True):
            result = (self._logprob(prompt, target), self._is_greedy(prompt, target))
            out.append(result)
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return out

    def loglikelihood_rolling(self, requests: list[Instance],
                              disable_tqdm: bool = False) -> list[float]:
        prompt = self._bos()
        room = self.llm.config.max_sequence_length - len(prompt)
        targets = []
        for i, req in enumerate(requests):
            (text,) = req.args
            target = self._encode(text, f"loglikelihood_rolling {_which(i, req)}")
            if len(target) > room:
                raise InputError(
                    f"loglikelihood_rolling {_which(i, req)}: a document of {len(target)} tokens "
                    f"exceeds the model's window ({room} after BOS); the likelihood bound "
                    "scores a document in one window and has no rolling (chunked) form")
            self._refuse_mask("loglikelihood_rolling", _which(i, req), document=target)
            targets.append(target)
        out = []
        for req, target in zip(tqdm(requests, disable=disable_tqdm,
                                    desc="unmask loglikelihood_rolling"), targets, strict=True):
            result = self._logprob(prompt, target)
            out.append(result)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, result)
        return out

    def _refuse_mask(self, kind: str, which: str, **parts: list[int]) -> None:
        """The mask token in a request's text would be scored (or decoded) as if it were a
        masked position: an answer for another question, so it is refused, as the engine
        refuses it in a prompt."""
        mask = self.llm.config.mask_token_id
        for part, ids in parts.items():
            if mask in ids:
                token = self.llm.tokenizer.convert_ids_to_tokens(mask)
                raise InputError(f"{kind} {which}: the {part} holds the mask token {token!r} (id "
                                 f"{mask}), which the model reads as a position to fill; remove "
                                 "it from the text")

    def _logprob(self, prompt: list[int], target: list[int]) -> float:
        return self.bound(prompt, target).logprob if target else 0.0

    def bound(self, prompt: list[int], target: list[int]) -> Bound:
        """The estimate of log p(target | prompt) (token ids) by the bound the model is trained
        on: masked-diffusion, or block-diffusion for a model with blocks."""
        estimate = estimate_bound if self.llm.config.block_size is None else estimate_block_bound
        return estimate(self.llm.model, prompt, target, self.llm.config.mask_token_id,
                        mc_num=self.mc_num, batch_size=self.mc_batch_size, seed=self.params.seed)

    def _is_greedy(self, prompt: list[int], target: list[int]) -> bool:
        if not self.greedy_check:
            return False
        if not target:  # nothing to reproduce: as lm-eval's own models answer (an empty match)
            return True
        # A block model decodes in its own blocks: a canvas of whole blocks holding the target,
        # its last block decoded whole, as generation would decode it.
        block = self.llm.config.block_size or len(target)
        params = DecodeParams(method="static-1", gen_length=whole_blocks(len(target), block),
                              block_length=block)
        return self.llm.generate_ids([prompt], params)[0].token_ids[: len(target)] == target

    def _encode(self, text: str, which: str | None = None) -> list[int]:
        """Token ids of text; with `which` (the request), checked first: the tokenizer raises a
        bare TypeError on a lone surrogate."""
        if which is not None:
            check_text(text, f"{which}'s text")
        return self.llm.tokenizer.encode(text, add_special_tokens=False)

    def _bos(self) -> list[int]:
        bos = self.llm.tokenizer.bos_token_id
        return [] if bos is None else [bos]

    def _encode_pair(self, context: str, continuation: str,
                     which: str = "request") -> tuple[list[int], list[int]]:
        """Token ids of (context, continuation), split where the context's tokens end in the
        tokens of the whole text; trailing spaces of the context belong to the continuation.
        The context is cut from the left when the pair does not fit the model's window."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        check_text(context + continuation, f"loglikelihood {which}'s text")  # once, not per encode
        if not context:
            prompt, target = self._bos(), self._encode(continuation)
        else:
            whole, prompt = self._encode(context + continuation), self._encode(context)
            if whole[: len(prompt)] == prompt:
                target = whole[len(prompt) :]
            else:  # the boundary merged into one token: score the continuation's own tokens
                target = self._encode(continuation)
        limit = self.llm.config.max_sequence_length
        if len(target) >= limit:
            raise InputError(f"loglikelihood {which}: a continuation of {len(target)} tokens "
                             f"does not fit the model's max_sequence_length {limit}")
        return prompt[max(0, len(prompt) + len(target) - limit) :], target


# ---------------------------------------------------------------------- helpers


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _which(i: int, req: Instance) -> str:
    """A request as a user can find it: its place in this call, and its task's document."""
    doc = getattr(req, "doc_id", None)
    task = getattr(req, "task_name", None)
    where = ", ".join(x for x in (task, None if doc is None else f"doc {doc}") if x)
    return f"request {i}" + (f" ({where})" if where else "")


def cut_at_stops(text: str, stops: list[str]) -> str:
    """text up to the earliest occurrence of any stop string (empty strings ignored)."""
    cut = min((i for s in stops if s and (i := text.find(s)) >= 0), default=len(text))
    return text[:cut]


def _until(gen_kwargs: dict[str, Any]) -> list[str]:
    until = gen_kwargs.get("until") or []
    if isinstance(until, str):
        return [until]
    if not isinstance(until, list | tuple) or not all(isinstance(s, str) for s in until):
        raise InputError(f"until must be a string or a list of strings, got {until!r}")
    return list(until)


def _spec_value(value: Any) -> Any:
    """A --model_args value as the decoder spec writes it. lm-eval's parser turns `none` into
    None (cache=none, steps=none) and `64.0` into a float, which the spec would read as 'None'
    and refuse as an int."""
    if value is None:
        return "none"
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _positive_int(key: str, value: Any, auto: int | None = None) -> int:
    if auto is not None and isinstance(value, str) and value.startswith("auto"):
        return auto  # lm-eval's batch_size=auto / auto:N
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():  # lm-eval parses `4.0` as a float
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{key} must be a positive integer, got {value!r}")
    return value


def _device(device: str | None) -> str | None:
    """lm-eval passes --device, whose default is cuda:0 even on machines without CUDA."""
    if device and device.startswith("cuda") and not torch.cuda.is_available():
        log.warning("CUDA is not available; unmask runs on cpu instead of %s", device)
        return "cpu"
    return device
