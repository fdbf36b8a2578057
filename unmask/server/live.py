"""The live view of `unmask serve`: a page at `/` that draws the denoising step by step, and the
event stream it reads.

- GET /                     the page (unmask/server/static: vanilla JS and CSS, no network needed)
- GET /static/...           its scripts and styles
- GET /v1/unmask/decoders   the presets and methods the page offers, and the server's default
- POST /v1/unmask/trace     run a prompt through one or more decoders side by side and stream
                            one server-sent event per step and lane (unmask.trace.Lane's events);
                            a response format (response_format, regex) holds every lane

Bad input (an invalid spec, an empty prompt, a canvas too long) is refused before the stream
starts with the server's 400 error body, as on the OpenAI routes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from unmask.decoding.params import METHODS, PRESETS, DecodeParams, to_spec
from unmask.server.admission import arrival_of
from unmask.server.engine_client import Handle
from unmask.server.errors import APIError
from unmask.server.intake import (
    check_prompt_chars,
    check_request,
    constraint_of,
    encode_prompt,
    request_params,
    submissions,
)
from unmask.server.protocol import Unsupported, _Common, check_text, error_body
from unmask.server.state import ServerState, State
from unmask.trace import MAX_LANES, STATIC, Lane


class TraceRequest(_Common):
    """POST /v1/unmask/trace: `decoders` (one lane each) or `decoder` (one lane; the server's
    --decoder when both are absent), with max_tokens, temperature and seed as on the OpenAI
    routes. The prompt goes through the chat template unless chat is false."""

    prompt: str
    decoders: list[str] | None = Field(default=None, min_length=1, max_length=MAX_LANES)
    chat: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.stop:
            raise Unsupported("stop", "stop strings are not supported by the trace stream")
        if self.n != 1:
            raise Unsupported("n", "the trace stream has lanes, not choices: give `decoders`")
        if self.decoders is not None and self.decoder is not None:
            raise Unsupported("decoder", "give either decoder or decoders")
        # the OpenAI routes' stream fields: this route always streams, so either would be ignored
        if "stream" in self.model_fields_set or self.stream_options is not None:
            raise Unsupported("stream", "the trace route always streams its events; drop stream "
                                        "and stream_options")
        check_text(self.prompt, "prompt")


router = APIRouter()


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.get("/v1/unmask/decoders")
async def decoders(state: State) -> dict[str, Any]:
    presets = {name: to_spec(DecodeParams.parse(name)) for name in PRESETS}
    return {"model": state.model_name, "default": state.config.decoder,
            "presets": presets, "methods": list(METHODS)}


@router.post("/v1/unmask/trace")
async def trace(body: TraceRequest, request: Request, state: State) -> StreamingResponse:
    check_request(state, body)
    check_prompt_chars(state, len(body.prompt), "prompt")
    # None: the server's spec, under the request's fields as for the other routes (passed as
    # the request's own spec, a max_tokens would conflict with a gen_length in it)
    specs = body.decoders if body.decoders else [body.decoder]
    params = [_lane_params(state, body, i, spec, len(specs)) for i, spec in enumerate(specs)]
    ids = await run_in_threadpool(encode_prompt, state.llm, body.prompt, body.chat)
    # a response format (response_format, regex, guided_regex) holds every lane, each over its
    # own decoder; a lane's layout event names its constrained slots and its scaffold
    items = []
    for p in params:
        constraint = await constraint_of(state, body, p)
        items += submissions(body, [ids], [p], ["prompt"], constraint)
    handles = await state.engine.submit(items, "decoder lanes", trace=True,
                                        arrival=arrival_of(request))
    lanes = [Lane(state.llm, i, body.prompt, h.request) for i, h in enumerate(handles)]
    return StreamingResponse(_stream(state, handles, lanes, request),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _lane_params(state: ServerState, body: TraceRequest, i: int, spec: str | None,
                 n: int) -> DecodeParams:
    """Lane i's decoder; an error names the lane (decoders[i])."""
    try:
        return request_params(state.config, body.model_copy(update={"decoder": spec}),
                              state.model_defaults)
    except APIError as e:
        shown = state.config.decoder if spec is None else spec
        which = f"decoder {i + 1} ({shown!r})" if n > 1 else f"decoder {shown!r}"
        raise APIError(e.status, f"{which}: {e}", e.kind, f"decoders[{i}]") from None


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _stream(state: ServerState, handles: list[Handle], lanes: list[Lane],
                  request: Request) -> AsyncIterator[str]:
    """Layouts first, then each lane's steps as the engine makes them, then its `done`."""
    out: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    finished: set[int] = set()

    async def pump(i: int) -> None:
        while True:
            ev = await handles[i].events.get()
            await out.put((i, ev))
            if ev.finished:
                return

    tasks = [asyncio.create_task(pump(i)) for i in range(len(handles))]
    try:
        for lane in lanes:
            yield _sse(lane.layout())
        while len(finished) < len(lanes):
            try:
                i, ev = await asyncio.wait_for(out.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            req = handles[i].request
            elapsed = time.perf_counter() - req.started if req.started is not None else 0.0
            for payload in lanes[i].feed(ev, elapsed):
                yield _sse(payload)
            if ev.finished:
                finished.add(i)
                _record(state, handles[i], lanes[i], ev.finished)
                if ev.finished == "error":
                    err = error_body(f"the request failed in the engine: {ev.error}", "server_error")
                    yield _sse(err)
    finally:
        for t in tasks:
            t.cancel()
        for i, h in enumerate(handles):
            if i not in finished:
                state.engine.abort(h.request.request_id)
                _record(state, h, lanes[i], "abort")


def _record(state: ServerState, handle: Handle, lane: Lane, reason: str) -> None:
    """The request's outcome in /metrics, as the OpenAI routes count theirs."""
    outcome = {"eos": "stop"}.get(reason, reason)
    state.engine.record(handle, outcome, lane.text(lane.ids)[1])
