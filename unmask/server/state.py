"""What every route of one server reads: its configuration and state (`app.state.unmask`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from unmask.api import LLM
from unmask.decoding.params import DEFAULT_DECODER, DecodeParams
from unmask.errors import InputError
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

    def __post_init__(self) -> None:
        DecodeParams.parse(self.decoder)  # a bad default spec fails at startup, not per request
        n = self.max_body_bytes
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):  # True is no size
            raise InputError(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")


@dataclass
class ServerState:
    llm: LLM
    config: ServerConfig
    engine: EngineClient  # the one door into the engine
    model_name: str
    chars_per_token: int  # the most characters one token can stand for (check_prompt_chars)
    draining: bool = False
    started: float = field(default_factory=time.time)

    @property
    def metrics(self) -> ServerMetrics:
        return self.engine.metrics


def server_state(request: Request) -> ServerState:
    return request.app.state.unmask


# A route's parameter of this type is its server's state.
State = Annotated[ServerState, Depends(server_state)]
