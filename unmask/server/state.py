"""What every route of one server reads: its configuration and state (`app.state.unmask`)."""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from unmask.api import LLM
from unmask.decoding.params import DEFAULT_DECODER, DecodeParams
from unmask.engine.layout import model_defaults
from unmask.errors import InputError, is_bearer_token
from unmask.server.admission import DEFAULT_ADMISSION_WINDOW_MS, MAX_ADMISSION_WINDOW_MS
from unmask.server.engine_client import EngineClient
from unmask.server.metrics import ServerMetrics

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
    api_key: str | None = None  # what /v1/ routes need (access.py); None: open
    cors_origins: tuple[str, ...] = ()  # origins a browser may call from ("*": any)
    # seconds running requests get to finish once a shutdown begins; then they are cut off
    shutdown_timeout: float = 30.0
    # how long an idle engine's first step waits for requests already inside the server, so
    # that a burst is admitted in one step (admission.py); 0: it steps at once
    admission_window_ms: float = DEFAULT_ADMISSION_WINDOW_MS
    # requests joining a running batch take their first step alone, before the batch's next
    # (SchedulerConfig.joiners_first): their first text a batch step sooner
    joiners_first: bool = True

    def __post_init__(self) -> None:
        DecodeParams.parse(self.decoder)  # a bad default spec fails at startup, not per request
        name = self.model_name
        if name is not None and not (isinstance(name, str) and name.strip()):
            raise InputError(f"--model-name {name!r}: the id clients send as `model` must not be "
                             f"empty; drop --model-name for the model's own name")
        n = self.max_body_bytes
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):  # True is no size
            raise InputError(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        t = self.shutdown_timeout
        # nan passed every comparison, and aborted the process at the first stream it cut
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise InputError(f"--shutdown-timeout must be a number of seconds >= 0, got {t!r}")
        w = self.admission_window_ms
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                and 0 <= w <= MAX_ADMISSION_WINDOW_MS):
            raise InputError(f"--admission-window-ms must be a number of milliseconds in "
                             f"0..{MAX_ADMISSION_WINDOW_MS:g} (0: off), got {w!r}")
        key = self.api_key
        if key is not None and not (isinstance(key, str) and is_bearer_token(key)):
            raise InputError("the API key (--api-key or $UNMASK_API_KEY) must be non-empty "
                             "printable ASCII without spaces")
        for origin in self.cors_origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise InputError(f"--cors-origin {origin!r} is no origin: want "
                                 f"scheme://host[:port] (no path), e.g. https://example.com, "
                                 f"or * for any")


_ORIGIN = re.compile(r"https?://[^/\s]+")


@dataclass
class ServerState:
    llm: LLM
    config: ServerConfig
    engine: EngineClient  # the one door into the engine
    model_name: str
    chars_per_token: int  # the most characters one token can stand for (check_prompt_chars)
    draining: bool = False
    started: float = field(default_factory=time.time)
    loop: asyncio.AbstractEventLoop | None = None  # the app's, once it has started

    def begin_shutdown(self) -> None:
        """Refuse new requests (503) and cut those still running after shutdown_timeout. Safe
        to call from a signal handler; the second call changes nothing."""
        if self.draining:
            return
        self.draining = True
        if self.loop is not None:
            t = self.config.shutdown_timeout
            why = f"the server is shutting down, and --shutdown-timeout ({t:g} s) has passed"
            self.loop.call_soon_threadsafe(self.loop.call_later, t, self.engine.cut_all, why)

    @property
    def metrics(self) -> ServerMetrics:
        return self.engine.metrics

    @property
    def model_defaults(self) -> dict:
        """Decoder keys a request's spec defaults to for this model (a block-causal model's
        blocks and cache: unmask.engine.layout.model_defaults)."""
        return model_defaults(self.llm.model)


def server_state(request: Request) -> ServerState:
    return request.app.state.unmask


# A route's parameter of this type is its server's state.
State = Annotated[ServerState, Depends(server_state)]
