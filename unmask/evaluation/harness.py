"""unmask as an lm-evaluation-harness model, registered as ``unmask``.

    lm_eval --model unmask --model_args pretrained=DIR,decoder=fast,gen_length=256 \
        --tasks unmask_math --include_path unmask/eval_tasks --apply_chat_template

(lm-eval finds this class through the hook in ``_unmask_lm_eval.py``; ``unmask-lm-eval`` imports
it itself.)

``--model_args`` keys: ``pretrained`` (model folder; default the embedded model), ``decoder`` (a
decoder spec NAME; its keys go in as further model args, e.g. ``decoder=threshold,threshold=0.8``),
any decoder key (``gen_length``, ``block_length``, ``seed``, ...), ``dtype``, ``mc_num`` and
``mc_batch_size`` (the likelihood estimate), ``greedy_check``; ``--device``, ``--batch_size``
and ``--max_batch_size`` (a cap on what ``batch_size=auto`` picks) come from lm-eval's own flags.

- ``generate_until``: batches of ``batch_size`` prompts through ``LLM.generate`` with the decoder
  spec. The canvas is the request's ``max_gen_toks`` rounded up to ``block_length`` (the spec's
  ``gen_length`` when the task sets none); the text is cut to ``max_gen_toks`` tokens, then at the
  first ``until`` string. Prompts are used as lm-eval gives them (``chat=False``): with
  ``--apply_chat_template`` lm-eval has already formatted them with the checkpoint's template.
  Sampling follows the decoder spec (``temperature``, ``seed``), not the task's ``do_sample``.
- ``loglikelihood``: the Monte Carlo masked-diffusion bound (``unmask.evaluation.likelihood``),
  ``mc_num`` samples per request. ``is_greedy``: static-1 decoding of a canvas as long as the
  continuation, after the context, reproduces the continuation token for token
  (``greedy_check=false`` skips it and reports False; an empty continuation is greedy).
- ``loglikelihood_rolling``: the same bound for the whole document given only BOS, in one window.
  There is no rolling form of the bound (every position sees the whole window), so a document
  longer than the model's ``max_sequence_length`` is an error, not chunked.
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
from tqdm import tqdm

from unmask.api import LLM, Generation
from unmask.decoding.params import SPEC_KEYS, DecodeParams
from unmask.errors import InputError, UnmaskError
from unmask.evaluation.likelihood import estimate_bound

log = logging.getLogger(__name__)


def _one_line_errors() -> None:
    """Under lm-eval's own command line, bad input of ours (an unknown --model_args key, a bad
    decoder spec, a missing folder) ends the run with one line naming it, as `unmask` and
    `unmask-lm-eval` do, instead of a traceback. Other exceptions, and Python callers, keep
    theirs."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    if name not in ("lm_eval", "lm-eval"):
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
MODEL_KEYS = ("pretrained", "decoder", "device", "dtype", "batch_size", "max_batch_size", "mc_num",
              "mc_batch_size", "greedy_check")
# generate_until kwargs that are honoured; sampling ones are answered by the decoder spec.
GEN_KWARGS = ("until", "max_gen_toks")
SAMPLING_KWARGS = ("do_sample", "temperature", "top_p", "top_k")
GREEDY_KWARGS = {"do_sample": False, "temperature": 0}  # values that ask for greedy decoding


# lm-eval's get_model imports lm_eval.models (its built-in models) only while the registry is
# empty, so registering `unmask` into an empty registry would hide them: hence the import above.
# Where unmask_lm_eval.pth's hook registered the placeholder for this class, this replaces it.
@register_model("unmask")
class UnmaskLM(LM):
    def __init__(self, pretrained: str | None = None, decoder: str = "static-1",
                 device: str | None = None, dtype: str | None = None, batch_size: int | str = 1,
                 max_batch_size: int | None = None, mc_num: int = DEFAULT_MC_NUM,
                 mc_batch_size: int = 32, greedy_check: bool = True, **decoder_keys: Any) -> None:
        super().__init__()
        unknown = [k for k in decoder_keys if k not in SPEC_KEYS]
        if unknown:
            raise InputError(f"unknown --model_args key {unknown[0]!r}; valid: "
                             f"{', '.join(MODEL_KEYS + SPEC_KEYS)}")
        # The spec first: a bad one fails before a model is loaded.
        spec = ",".join([str(decoder)] + [f"{k}={v}" for k, v in decoder_keys.items()])
        self.params = DecodeParams.parse(spec, gen_length=DEFAULT_GEN_LENGTH,
                                         block_length=DEFAULT_BLOCK_LENGTH)
        # lm-eval's --max_batch_size bounds only what batch_size=auto picks, as in its HF model.
        cap = None if max_batch_size is None else _positive_int("max_batch_size", max_batch_size)
        auto = AUTO_BATCH_SIZE if cap is None else min(AUTO_BATCH_SIZE, cap)
        self.batch_size = _positive_int("batch_size", batch_size, auto=auto)
        self.mc_num = _positive_int("mc_num", mc_num)
        self.mc_batch_size = _positive_int("mc_batch_size", mc_batch_size)
        if not isinstance(greedy_check, bool):
            raise InputError(f"greedy_check must be true or false, got {greedy_check!r}")
        self.greedy_check = greedy_check
        self.llm = LLM(pretrained, device=_device(device), dtype=dtype)
        self._device = self.llm.device
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
        by_canvas: dict[int, list[int]] = defaultdict(list)
        limits: list[int] = []
        window = self.llm.config.max_sequence_length
        for i, req in enumerate(requests):
            limit = self._max_gen_toks(req.args[1])
            limits.append(limit)
            canvas = self.params.canvas_for(limit)
            if canvas >= window:  # named here: the engine would blame a gen_length nobody set
                key = "gen_length" if req.args[1].get("max_gen_toks") is None else "max_gen_toks"
                raise InputError(f"{key} {limit} (a canvas of {canvas}: a multiple of block_length "
                                 f"{self.params.block_length}) leaves no room for the prompt in the "
                                 f"model's max_sequence_length {window}; valid: the canvas plus the "
                                 f"prompt's tokens <= {window}")
            by_canvas[canvas].append(i)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="unmask generate_until")
        for canvas, idxs in by_canvas.items():
            params = self.params.replace(gen_length=canvas)
            for start in range(0, len(idxs), self.batch_size):
                chunk = idxs[start : start + self.batch_size]
                gens = self.llm.generate([requests[i].args[0] for i in chunk], params, chat=False,
                                         batch_size=len(chunk))
                for i, g in zip(chunk, gens, strict=True):
                    text = cut_at_stops(self._text(g, limits[i]), _until(requests[i].args[1]))
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(chunk))
        bar.close()
        return [t for t in out if t is not None]

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
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="unmask loglikelihood"):
            context, continuation = req.args
            prompt, target = self._encode_pair(context, continuation)
            result = (self._logprob(prompt, target), self._is_greedy(prompt, target))
            out.append(result)
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return out

    def loglikelihood_rolling(self, requests: list[Instance],
                              disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="unmask loglikelihood_rolling"):
            (text,) = req.args
            prompt, target = self._bos(), self._encode(text)
            room = self.llm.config.max_sequence_length - len(prompt)
            if len(target) > room:
                raise InputError(
                    f"loglikelihood_rolling: a document of {len(target)} tokens exceeds the "
                    f"model's window ({room} after BOS); the masked-diffusion bound scores a "
                    "document in one window and has no rolling (chunked) form")
            result = self._logprob(prompt, target)
            out.append(result)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, result)
        return out

    def _logprob(self, prompt: list[int], target: list[int]) -> float:
        if not target:
            return 0.0
        return estimate_bound(self.llm.model, prompt, target, self.llm.config.mask_token_id,
                              mc_num=self.mc_num, batch_size=self.mc_batch_size,
                              seed=self.params.seed).logprob

    def _is_greedy(self, prompt: list[int], target: list[int]) -> bool:
        if not self.greedy_check:
            return False
        if not target:  # nothing to reproduce: as lm-eval's own models answer (an empty match)
            return True
        params = DecodeParams(method="static-1", gen_length=len(target), block_length=len(target))
        return self.llm.generate_ids([prompt], params)[0].token_ids == target

    def _encode(self, text: str) -> list[int]:
        return self.llm.tokenizer.encode(text, add_special_tokens=False)

    def _bos(self) -> list[int]:
        bos = self.llm.tokenizer.bos_token_id
        return [] if bos is None else [bos]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of (context, continuation), split where the context's tokens end in the
        tokens of the whole text; trailing spaces of the context belong to the continuation.
        The context is cut from the left when the pair does not fit the model's window."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
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
            raise InputError(f"a continuation of {len(target)} tokens does not fit the model's "
                             f"max_sequence_length {limit}")
        return prompt[max(0, len(prompt) + len(target) - limit) :], target


# ---------------------------------------------------------------------- helpers


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


def _positive_int(key: str, value: Any, auto: int | None = None) -> int:
    if auto is not None and isinstance(value, str) and value.startswith("auto"):
        return auto  # lm-eval's batch_size=auto / auto:N
    if isinstance(value, str) and value.strip().isdigit():
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
