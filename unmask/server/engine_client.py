"""The server's one door into the engine: `EngineClient.submit(items)`, `abort`, and the
accounting of each request's outcome in /metrics.

Concurrency. The engine belongs to one thread, `unmask-engine`: it steps the engine while
anything is unfinished and, between steps, applies the commands the event loop queues (add,
abort); each step's events go to the asyncio queue of the request they belong to. No other
thread calls into the Engine (so its own lock, there for callers that share an engine between
threads, is never contended here), and the event loop never waits on a step: a command is a
queue put, and the counts /health reports are published by the engine thread after each pass.
An abort takes effect before the next step: a cancelled request costs at most the step in
flight. An idle engine's first step waits, for at most `window` seconds, for the requests
already inside the server (`arrivals`), so that a burst is admitted in one step, unless those it
has taken hold more than `bound` prompt tokens the prefix store does not (admission.py).

Validation. `submit` refuses a response's engine requests all together or not at all, with the
engine's own checks, made once (Engine.check: the ids and the canvas; the scheduler's slot budget,
and how many of them an idle engine admits at once), before it submits any of them; a refusal
is a `FieldError` naming the request's field it is about. The checks read only the engine's
configuration, so they run on the event loop without touching the engine's state.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from unmask.decoding.grammar import Constraint
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, QueueFull, Request, StepEvent
from unmask.engine.engine import CheckedPrompt
from unmask.errors import CanvasTooLong, DecoderMismatch, InputError
from unmask.server.admission import ADMISSION_PREFILL_TOKENS, Arrivals, Ticket
from unmask.server.metrics import ServerMetrics
from unmask.server.protocol import FieldError

log = logging.getLogger("unmask.server")


class EngineStopped(RuntimeError):
    """The engine thread died (a bug); the server answers 503 until it is restarted."""


@dataclass(frozen=True)
class Submission:
    """One engine request of an HTTP request, and the request's fields that an error about it
    names."""

    prompt_ids: list[int]
    params: DecodeParams
    field: str  # where the prompt came from: "prompt", "prompt[2]", "messages"
    length_field: str | None = None  # the field that set gen_length, when the request set one
    # its id's prefix, as OpenAI's: the response's id and the server log then name it alike
    id_prefix: str = "cmpl"
    constraint: Constraint | None = None  # structured output (unmask.decoding.grammar)


@dataclass
class Handle:
    """A submitted request as the event loop sees it."""

    request: Request
    events: asyncio.Queue[StepEvent]
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)
    counted: bool = False  # its outcome is in /metrics (EngineClient.record)


class EngineClient:
    def __init__(self, engine: Engine, metrics: ServerMetrics, window: float = 0.0,
                 bound: int = ADMISSION_PREFILL_TOKENS) -> None:
        self.engine = engine
        self.metrics = metrics
        self.window = window  # seconds an idle engine waits for arrivals (ServerConfig)
        self.bound = bound  # uncached prompt tokens past which it stops waiting (_gather)
        self.arrivals = Arrivals(on_release=self._wake)
        self.n_running = self.n_waiting = 0  # published by the engine thread (_publish)
        self._cmds: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._handles: dict[str, Handle] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="unmask-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its step; requests still open then get an error event
        (their streams end with the error, not a cancelled task's traceback)."""
        self._stop.set()
        self._cmds.put(("wake", None))
        self._thread.join(timeout)
        if not self._thread.is_alive():  # the handles are no other thread's now
            self._cut("the server stopped before this request finished")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the door (the event loop) -------------------------------------------------------------
    async def submit(self, items: list[Submission], what: str, trace: bool = False,
                     left: Callable[[], Awaitable[bool]] | None = None,
                     arrival: Ticket | None = None) -> list[Handle] | None:
        """Check every item, then submit them in order, one engine round trip each (a round trip
        waits for the step in flight). None when `left()` says the client left before all were
        submitted: those that were are aborted. Raises FieldError (a refusal naming the field),
        QueueFull (none aborted but those submitted before it) or EngineStopped. `what` names
        the items in messages ("choices", "decoder lanes"). `arrival`: the request's Ticket,
        released by the engine thread when it takes the last item."""
        if self.error is not None:
            raise EngineStopped("the engine has stopped; see the server log")
        checked = self.check(items, what)
        handles: list[Handle] = []
        try:
            for i, (item, ids) in enumerate(zip(items, checked, strict=True)):
                if left is not None and await left():
                    self._abort_all(handles)
                    return None
                last = i == len(items) - 1
                handles.append(await self._add(item, ids, trace, arrival if last else None))
        except QueueFull:
            self.metrics.requests.labels("rejected").inc()
            self._abort_all(handles)
            raise
        except BaseException:
            self._abort_all(handles)
            raise
        return handles

    def check(self, items: list[Submission], what: str) -> list[CheckedPrompt]:
        """The engine's refusal of any item, and of the items together, as a FieldError; else
        each item's prompt as the engine checked it (add_request does not check it again)."""
        checked = []
        for item in items:
            try:
                checked.append(self.engine.check(item.prompt_ids, item.params))
            except CanvasTooLong as e:
                raise FieldError(item.length_field or item.field, str(e)) from None
            except DecoderMismatch as e:  # a key of the decoder that this model cannot take
                raise FieldError("decoder", str(e)) from None
            except InputError as e:
                raise FieldError(item.field, f"{item.field}: {e}") from None
        scheduler = self.engine.scheduler
        c = scheduler.config
        if c.max_slots is None and (c.max_queue is None or len(items) <= c.max_running + c.max_queue):
            return checked  # no budget but rows: every item fits alone, and the count fits
        reqs = [Request(list(p.ids), i.params, block_size=self.engine.block_size)
                for i, p in zip(items, checked, strict=True)]
        for item, r in zip(items, reqs, strict=True):
            try:
                scheduler.check_fits(r)
            except InputError as e:
                raise FieldError(item.field, f"{item.field}: {e}") from None
        if c.max_queue is None or len(reqs) <= c.max_queue + 1:
            return checked  # each fits alone, so an idle engine runs one at least, queues the rest
        at_once = scheduler.admitted_when_idle(reqs)
        if len(reqs) > at_once + c.max_queue:
            raise FieldError(None, never_together(len(reqs), what, at_once, c))
        return checked

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._cmds.put(("abort", (request_id, reason)))

    def cut_all(self, why: str) -> None:
        """Fail every request now (a shutdown's timeout has passed): each gets an error event
        saying `why`, so its stream ends with the error the server promises, and the log one
        line per request."""
        self._cmds.put(("cut", why))

    def record(self, handle: Handle, outcome: str, useful: int,
               first_text: float | None = None) -> None:
        """The request's outcome in /metrics, once: stop, length, abort or error, with its useful
        tokens and (when it sent text) when the first came."""
        if handle.counted:
            return
        handle.counted = True
        req = handle.request
        self.metrics.finished(outcome, req.nfe, req.decided, useful)
        self.metrics.latency.observe(time.perf_counter() - handle.submitted)
        if first_text is not None:
            self.metrics.ttft.observe(first_text - handle.submitted)

    async def _add(self, item: Submission, ids: CheckedPrompt, trace: bool,
                   arrival: Ticket | None = None) -> Handle:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Handle] = loop.create_future()
        request_id = f"{item.id_prefix}-{uuid.uuid4().hex}"
        self._cmds.put(("add", (ids, item.params, request_id, trace, item.constraint, loop,
                                done, arrival)))
        try:
            return await done
        except asyncio.CancelledError:  # the client left before the engine took it
            self.abort(request_id)
            raise

    def _abort_all(self, handles: list[Handle]) -> None:
        """Abort submitted requests nobody will read, counted as aborted."""
        for h in handles:
            self.abort(h.request.request_id)
            self.record(h, "abort", 0)

    # --- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_unfinished
                self._drain(block=idle)
                if idle and self.engine.has_unfinished:
                    self._gather()
                if self.engine.has_unfinished:
                    self._dispatch(self.engine.step())
                self._publish()
        except BaseException as e:  # noqa: BLE001 - reported by /health and failed requests
            log.exception("engine thread died")
            self.error = e
            for h in list(self._handles.values()):
                _deliver(h, _failed(h, f"engine stopped: {type(e).__name__}: {e}"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.05) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _gather(self) -> None:
        """Before an idle engine's first step: take the requests inside the server as they
        arrive, until none is left on its way, `window` seconds have passed, or those taken
        since the engine went idle hold more than `bound` prompt tokens the prefix store does
        not (their first step is long already: the rest join the next; admission.py)."""
        if self.window <= 0:
            return
        deadline = time.perf_counter() + self.window
        work = sum(self.engine.uncached(r) for r in self.engine.scheduler.waiting)
        while self.arrivals.pending and work <= self.bound and not self._stop.is_set():
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            try:  # an add, or the wake-up of a release on the event loop
                cmd = self._cmds.get(timeout=left)
            except queue.Empty:
                return
            req = self._apply(*cmd)
            if req is not None:
                work += self.engine.uncached(req)

    def _wake(self) -> None:
        """A release on another thread: a gathering engine thread looks at the count again."""
        if threading.current_thread() is not self._thread:
            self._cmds.put(("wake", None))

    def _apply(self, kind: str, arg: Any) -> Request | None:
        """Carry out a command from the event loop; the Request an add queued, else None."""
        if kind == "add":
            prompt_ids, params, request_id, trace, constraint, loop, done, arrival = arg
            try:
                req = self.engine.add_request(prompt_ids, params, request_id, trace=trace,
                                              constraint=constraint)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, done, e)
                return None
            finally:  # taken (or refused): no longer on its way
                if arrival is not None:
                    arrival.release()
            h = Handle(req, asyncio.Queue(), loop)
            self._handles[req.request_id] = h
            loop.call_soon_threadsafe(_set_result, done, h)
            return req
        if kind == "abort":
            request_id, reason = arg
            self.engine.abort(request_id, reason)
        elif kind == "cut":
            self._cut(arg)
        return None

    def _cut(self, why: str) -> None:
        for request_id, h in list(self._handles.items()):
            self.engine.abort(request_id)
            del self._handles[request_id]
            log.warning("cut off %s: %s", request_id, why)
            _deliver(h, _failed(h, why))

    def _dispatch(self, events: list[StepEvent]) -> None:
        for ev in events:
            h = self._handles.get(ev.request_id)
            if h is None:
                continue
            if ev.finished:
                del self._handles[ev.request_id]
            _deliver(h, ev)
        e = self.engine
        self.metrics.engine_totals(e.model_calls, e.token_forwards)

    def _publish(self) -> None:
        self.n_running, self.n_waiting = self.engine.n_running, self.engine.n_waiting
        self.metrics.queue_depth.set(self.n_waiting)
        self.metrics.running.set(self.n_running)


def never_together(n: int, what: str, at_once: int, c: Any) -> str:
    """Why n requests can never be admitted together (c: the engine's SchedulerConfig)."""
    most = at_once + c.max_queue
    if c.max_slots is None:
        return (f"{n} {what} in one request can never be admitted together: this server holds "
                f"at most {most} requests (--max-running {c.max_running} decoding + --max-queue "
                f"{c.max_queue} waiting); send at most {most} per request")
    return (f"{n} {what} in one request can never be admitted together: under --max-slots "
            f"{c.max_slots} (each holds prompt + gen_length slots, padded to the longest of its "
            f"decoder batch) an idle server runs {at_once} of them at once, and --max-queue "
            f"{c.max_queue} more can wait; send at most {most} per request, or shorter prompts "
            f"or max_tokens")


def _deliver(h: Handle, ev: StepEvent) -> None:
    """Hand an event to its request's event loop; one whose loop has closed (a caller's thread
    that ended without reading it to the end) has no reader, and must not stop the engine."""
    try:
        h.loop.call_soon_threadsafe(h.events.put_nowait, ev)
    except RuntimeError:  # "Event loop is closed"
        pass


def _failed(h: Handle, error: str) -> StepEvent:
    """The final event of a request that failed outside a step."""
    return StepEvent(h.request.request_id, 0, [], [], [], False, False, (0, 0), 0, 0, 0, 0,
                     finished="error", error=error)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
