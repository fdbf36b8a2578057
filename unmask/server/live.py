"""The live view of `unmask serve`: a page at `/` that draws the denoising step by step, and the
event stream it reads.

- GET /                     the page (unmask/server/static: vanilla JS and CSS, no network needed)
- GET /static/...           its scripts and styles
- GET /v1/unmask/decoders   the presets and methods the page offers, and the server's default
- POST /v1/unmask/trace     run a prompt through one or more decoders side by side and stream
                            one server-sent event per step and lane (unmask.trace.Lane's events)

Bad input (an invalid spec, an empty prompt, a canvas too long) is refused before the stream
starts with the server's 400 error body, as on the OpenAI routes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from unmask.decoding.params import METHODS, PRESETS, DecodeParams, to_spec
from unmask.server.app import (
    APIError,
    ServerState,
    _check,
    _check_capacity,
    _check_ids,
    _check_prompt_chars,
    _check_slots,
    _encode,
    _submit,
    request_params,
)
from unmask.server.async_engine import Handle
from unmask.server.protocol import Unsupported, _Common, check_text, error_body
from unmask.trace import STATIC, Lane

MAX_LANES = 4


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


def add_live_routes(app: FastAPI, state: ServerState) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/v1/unmask/decoders")
    async def decoders() -> dict[str, Any]:
        presets = {name: to_spec(DecodeParams.parse(name)) for name in PRESETS}
        return {"model": state.model_name, "default": state.config.decoder,
                "presets": presets, "methods": list(METHODS)}

    @app.post("/v1/unmask/trace")
    async def trace(body: TraceRequest, request: Request) -> StreamingResponse:
        _check(state, body)
        _check_prompt_chars(state, len(body.prompt), "prompt")
        # None: the server's spec, under the request's fields as for the other routes (passed as
        # the request's own spec, a max_tokens would conflict with a gen_length in it)
        specs = body.decoders if body.decoders else [body.decoder]
        _check_capacity(state, len(specs), "decoder lanes")
        params = []
        for i, spec in enumerate(specs):
            try:
                params.append(request_params(state.config, body.model_copy(update={"decoder": spec})))
            except APIError as e:
                shown = state.config.decoder if spec is None else spec
                which = f"decoder {i + 1} ({shown!r})" if len(specs) > 1 else f"decoder {shown!r}"
                raise APIError(e.status, f"{which}: {e}", e.kind, f"decoders[{i}]") from None
        ids = await run_in_threadpool(_encode, state.llm, body.prompt, body.chat)
        _check_ids(state, [ids] * len(params), params, ["prompt"] * len(params), body)
        _check_slots(state, [ids] * len(params), params, "decoder lanes")
        handles: list[Handle] = []
        try:
            for p in params:
                handles.append(await _submit(state, ids, p, trace=True))
        except BaseException:  # e.g. a 429 for a later lane: the submitted ones will not run
            for h in handles:
                state.engine.abort(h.request.request_id)
                _record(state, h, None, "abort")
            raise
        lanes = [Lane(state.llm, i, body.prompt, h.request) for i, h in enumerate(handles)]
        return StreamingResponse(_stream(state, handles, lanes, request),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


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


def _record(state: ServerState, handle: Handle, lane: Lane | None, reason: str) -> None:
    """The request's outcome in /metrics, as the OpenAI routes count theirs (lane None: aborted
    before its stream began)."""
    req = handle.request
    outcome = {"eos": "stop"}.get(reason, reason)
    useful = lane.text(lane.ids)[1] if lane is not None else 0
    state.metrics.finished(outcome, req.nfe, req.decided, useful)
    state.metrics.latency.observe(time.perf_counter() - handle.submitted)
