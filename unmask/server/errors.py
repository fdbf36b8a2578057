"""The server's errors, all in OpenAI's error body: its own refusals (`APIError`, a request
field's `FieldError`, a full queue, a stopped engine), pydantic's validation errors named by the
field a client wrote, the router's 404/405, a body over the size limit (413), and bugs (500)."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from unmask.engine import QueueFull
from unmask.server.engine_client import EngineStopped
from unmask.server.protocol import FieldError, error_body

log = logging.getLogger("unmask.server")


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
    elif isinstance(e.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
        bad = e.__cause__
        message = (f"request body is not valid UTF-8 (byte 0x{bad.object[bad.start]:02x} at "
                   f"offset {bad.start}): send JSON encoded in UTF-8")
    else:
        message = f"{where}: {e.detail}"
    kind = "server_error" if e.status_code >= 500 else "invalid_request_error"
    return JSONResponse(error_body(message, kind), e.status_code, headers=e.headers)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(FieldError, _field_error)
    app.add_exception_handler(QueueFull, _queue_full)
    app.add_exception_handler(EngineStopped, _engine_stopped)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Exception, _internal)


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    return JSONResponse(error_body(str(e), e.kind, e.param), e.status, headers=e.headers)


async def _field_error(request: Request, e: FieldError) -> JSONResponse:
    return JSONResponse(error_body(str(e), "invalid_request_error", e.field), 400)


async def _queue_full(request: Request, e: QueueFull) -> JSONResponse:
    retry = request.app.state.unmask.config.retry_after
    return JSONResponse(error_body(str(e), "rate_limit_error"), 429,
                        headers={"Retry-After": str(retry)})


async def _engine_stopped(request: Request, e: EngineStopped) -> JSONResponse:
    return JSONResponse(error_body(str(e), "server_error"), 503)


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


async def _internal(request: Request, e: Exception) -> JSONResponse:
    log.exception("internal error")
    return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)


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
