"""`unmask serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (and
/v1/models/{id}), GET /health, GET /metrics. Requests join the engine's running batch at its
next step and leave when done (continuous batching); each request's tokens are those it would
get alone (batch invariance).

A completion's canvas is `max_tokens` rounded up to the decoder's block_length; the text ends at
the first EOS (finish_reason "stop") or at the canvas end ("length"). A stop string cuts the text
before it, and decoding stops as soon as it is committed. Streaming sends the committed prefix
as it grows: text is never retracted or reordered.

Tokenizing and chat templating run on a worker thread: their cost grows with the prompt, and on
the event loop one long prompt would stall every stream and /health. Bounds keep that cost and a
request's footprint in the engine finite: a body size (413), prompts per request, characters per
prompt (a longer prompt could not fit max_sequence_length tokens) and chat messages (400s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from unmask.api import LLM, useful_length
from unmask.decoding.params import DEFAULT_DECODER, DecodeParams
from unmask.engine import Engine, SchedulerConfig, StepEvent
from unmask.engine import Request as EngineRequest
from unmask.engine.scheduler import QueueFull
from unmask.errors import CanvasTooLong, InputError, SpecError, UnmaskError
from unmask.server.async_engine import EngineThread, Handle
from unmask.server.metrics import ServerMetrics
from unmask.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    _Common,
    error_body,
)

log = logging.getLogger("unmask.server")

# Request bodies past this are refused (413) before they are read: JSON parsing and validation
# run on the event loop (about 5 ms per MB of text, 50 ms per MB of token ids). Valid requests
# are far smaller: 64 prompts at the default model's character limit are 4.3 MB of ASCII, and
# 64 prompts of 2,048 token ids under 1 MB.
MAX_BODY_BYTES = 8 << 20


@dataclass
class ServerConfig:
    decoder: str = DEFAULT_DECODER  # default decoder spec of requests that name none
    max_running: int = 16
    max_queue: int = 256
    max_slots: int | None = None
    model_name: str | None = None  # the id /v1/models reports (default: the folder's name)
    retry_after: int = 1  # seconds, sent with 429
    max_body_bytes: int = MAX_BODY_BYTES  # a larger request body is a 413

    def __post_init__(self) -> None:
        DecodeParams.parse(self.decoder)  # a bad default spec fails at startup, not per request
        n = self.max_body_bytes
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):  # True is no size
            raise InputError(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")


@dataclass
class ServerState:
    llm: LLM
    config: ServerConfig
    engine: EngineThread
    metrics: ServerMetrics
    model_name: str
    chars_per_token: int  # the most characters one token can stand for (_check_prompt_chars)
    draining: bool = False
    started: float = field(default_factory=time.time)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 before the app parses it.

    A declared Content-Length is checked before anything is read. A chunked body (no length) is
    read here up to the limit and handed on as one message, or refused once it passes it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                await self._refuse(f"of {length} bytes ", scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if "chunked" not in headers.get("transfer-encoding", "").lower():
            await self.app(scope, receive, send)  # no body
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse("", scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks),
                                "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()  # after the body: the disconnect the handlers watch for

        await self.app(scope, replay, send)

    async def _refuse(self, size: str, scope: Scope, receive: Receive, send: Send) -> None:
        mib = self.limit / (1 << 20)
        response = JSONResponse(error_body(
            f"request body {size}exceeds this server's limit of {self.limit} bytes "
            f"({mib:g} MiB)", "invalid_request_error"), 413)
        await response(scope, receive, send)


async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    """The router's own errors (no such route, a method the route lacks), in the OpenAI error
    body every other error has, so a client's error handling sees one shape. Also the Ray
    ingress's handler (ray_serve.py)."""
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
        message = (f"Invalid URL ({where}): no such route; GET /openapi.json lists this "
                   f"server's routes")
    elif e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        message = f"method {request.method} is not allowed for {request.url.path}" + (
            f"; allowed: {allowed}" if allowed else "")
    else:
        message = f"{where}: {e.detail}"
    kind = "server_error" if e.status_code >= 500 else "invalid_request_error"
    return JSONResponse(error_body(message, kind), e.status_code, headers=e.headers)


# --- text of a decode in progress --------------------------------------------------------------
class TextStream:
    """The committed prefix of one request as text: what may be sent now, and when to stop.

    Text up to the first EOS, cut before the first stop string. While decoding, the text is held
    back where it could still change: an incomplete character at the end, or an end that could
    be the start of a stop string.
    """

    def __init__(self, llm: LLM, gen_length: int, stops: list[str] | None) -> None:
        self.llm, self.stops = llm, stops or []
        self.eos = llm.config.eos_token_id
        self.tokens: list[int | None] = [None] * gen_length
        self.sent = ""
        self.stop_hit = False
        self.n_tokens = 0  # generated tokens behind the text (up to EOS or the stop)

    def update(self, ev: StepEvent) -> str:
        """Apply a step's commits; return the new text that is safe to send."""
        for pos, tok in zip(ev.positions, ev.tokens, strict=True):
            self.tokens[pos] = tok
        text, final = self._text(self.tokens[: ev.prefix])
        if not final:
            text = self._hold_back(text)
        return self._advance(text)

    def finish(self, token_ids: list[int] | None) -> str:
        """The rest of the text once the request has finished (token_ids: its final canvas;
        None when it was stopped: the committed prefix is final)."""
        if token_ids is not None and not self.stop_hit:
            self.tokens = list(token_ids)
        prefix = self.tokens
        first_gap = next((i for i, t in enumerate(prefix) if t is None), len(prefix))
        text, _ = self._text(prefix[:first_gap])
        return self._advance(text)

    def _text(self, ids: list[int | None]) -> tuple[str, bool]:
        """(text, final): final once an EOS or a stop string ends the text."""
        ids = [t for t in ids if t is not None]
        n = useful_length(ids, self.eos)
        text = self.llm.detokenize(ids[:n])
        final = n < len(ids)
        # A stop can begin only in unsent text: the sent text never ends where one could begin
        # (_hold_back), and the committed prefix's text only grows. So each step searches the
        # new text, not all of it (whole-text searches cost O(text) a step, O(text^2) a request).
        # The stop that ends first wins (ties: the one that starts first), as it would for text
        # written left to right: where it ends is fixed by the text, not by how many characters
        # a step committed, so decoders that commit the same tokens in other steps (exact and
        # static-1) give the same answer.
        start = len(self.sent)
        found = [(i + len(s), i) for s in self.stops if (i := text.find(s, start)) >= 0]
        cut = min(found)[1] if found else -1
        if cut >= 0:
            text, final, self.stop_hit = text[:cut], True, True
            self.n_tokens = len(self.llm.tokenizer.encode(text, add_special_tokens=False))
        else:
            self.n_tokens = n
        return text, final

    def _hold_back(self, text: str) -> str:
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence at the end
        keep = len(text)
        for s in self.stops:
            # The longest end of the text that begins s (and is shorter: no stop is in the
            # text): its start j is s[0] in the unsent text (an earlier step held back any that
            # began before), and s.startswith(text[j:]). Each step tries the places where
            # s[0] occurs, not every length up to len(s) with a slice of s apiece, which cost
            # ~4 ms a step for a stop of 9,000 characters.
            j = text.find(s[0], max(len(self.sent), len(text) - len(s) + 1))
            while 0 <= j < keep:
                if s.startswith(text[j:]):
                    keep = j
                    break
                j = text.find(s[0], j + 1)
        return text[:keep]

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # never retract: wait until it extends what was sent
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


# --- the app -------------------------------------------------------------------------------------
def build_app(llm: LLM, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = ServerMetrics()
    engine = Engine(llm.model, SchedulerConfig(max_running=config.max_running,
                                               max_queue=config.max_queue,
                                               max_slots=config.max_slots))

    def on_step(events: list[StepEvent]) -> None:
        metrics.engine_totals(engine.model_calls, engine.token_forwards)
        metrics.queue_depth.set(engine.n_waiting)
        metrics.running.set(engine.n_running)

    thread = EngineThread(engine, on_step)
    # A vocabulary entry is at least as long as the text its token decodes to (byte-level BPE:
    # one character per byte; SentencePiece: one per character; WordPiece adds "##"), so no
    # token covers more characters than the longest entry.
    chars_per_token = max(len(t) for t in llm.tokenizer.get_vocab())
    state = ServerState(llm, config, thread, metrics, config.model_name or llm.path.name,
                        chars_per_token)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        thread.start()
        yield
        state.draining = True
        thread.stop()

    app = FastAPI(title="unmask", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for diffusion language models")
    app.state.unmask = state
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.kind, e.param), e.status, headers=e.headers)

    app.add_exception_handler(HTTPException, http_error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        # an unknown field's own name is what the client wrote, whatever characters it has
        loc, union = _param_path(first.get("loc", ()), first.get("type") != "extra_forbidden")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "request body is not valid JSON", ""
        elif tuple(first.get("loc", ())) == ("body",):  # no JSON object at all
            msg, loc = _body_problem(first, request.headers.get("content-type")), ""
        elif first.get("type") == "extra_forbidden":
            msg = f"unknown field {loc!r}"
        elif union:  # the first member's complaint ("should be a valid string") misleads
            msg = _UNION_HINTS.get(re.sub(r"\[\d+\]", "[]", loc), "none of the accepted types")
        text = f"{loc}: {msg}" if loc else msg
        return JSONResponse(error_body(text, "invalid_request_error", loc or None), 400)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine.error is not None or not state.engine.alive:
            return JSONResponse({"status": "engine stopped"}, 503)
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok", "running": engine.n_running,
                             "waiting": engine.n_waiting})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": int(state.started),
                "owned_by": "unmask"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")  # :path: an id may contain "/" (org/name)
    async def model(model: str) -> dict:
        if model != state.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{state.model_name!r}", param="model")
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts = _check(state, body)
        _check_capacity(state, len(prompts) * body.n, "choices")
        ids = []
        for i, p in enumerate(prompts):
            ids.append(await run_in_threadpool(_encode, llm, p, False, body.prompt_field(i)))
            if await request.is_disconnected():  # tokenizing many long prompts takes seconds
                return Response(status_code=499)
        return await _respond(state, body, ids, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check(state, body)
        _check_capacity(state, body.n, "choices")
        messages = [m.for_template() for m in body.messages]
        ids = [await run_in_threadpool(_encode_chat, llm, messages)]
        return await _respond(state, body, ids, request, chat=True)

    from unmask.server.live import add_live_routes  # it imports this module's helpers
    add_live_routes(app, state)
    return app


def _check(state: ServerState, body: _Common) -> list[str] | list[list[int]]:
    """Refuse what can be refused before tokenizing; a completion's prompts."""
    if state.draining:
        raise APIError(503, "the server is shutting down", "server_error")
    if body.model is not None and body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                            f"{state.model_name!r}", param="model")
    try:
        body.check_supported()
    except FieldError as e:
        raise APIError(400, str(e), param=e.field) from None
    n = state.llm.config.max_sequence_length
    if body.max_tokens is not None and body.max_tokens > n:
        # No prompt fits beside it: refused by the field that set it, before a spec is built.
        name = _max_tokens_field(body)
        raise APIError(400, f"{name} is {body.max_tokens}; this model's max_sequence_length is "
                            f"{n} tokens, prompt and completion together", param=name)
    if isinstance(body, CompletionRequest):
        prompts = body.prompts()
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                _check_prompt_chars(state, len(p), body.prompt_field(i))
        return prompts
    if isinstance(body, ChatCompletionRequest):
        if len(body.messages) > n:  # each message renders to a token or more (its role marker)
            raise APIError(400, f"{len(body.messages)} messages cannot fit the model's "
                                f"max_sequence_length {n} tokens; the limit is {n} messages",
                           param="messages")
        _check_prompt_chars(state, sum(len(m.text()) + len(m.name or "") for m in body.messages),
                            "messages")
    return []


# pydantic names a union's member in an error's location ("prompt.list[int].0", "stop.str"):
# these are type tags, not fields a client wrote.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "nullable"})
_UNION_HINTS = {
    "prompt": "expected a string, a list of strings, a list of token ids (integers) or a list "
              "of lists of token ids",
    "stop": "expected a string or a list of up to 4 strings",
    "messages[].content": 'expected a string or a list of content parts ({"type": "text", '
                          '"text": ...})',
}


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "true or false", type(None): "null"}


def _body_problem(err: dict, content_type: str | None) -> str:
    """What is wrong with a request body that is no JSON object (pydantic's words were "Field
    required" and "Input should be a valid dictionary")."""
    if err.get("type") == "missing":
        return "request body is empty: send a JSON object (content-type: application/json)"
    body = err.get("input")
    if isinstance(body, bytes):  # FastAPI parses JSON only when the content-type says so
        return (f"request body must be JSON sent with content-type: application/json, not "
                f"{content_type or 'no content-type'} (curl -d needs -H 'content-type: "
                f"application/json')")
    return f"request body must be a JSON object, not {_JSON_TYPES.get(type(body), 'that')}"


def _param_path(loc: tuple | list, tags: bool = True) -> tuple[str, bool]:
    """An error location as the field a client wrote (`messages[0].content`, as the server's own
    errors name fields), and whether it ends at a union whose members all failed (`tags`: the
    location may hold union member tags)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif tags and (part in _TYPE_TAGS or any(c in part for c in "[]()-,")):
            return out, True
        else:
            out += f".{part}" if out else part
    return out, False


def _check_prompt_chars(state: ServerState, chars: int, field: str) -> None:
    """Refuse a prompt too long to fit max_sequence_length tokens, by its characters: cheap, where
    tokenizing it would cost time in proportion to its length."""
    n = state.llm.config.max_sequence_length
    limit = n * state.chars_per_token
    if chars > limit:
        raise APIError(400, f"{field} has {chars} characters; the limit is {limit} "
                            f"(max_sequence_length {n} tokens x {state.chars_per_token} "
                            f"characters, the longest token in the vocabulary)", param=field)


def _max_tokens_field(body: _Common) -> str:
    """The field that set max_tokens (chat's check_supported copies max_completion_tokens)."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens"


def _check_ids(state: ServerState, ids: list[list[int]], params: list[DecodeParams],
               fields: list[str], body: _Common) -> None:
    """The engine's refusal of any prompt (Engine.check_prompt: empty, ids outside the
    vocabulary, too long for its canvas), for all of them before any is submitted: a request
    refused for its third prompt must not first start decoding (and count as aborted) its
    first two."""
    for p, q, where in zip(ids, params, fields, strict=True):
        try:
            state.engine.engine.check_prompt(p, q)
        except CanvasTooLong as e:
            param = _max_tokens_field(body) if body.max_tokens is not None else where
            raise APIError(400, str(e), param=param) from None
        except InputError as e:
            raise APIError(400, f"{where}: {e}", param=where) from None


def _check_capacity(state: ServerState, n: int, what: str) -> None:
    """A request of n engine requests that the engine could never hold at once is a 400 (a 429
    would ask the client to retry something that cannot succeed)."""
    c = state.config
    most = c.max_running + c.max_queue
    if n > most:
        raise APIError(400, f"{n} {what} in one request can never be admitted together: this "
                            f"server holds at most {most} requests (--max-running "
                            f"{c.max_running} decoding + --max-queue {c.max_queue} waiting); send "
                            f"at most {most} per request")


def _check_slots(state: ServerState, ids: list[list[int]], params: list[DecodeParams],
                 what: str) -> None:
    """_check_capacity once the prompts are tokenized: under --max-slots an idle server may run
    fewer than --max-running of them at once, and past those and --max-queue waiting the rest
    would get a 429 that no retry cures. Counted by the scheduler's own accounting, in the order
    they are submitted."""
    c = state.config
    if c.max_slots is None:
        return
    scheduler = state.engine.engine.scheduler  # admitted_when_idle reads none of its queues
    reqs = [EngineRequest(p, q) for p, q in zip(ids, params, strict=True)]
    for r in reqs:  # one that could never run even alone: say so before submitting any
        try:
            scheduler.check_fits(r)
        except InputError as e:
            raise APIError(400, str(e)) from None
    at_once = scheduler.admitted_when_idle(reqs)
    most = at_once + c.max_queue
    if len(reqs) > most:
        raise APIError(400, f"{len(reqs)} {what} in one request can never be admitted together: "
                            f"under --max-slots {c.max_slots} (each holds prompt + gen_length "
                            f"slots, padded to the longest of its decoder batch) an idle server "
                            f"runs {at_once} of them at once, and --max-queue {c.max_queue} more "
                            f"can wait; send at most {most} per request, or shorter prompts or "
                            f"max_tokens")


def _encode(llm: LLM, prompt: str | list[int], chat: bool, field: str = "prompt") -> list[int]:
    """Token ids of a prompt (blocking: call it off the event loop, with run_in_threadpool)."""
    if isinstance(prompt, list):  # token ids: the engine checks them (non-empty, in the vocabulary)
        return prompt
    try:
        return llm.encode_prompt(prompt, chat=chat)
    except UnmaskError as e:
        raise APIError(400, str(e), param=field) from None


def _encode_chat(llm: LLM, messages: list[dict]) -> list[int]:
    """Token ids of a chat through the template (blocking: call it off the event loop)."""
    tok = llm.tokenizer
    if not tok.chat_template:
        raise APIError(400, "this checkpoint has no chat template; use /v1/completions",
                       param="messages")
    if not any(m["content"].strip() for m in messages):
        raise APIError(400, "empty messages: give the model something to answer", param="messages")
    try:
        text = llm.render_chat(messages)
    except UnmaskError as e:
        raise APIError(400, str(e), param="messages") from None
    return tok.encode(text, add_special_tokens=False)


def request_params(config: ServerConfig, body: _Common) -> DecodeParams:
    """The request's decoder: its `decoder` spec (or the server's), with max_tokens (rounded up
    to block_length), temperature, seed and top_p from the request. Against the server's default spec
    the request's fields win; in a spec the request wrote itself, a conflict is an error."""
    # "" is an empty spec (a 400, as --decoder ''), not a request for the server's
    spec = config.decoder if body.decoder is None else body.decoder
    try:
        base = DecodeParams.parse(spec)
        fields: dict[str, Any] = {}
        if body.max_tokens is not None:
            fields["gen_length"] = base.canvas_for(body.max_tokens)
        if body.temperature is not None:
            fields["temperature"] = body.temperature
        if body.seed is not None:
            fields["seed"] = body.seed
        if body.top_p is not None and body.top_p < 1:  # 1 is off: clients send it by default
            fields["top_p"] = body.top_p
        if body.decoder is None:
            return base.replace(**fields, name=base.spec) if fields else base
        return DecodeParams.parse(spec, explicit=fields)
    except SpecError as e:  # named by the request's field where the error is about one it set
        field = {"gen_length": "max_tokens"}.get(e.key, e.key)
        raise APIError(400, str(e), param=field if field in body.model_fields_set else "decoder"
                       ) from None
    except UnmaskError as e:
        raise APIError(400, str(e), param="decoder") from None


async def _submit(state: ServerState, ids: list[int], params: DecodeParams,
                  trace: bool = False) -> Handle:
    if state.engine.error is not None:
        raise APIError(503, "the engine has stopped; see the server log", "server_error")
    try:
        return await state.engine.submit(ids, params, f"cmpl-{uuid.uuid4().hex}", trace)
    except QueueFull as e:
        state.metrics.requests.labels("rejected").inc()
        raise APIError(429, str(e), "rate_limit_error",
                       headers={"Retry-After": str(state.config.retry_after)}) from None
    except InputError as e:
        raise APIError(400, str(e)) from None


@dataclass
class _Run:
    """One engine request of a response, and what has been sent of it."""

    index: int
    handle: Handle
    text: TextStream
    prompt_tokens: int
    first_text: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    outcome: str | None = None
    counted: bool = False  # its metrics were recorded

    @property
    def request(self):
        return self.handle.request


async def _respond(state: ServerState, body: _Common, ids: list[list[int]], request: Request,
                   chat: bool) -> Response:
    params = request_params(state.config, body)
    fields = ([body.prompt_field(i) for i in range(len(ids))] if isinstance(body, CompletionRequest)
              else ["messages"])
    _check_ids(state, ids, [params] * len(ids), fields, body)
    # choice i * n + j: prompt i with seed + j, as OpenAI orders a list of prompts' n choices
    # (j = 0 is the answer the prompt gets with n = 1; the n share a decoder batch)
    seeded = [params] + [params.replace(seed=(params.seed + j) % (1 << 63), name=params.spec)
                         for j in range(1, body.n)]
    choices = [(p, q, j) for p in ids for j, q in enumerate(seeded)]
    _check_slots(state, [p for p, _, _ in choices], [q for _, q, _ in choices], "choices")
    runs: list[_Run] = []
    try:
        for i, (p, q, j) in enumerate(choices):
            # Each submit waits for the engine's step in flight: a client that leaves while a
            # list is being submitted must stop the rest, not leave them to be decoded.
            if await request.is_disconnected():
                break
            h = await _submit(state, p, q)
            # usage counts a prompt's tokens once, however many choices it has (as OpenAI's)
            runs.append(_Run(i, h, TextStream(state.llm, q.gen_length, body.stop),
                             len(p) if j == 0 else 0))
    except BaseException:
        _abort(state, runs)
        raise
    if len(runs) < len(choices):
        _abort(state, runs)
        return Response(status_code=499)
    rid = runs[0].request.request_id
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _stream(state, runs, request, chat, rid, params, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    texts = ["" for _ in runs]
    try:
        await asyncio.gather(*(_collect(state, r, request, texts) for r in runs))
    finally:
        for r in runs:
            _finish_metrics(state, r)
    failed = [r for r in runs if r.error]
    if failed:
        raise APIError(500, f"the request failed in the engine: {failed[0].error}", "server_error")
    if any(r.finish_reason is None for r in runs):  # the client left: nobody reads this
        return Response(status_code=499)
    choices = []
    for r, text in zip(runs, texts, strict=True):
        if chat:
            choices.append({"index": r.index, "message": {"role": "assistant", "content": text},
                            "finish_reason": r.finish_reason, "logprobs": None})
        else:
            choices.append({"index": r.index, "text": text, "finish_reason": r.finish_reason,
                            "logprobs": None})
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": state.model_name, "choices": choices,
        "usage": _usage(runs), "unmask": _extra(runs, params)})


async def _events(state: ServerState, run: _Run, request: Request) -> AsyncIterator[str]:
    """Yield the text deltas of one run until it finishes; aborts it if the client leaves."""
    q = run.handle.events
    done = False
    checked = time.monotonic()
    try:
        while True:
            try:
                ev = await asyncio.wait_for(q.get(), timeout=0.25)
            except asyncio.TimeoutError:
                ev = None
            # Events may arrive every few milliseconds: look for a client that left on a clock,
            # not only when the queue is quiet.
            if ev is None or time.monotonic() - checked > 0.25:
                checked = time.monotonic()
                if await request.is_disconnected():
                    return
            if ev is None:
                continue
            if ev.finished:
                done = True
                if ev.finished == "error":
                    run.error, run.outcome = ev.error or "unknown error", "error"
                    return
                stopped = ev.finished == "stop" or run.text.stop_hit
                delta = run.text.update(ev) if ev.positions else ""
                delta += run.text.finish(None if stopped else run.request.token_ids)
                run.finish_reason = "stop" if stopped or ev.finished == "eos" else "length"
                run.outcome = run.finish_reason
                if delta:
                    _first(run)
                    yield delta
                return
            delta = run.text.update(ev)
            if run.text.stop_hit:  # committed: stop decoding now
                state.engine.abort(run.request.request_id, "stop")
            if delta:
                _first(run)
                yield delta
    finally:
        if not done:
            run.outcome = "abort"
            state.engine.abort(run.request.request_id)


def _abort(state: ServerState, runs: list[_Run]) -> None:
    """Abort runs that were submitted but will not be read (and count them)."""
    for r in runs:
        state.engine.abort(r.request.request_id)
        r.outcome = "abort"
        _finish_metrics(state, r)


def _first(run: _Run) -> None:
    if run.first_text is None:
        run.first_text = time.perf_counter()


async def _collect(state: ServerState, run: _Run, request: Request, texts: list[str]) -> None:
    async for delta in _events(state, run, request):
        texts[run.index] += delta


async def _stream(state: ServerState, runs: list[_Run], request: Request, chat: bool, rid: str,
                  params: DecodeParams, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int, text: str | None, finish: str | None, role: bool = False) -> str:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish,
                                      "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish,
                      "logprobs": None}
        payload = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                   "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload)}\n\n"

    out: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(run: _Run) -> None:
        try:
            async for delta in _events(state, run, request):
                await out.put((run.index, delta))
        finally:
            await out.put((run.index, None))

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        if chat:
            for r in runs:
                yield chunk(r.index, "", None, role=True)
        open_runs = len(runs)
        while open_runs:
            index, delta = await out.get()
            run = runs[index]
            if delta is None:
                open_runs -= 1
                if run.error:
                    err = error_body(f"the request failed in the engine: {run.error}",
                                     "server_error")
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                if run.finish_reason is not None:
                    yield chunk(index, None if chat else "", run.finish_reason)
                continue
            yield chunk(index, delta, None)
        if include_usage:
            payload = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                       "choices": [], "usage": _usage(runs), "unmask": _extra(runs, params)}
            yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for r in runs:
            if r.finish_reason is None and not r.error:
                state.engine.abort(r.request.request_id)
                r.outcome = r.outcome or "abort"
            _finish_metrics(state, r)


def _usage(runs: list[_Run]) -> dict[str, int]:
    prompt = sum(r.prompt_tokens for r in runs)
    completion = sum(r.text.n_tokens for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _extra(runs: list[_Run], params: DecodeParams) -> dict[str, Any]:
    """unmask's own numbers (docs/design.md § Metrics), summed over the response's choices."""
    nfe = sum(r.request.nfe for r in runs)
    decided = sum(r.request.decided for r in runs)
    return {"decoder": params.spec, "nfe": nfe, "token_forwards": sum(r.request.token_forwards
                                                                     for r in runs),
            "tpf": decided / nfe if nfe else 0.0,
            "seconds": max((r.request.seconds for r in runs), default=0.0)}


def _finish_metrics(state: ServerState, run: _Run) -> None:
    if run.counted:
        return
    run.counted = True
    req = run.request
    m = state.metrics
    m.finished(run.outcome or "abort", req.nfe, req.decided, run.text.n_tokens)
    m.latency.observe(time.perf_counter() - run.handle.submitted)
    if run.first_text is not None:
        m.ttft.observe(run.first_text - run.handle.submitted)
