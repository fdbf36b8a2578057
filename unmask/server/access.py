"""Who may call the server: an API key for the /v1 routes (`--api-key`, or the UNMASK_API_KEY
environment variable) and the origins a browser may call it from (`--cors-origin`).

With a key, every route under /v1/ (the OpenAI routes and the live view's) needs the header
`Authorization: Bearer KEY`, or gets a 401 in OpenAI's error body, as vLLM and SGLang answer.
/health and /metrics stay open, for load balancers and Prometheus scrapers that hold no key
(they tell the load, not what was asked), and so do the live page and its static files (code, no
data: the page asks for the key when the server answers 401).
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from unmask.server.protocol import error_body

PROTECTED = "/v1/"


class APIKey:
    """ASGI middleware: a /v1/ request without `Authorization: Bearer KEY` is a 401."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            # constant time: how long a refusal takes tells nothing about how much of a key matched
            ok = secrets.compare_digest(token.strip().encode("utf-8", "replace"), self.key)
            if not (ok and scheme.lower() == "bearer"):
                body = error_body("missing or wrong API key: send the header 'Authorization: "
                                  "Bearer KEY' with this server's --api-key",
                                  "invalid_request_error", code="invalid_api_key")
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_access(app: FastAPI, api_key: str | None, cors_origins: tuple[str, ...]) -> None:
    """The key check, inside CORS: a browser's preflight (OPTIONS, which never carries the key)
    is answered by CORS before the key is asked for."""
    if api_key is not None:
        app.add_middleware(APIKey, key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
