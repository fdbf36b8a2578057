"""The engine on its own thread, fed by the server's event loop.

The engine is not thread-safe and `step()` blocks for a model call, so one thread owns it: it
takes commands (add, abort) from a queue between steps, steps while anything is unfinished, and
hands each step's events to the asyncio queue of the request they belong to. An abort therefore
takes effect before the next step: a cancelled request costs at most the step in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, Request, StepEvent

log = logging.getLogger("unmask.server")


@dataclass
class Handle:
    """A submitted request as the event loop sees it."""

    request: Request
    events: asyncio.Queue[StepEvent]
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)


class EngineThread:
    def __init__(self, engine: Engine, on_step: Callable[[list[StepEvent]], None] | None = None,
                 ) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        self._cmds: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._handles: dict[str, Handle] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="unmask-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- called from the event loop ----------------------------------------------------------
    async def submit(self, prompt_ids: list[int], params: DecodeParams, request_id: str,
                     trace: bool = False) -> Handle:
        """Queue a request; raises what `Engine.add_request` raises (InputError, QueueFull)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Handle] = loop.create_future()
        self._cmds.put(("add", (prompt_ids, params, request_id, trace, loop, done)))
        try:
            return await done
        except asyncio.CancelledError:  # the client left before the engine took it
            self.abort(request_id)
            raise

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._cmds.put(("abort", (request_id, reason)))

    # --- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished)
                if self.engine.has_unfinished:
                    events = self.engine.step()
                    self._dispatch(events)
        except BaseException as e:  # noqa: BLE001 - reported by /health and failed requests
            log.exception("engine thread died")
            self.error = e
            for h in list(self._handles.values()):
                h.loop.call_soon_threadsafe(h.events.put_nowait, StepEvent(
                    h.request.request_id, 0, [], [], [], False, False, (0, 0), 0, 0, 0, 0,
                    finished="error", error=f"engine stopped: {type(e).__name__}: {e}"))

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

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "add":
            prompt_ids, params, request_id, trace, loop, done = arg
            try:
                req = self.engine.add_request(prompt_ids, params, request_id, trace=trace)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, done, e)
                return
            h = Handle(req, asyncio.Queue(), loop)
            self._handles[req.request_id] = h
            loop.call_soon_threadsafe(_set_result, done, h)
        elif kind == "abort":
            request_id, reason = arg
            self.engine.abort(request_id, reason)

    def _dispatch(self, events: list[StepEvent]) -> None:
        for ev in events:
            h = self._handles.get(ev.request_id)
            if h is None:
                continue
            if ev.finished:
                del self._handles[ev.request_id]
            h.loop.call_soon_threadsafe(h.events.put_nowait, ev)
        if self.on_step is not None:
            self.on_step(events)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
