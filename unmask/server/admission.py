"""The admission window: requests already inside the server that an idle engine waits for.

A burst of requests sent together reaches the engine thread over tens of milliseconds: each
one's HTTP, body and chat template run in turn on the event loop. An engine thread that steps as
soon as the first has reached it admits the burst in groups, and the larger group waits for the
smaller one's step, beside which its own intake runs slower (one interpreter lock:
benchmarks/probe/ttft-anatomy.md). So the engine thread, when its batch is empty and a request
has just reached it, waits for the requests between the server's door and its own queue before
its first step, for at most the window (`unmask serve --admission-window-ms`), and the burst
is admitted in one step. It stops waiting as soon as the requests it has taken hold more prompt
tokens than ADMISSION_PREFILL_TOKENS that the prefix store does not hold (Engine.uncached): a
step of many full prefills gives each its text later than a small group's step would, while a
burst of questions after a stored system prompt is cheap to admit together. A lone request has
nothing to wait for: it steps at once. A running batch never waits: its rows would stall for
requests that join at the next step anyway.

`Arrivals` counts those requests. `CountArrivals` (ASGI middleware) takes a `Ticket` when the
app is called for a route that submits to the engine, and releases it when that call returns,
whatever the outcome (a 400, a 429, a client that left, a shutdown's cancellation); the engine
thread releases it earlier, when it takes the request's last engine request. A release is
idempotent, so the count can never be left raised by a path that forgot it, nor lowered twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# Milliseconds an idle engine waits for a burst (ServerConfig.admission_window_ms): a burst of
# 16 reaches the engine thread over ~10-40 ms on two cores, and 20 ms admitted every measured
# burst in one step (benchmarks/probe/ttft-anatomy.md). Off by default: bounded by
# ADMISSION_PREFILL_TOKENS it no longer costs traffic whose prompts the store does not hold
# (store off 0.96x, was 1.09x unbounded), but side by side it did not cut the time to first
# token of a burst whose prompts it holds either (first wave 1.04x, 12 runs:
# benchmarks/ab/prefix-ttft-serve-admission-bound.md). Past a second it would be a queue.
DEFAULT_ADMISSION_WINDOW_MS = 0.0
MAX_ADMISSION_WINDOW_MS = 1000.0

# Prompt tokens the prefix store does not hold, summed over the requests an idle engine has
# taken, past which it stops waiting: their first step is a long prefill already, and a request
# that waited for it would get its text later, not earlier. Without the bound, a burst of 16
# unstored ~560-token prompts admitted in one step raised time to first token 1.09x, while 16
# questions after a stored ~540-token system prompt admitted together cut it (first wave 0.88x;
# benchmarks/ab/prefix-ttft-serve-admission-window.md). On that traffic (unmask-sdar's chat
# template, blocks of 4) a prompt is 552-571 tokens, and what the store does not hold of each
# of 16 stored-prefix questions sums to 272 tokens (median) and at most 439: 512 lies between.
ADMISSION_PREFILL_TOKENS = 512

# The routes whose requests go to the engine (completions.py, live.py).
ENGINE_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/unmask/trace"})


class Ticket:
    """One request on its way to the engine; `release` it once it is there or gone."""

    def __init__(self, arrivals: Arrivals) -> None:
        self._arrivals = arrivals
        self._held = True

    def release(self) -> None:
        self._arrivals._release(self)


class Arrivals:
    """How many requests are inside the server and not yet handed to the engine thread.

    on_release: called after a release that may let a waiting engine thread go on (its
    thread-safe wake-up)."""

    def __init__(self, on_release: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._n = 0
        self._on_release = on_release

    @property
    def pending(self) -> int:
        return self._n

    def ticket(self) -> Ticket:
        with self._lock:
            self._n += 1
        return Ticket(self)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if not ticket._held:
                return
            ticket._held = False
            self._n -= 1
        if self._on_release is not None:
            self._on_release()


class CountArrivals:
    """ASGI middleware: a Ticket for each request to ENGINE_ROUTES, in `request.state.arrival`,
    held until the app returns (or the engine thread takes the request, earlier)."""

    def __init__(self, app: Any, arrivals: Arrivals) -> None:
        self.app = app
        self.arrivals = arrivals

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") not in ENGINE_ROUTES:
            await self.app(scope, receive, send)
            return
        ticket = self.arrivals.ticket()
        scope.setdefault("state", {})["arrival"] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.release()


def arrival_of(request: Any) -> Ticket | None:
    """The request's Ticket (None outside CountArrivals: an app built without it)."""
    return getattr(request.state, "arrival", None)
