"""`unmask serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (and
/v1/models/{id}), GET /health, GET /metrics, and the live view (GET /, POST /v1/unmask/trace).
Requests join the engine's running batch at its next step and leave when done (continuous
batching); each request's tokens are those it would get alone (batch invariance).

A completion's canvas is `max_tokens` rounded up to the decoder's block_length, and its text at
most `max_tokens` tokens (decoding stops once they are committed); the text ends at the first EOS
(finish_reason "stop") or at max_tokens ("length"). A stop string cuts the text before it, and
decoding stops as soon as it is committed. Streaming sends the committed prefix
as it grows: text is never retracted or reordered.

Tokenizing and chat templating run on a worker thread: their cost grows with the prompt, and on
the event loop one long prompt would stall every stream and /health. Bounds keep that cost and a
request's footprint in the engine finite: a body size (413), prompts per request, characters per
prompt (a longer prompt could not fit max_sequence_length tokens) and chat messages (400s).

The routes, by family: completions.py (the OpenAI completions and chat), info.py (health,
metrics, models), live.py (the live view); intake.py turns a body into engine requests, and
engine_client.py is the one door into the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from unmask.api import LLM
from unmask.engine import Engine, SchedulerConfig
from unmask.server import completions, info, live
from unmask.server.access import add_access
from unmask.server.admission import CountArrivals
from unmask.server.engine_client import EngineClient
from unmask.server.errors import BodyLimit, add_error_handlers
from unmask.server.metrics import ServerMetrics
from unmask.server.state import ServerConfig, ServerState
from unmask.trace import STATIC


def build_app(llm: LLM, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    engine = Engine(llm.model, SchedulerConfig(max_running=config.max_running,
                                               max_queue=config.max_queue,
                                               max_slots=config.max_slots,
                                               joiners_first=config.joiners_first),
                    prefix=llm.prefix_store, graphs=llm.graphs)
    metrics = ServerMetrics()
    metrics.watch_prefix(llm.prefix_store)
    door = EngineClient(engine, metrics, window=config.admission_window_ms / 1000)
    # A vocabulary entry is at least as long as the text its token decodes to (byte-level BPE:
    # one character per byte; SentencePiece: one per character; WordPiece adds "##"), so no
    # token covers more characters than the longest entry.
    chars_per_token = max(len(t) for t in llm.tokenizer.get_vocab())
    state = ServerState(llm, config, door, config.model_name or llm.name, chars_per_token)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        door.start()
        yield
        state.draining = True
        door.stop()

    app = FastAPI(title="unmask", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for diffusion language models")
    app.state.unmask = state
    # innermost: a request refused by the body limit or the API key never counts as arriving
    app.add_middleware(CountArrivals, arrivals=door.arrivals)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    add_access(app, config.api_key, config.cors_origins)  # outside the body limit: 401 first
    add_error_handlers(app)
    for routes in (info.router, completions.router, live.router):
        app.include_router(routes)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app
