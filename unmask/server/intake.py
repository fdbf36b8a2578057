"""What a request body becomes before it reaches the engine: the checks that can be made
before tokenizing (cheap, on the event loop), its token ids (on a worker thread) and its
decoder parameters. The engine's own checks of the ids come after, at the door
(EngineClient.submit)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.concurrency import run_in_threadpool

from unmask.api import LLM
from unmask.decoding.grammar import (
    Constraint,
    ResponseFormat,
    as_format,
    check_decoder,
    with_prior,
)
from unmask.decoding.params import DecodeParams, whole_blocks
from unmask.errors import SpecError, UnmaskError
from unmask.server.engine_client import Submission
from unmask.server.errors import APIError
from unmask.server.protocol import ChatCompletionRequest, CompletionRequest, _Common
from unmask.server.state import ServerConfig, ServerState


def check_request(state: ServerState, body: _Common) -> list[str] | list[list[int]]:
    """Refuse what can be refused before tokenizing; a completion's prompts."""
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_error")
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                            f"{state.model_name!r}", param="model")
    body.check_supported()  # a FieldError: a 400 naming the field
    n = state.llm.config.max_sequence_length
    if body.max_tokens is not None and body.max_tokens > n:
        # No prompt fits beside it: refused by the field that set it, before a spec is built.
        name = max_tokens_field(body)
        raise APIError(400, f"{name} is {body.max_tokens}; this model's max_sequence_length is "
                            f"{n} tokens, prompt and completion together", param=name)
    if isinstance(body, CompletionRequest):
        prompts = body.prompts()
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                check_prompt_chars(state, len(p), body.prompt_field(i))
        return prompts
    if isinstance(body, ChatCompletionRequest):
        if len(body.messages) > n:  # each message renders to a token or more (its role marker)
            raise APIError(400, f"{len(body.messages)} messages cannot fit the model's "
                                f"max_sequence_length {n} tokens; the limit is {n} messages",
                           param="messages")
        chars = sum(len(m.text()) + len(m.name or "") for m in body.messages)
        check_prompt_chars(state, chars, "messages")
    return []


def check_prompt_chars(state: ServerState, chars: int, field: str) -> None:
    """Refuse a prompt too long to fit max_sequence_length tokens, by its characters: cheap, where
    tokenizing it would cost time in proportion to its length."""
    n = state.llm.config.max_sequence_length
    limit = n * state.chars_per_token
    if chars > limit:
        raise APIError(400, f"{field} has {chars} characters; the limit is {limit} "
                            f"(max_sequence_length {n} tokens x {state.chars_per_token} "
                            f"characters, the longest token in the vocabulary)", param=field)


def max_tokens_field(body: _Common) -> str:
    """The field that set max_tokens (chat's check_supported copies max_completion_tokens)."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"



def encode_prompt(llm: LLM, prompt: str | list[int], chat: bool, field: str = "prompt") -> list[int]:
    """Token ids of a prompt (blocking: call it off the event loop, with run_in_threadpool)."""
    if isinstance(prompt, list):  # token ids: the engine checks them (non-empty, in the vocabulary)
        return prompt
    try:
        return llm.encode_prompt(prompt, chat=chat)
    except UnmaskError as e:
        raise APIError(400, str(e), param=field) from None


def encode_chat(llm: LLM, messages: list[dict]) -> list[int]:
    """Token ids of a chat through the template (blocking: call it off the event loop)."""
    tok = llm.tokenizer
    if not tok.chat_template:
        raise APIError(400, "this checkpoint has no chat template; use /v1/completions",
                       param="messages")
    if not any(m["content"].strip() for m in messages):
        raise APIError(400, "empty messages: give the model something to answer", param="messages")
    try:
        return llm.encode_messages(messages)
    except UnmaskError as e:
        raise APIError(400, str(e), param="messages") from None


def request_params(config: ServerConfig, body: _Common, defaults: dict | None = None) -> DecodeParams:
    """The request's decoder: its `decoder` spec (or the server's), with max_tokens (rounded up
    to block_length), temperature, seed and top_p from the request. Against the server's default spec
    the request's fields win; in a spec the request wrote itself, a conflict is an error.
    defaults: the model's (unmask.engine.layout.model_defaults), under the spec's keys."""
    defaults = defaults or {}
    # "" is an empty spec (a 400, as --decoder ''), not a request for the server's
    spec = config.decoder if body.decoder is None else body.decoder
    try:
        fields: dict[str, Any] = {}
        if body.max_tokens is not None:  # the canvas first: steps are checked against it
            block = DecodeParams.block_length_of(spec, **defaults)
            fields["gen_length"] = whole_blocks(body.max_tokens, block)
        base = DecodeParams.parse(spec, **{**defaults, **fields})
        if body.temperature is not None:
            fields["temperature"] = body.temperature
        if body.seed is not None:
            fields["seed"] = body.seed
        if body.top_p is not None and body.top_p < 1:  # 1 is off: clients send it by default
            fields["top_p"] = body.top_p
        if body.decoder is None:
            return base.replace(**fields, name=base.spec) if fields else base
        return DecodeParams.parse(spec, explicit=fields, **defaults)
    except SpecError as e:  # named by the request's field where the error is about one it set
        field = {"gen_length": "max_tokens"}.get(e.key, e.key)
        raise APIError(400, str(e), param=field if field in body.model_fields_set else "decoder"
                       ) from None
    except UnmaskError as e:
        raise APIError(400, str(e), param="decoder") from None



def submissions(body: _Common, ids: list[list[int]], params: list[DecodeParams],
                fields: list[str], constraint: Constraint | None = None) -> list[Submission]:
    """The engine requests of a request: prompt ids, decoder, the fields an error names, and
    its structured-output constraint (the same for every choice)."""
    length = max_tokens_field(body) if body.max_tokens is not None else None
    kind = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
    return [Submission(p, q, f, length, kind, constraint)
            for p, q, f in zip(ids, params, fields, strict=True)]


async def constraint_of(state: ServerState, body: _Common, params: DecodeParams
                        ) -> Constraint | None:
    """`request_constraint` on a worker thread, for a request that asks for one. Most ask for
    none, and the hop would cost each of them the worker's and then the event loop's turns at
    the interpreter lock, several milliseconds before it reaches the engine when many streams
    are running (benchmarks/probe/ttft-anatomy.md)."""
    if body.constraint_field() is None and body.length_penalty is None:
        return None
    return await run_in_threadpool(request_constraint, state, body, params)


def request_constraint(state: ServerState, body: _Common, params: DecodeParams
                       ) -> Constraint | None:
    """The request's structured-output constraint over its max_tokens (compiling a schema can
    take a while: called off the event loop), or a 400 naming the field that set it: an invalid
    schema or regex, an unsupported schema feature, a bad length prior weight, or a decoder
    that cannot honour it."""
    fmt = request_format(body)
    if fmt is None:
        return None
    with _named(body.constraint_field()):
        constraint = state.llm.constraint(fmt, body.max_tokens or params.gen_length)
        check_decoder(constraint, state.engine.engine.params_for(params))
    return constraint


def request_format(body: _Common) -> ResponseFormat | None:
    """The request's response format with its `length_penalty` (None: no constraint), or a
    400 naming the field at fault."""
    name = body.constraint_field()
    fmt = None
    if name is not None:
        with _named(name):
            value = getattr(body, name)
            fmt = as_format(value) if name == "response_format" else ResponseFormat.regex(value)
    with _named("length_penalty"):
        return with_prior(fmt, body.length_penalty)


@contextmanager
def _named(field: str | None) -> Iterator[None]:
    """An UnmaskError inside becomes a 400 naming `field`."""
    try:
        yield
    except UnmaskError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None
