"""POST /v1/completions and POST /v1/chat/completions: a request's prompts through the door
(EngineClient.submit), then the answer as one JSON body or as server-sent events.

Each prompt with each of its n choices is one engine request; choice i * n + j is prompt i with
seed + j, as OpenAI orders a list of prompts' n choices (j = 0 is the answer the prompt gets
with n = 1; the n share a decoder batch).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from unmask.decoding.params import DecodeParams
from unmask.server.admission import arrival_of
from unmask.server.errors import APIError
from unmask.server.intake import (
    check_request,
    constraint_of,
    encode_chat,
    encode_prompt,
    request_params,
    submissions,
)
from unmask.server.output import Choice, TextStream, decode_numbers, usage
from unmask.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
    error_body,
)
from unmask.server.state import ServerState, State

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    prompts = check_request(state, body)
    ids = []
    for i, p in enumerate(prompts):
        ids.append(await run_in_threadpool(encode_prompt, state.llm, p, False,
                                           body.prompt_field(i)))
        if await request.is_disconnected():  # tokenizing many long prompts takes seconds
            return Response(status_code=499)
    return await _respond(state, body, ids, request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State
                           ) -> Response:
    check_request(state, body)
    messages = [m.for_template() for m in body.messages]
    ids = [await run_in_threadpool(encode_chat, state.llm, messages)]
    return await _respond(state, body, ids, request, chat=True)


async def _respond(state: ServerState, body: _Common, ids: list[list[int]], request: Request,
                   chat: bool) -> Response:
    params = request_params(state.config, body, state.model_defaults)
    fields = ([body.prompt_field(i) for i in range(len(ids))] if isinstance(body, CompletionRequest)
              else ["messages"])
    seeded = [params] + [params.replace(seed=(params.seed + j) % (1 << 63), name=params.spec)
                         for j in range(1, body.n)]
    constraint = await constraint_of(state, body, params)
    items = submissions(body, [p for p in ids for _ in seeded], seeded * len(ids),
                        [f for f in fields for _ in seeded], constraint)
    handles = await state.engine.submit(items, "choices", left=request.is_disconnected,
                                        arrival=arrival_of(request))
    if handles is None:
        return Response(status_code=499)
    # usage counts a prompt's tokens once, however many choices it has (as OpenAI's)
    choices = [Choice(i, h, TextStream(state.llm, item.params.gen_length, body.stop,
                                       body.max_tokens),
                      len(item.prompt_ids) if i % body.n == 0 else 0)
               for i, (h, item) in enumerate(zip(handles, items, strict=True))]
    rid = choices[0].request.request_id  # cmpl-..., or chatcmpl-... (intake.submissions)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        gen = _stream(state, choices, request, chat, rid, params, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    texts = ["" for _ in choices]
    try:
        await asyncio.gather(*(_collect(state, c, request, texts) for c in choices))
    finally:
        for c in choices:
            _record(state, c)
    failed = [c for c in choices if c.error]
    if failed:
        # cut off by a shutdown (503: the server, not the request), or failed in the engine
        raise APIError(503 if state.draining else 500,
                       f"the request failed in the engine: {failed[0].error}", "server_error")
    if any(c.finish_reason is None for c in choices):  # the client left: nobody reads this
        return Response(status_code=499)
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": state.model_name,
        "choices": [_choice(c, text, chat) for c, text in zip(choices, texts, strict=True)],
        "usage": usage(choices), "unmask": decode_numbers(choices, params)})


def _choice(c: Choice, text: str, chat: bool) -> dict[str, Any]:
    if chat:
        return {"index": c.index, "message": {"role": "assistant", "content": text},
                "finish_reason": c.finish_reason, "logprobs": None}
    return {"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": None}


async def _events(state: ServerState, c: Choice, request: Request) -> AsyncIterator[str]:
    """Yield the text deltas of one choice until it finishes; aborts it if the client leaves."""
    q = c.handle.events
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
                    c.error, c.outcome = ev.error or "unknown error", "error"
                    return
                stopped = ev.finished == "stop" or c.text.final
                delta = c.text.update(ev) if ev.positions else ""
                delta += c.text.finish(None if stopped else c.request.token_ids)
                c.finish_reason = c.outcome = c.text.finish_reason
                if delta:
                    c.sent_text()
                    yield delta
                return
            delta = c.text.update(ev)
            if c.text.final:  # a stop or max_tokens committed: stop decoding now
                state.engine.abort(c.request.request_id, "stop")
            if delta:
                c.sent_text()
                yield delta
    finally:
        if not done:
            c.outcome = "abort"
            state.engine.abort(c.request.request_id)


async def _collect(state: ServerState, c: Choice, request: Request, texts: list[str]) -> None:
    async for delta in _events(state, c, request):
        texts[c.index] += delta


async def _stream(state: ServerState, choices: list[Choice], request: Request, chat: bool,
                  rid: str, params: DecodeParams, include_usage: bool) -> AsyncIterator[str]:
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

    async def pump(c: Choice) -> None:
        try:
            async for delta in _events(state, c, request):
                await out.put((c.index, delta))
        finally:
            await out.put((c.index, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        if chat:
            for c in choices:
                yield chunk(c.index, "", None, role=True)
        open_choices = len(choices)
        while open_choices:
            index, delta = await out.get()
            c = choices[index]
            if delta is None:
                open_choices -= 1
                if c.error:
                    err = error_body(f"the request failed in the engine: {c.error}",
                                     "server_error")
                    yield f"data: {json.dumps(err)}\n\n"
                    return
                if c.finish_reason is not None:
                    yield chunk(index, None if chat else "", c.finish_reason)
                continue
            yield chunk(index, delta, None)
        if include_usage:
            payload = {"id": rid, "object": obj, "created": created, "model": state.model_name,
                       "choices": [], "usage": usage(choices),
                       "unmask": decode_numbers(choices, params)}
            yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for c in choices:
            if c.finish_reason is None and not c.error:
                state.engine.abort(c.request.request_id)
                c.outcome = c.outcome or "abort"
            _record(state, c)


def _record(state: ServerState, c: Choice) -> None:
    state.engine.record(c.handle, c.outcome or "abort", c.text.n_tokens, c.first_text)
