"""Which requests run: admission under a row budget and a slot budget, in arrival order.

Plain Python, no tensors. Requests of one decoder share a batch whose canvas is as wide as its
longest prompt plus its longest generation, so the slot budget counts that padded area (rows x
width per decoder group): it is what the canvas holds. The K/V store keeps the rows of the most
requests its batch has held at once, each at most twice as wide as the widest canvas
(DecodeBatch._compact_store).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from unmask.engine.request import Request
from unmask.errors import InputError


class QueueFull(InputError):
    """The waiting queue is at its limit; try again later."""


# Prompt tokens the joining requests' first step forwards (those the prefix store did not
# hold), past which they step with the batch instead of alone: a step of long prefills alone
# stalls the batch's rows for about as long as it would take beside them and gives the joiners
# their text barely sooner (the shared-prompt benchmark with the store off, ~560 tokens each:
# tokens/s 0.91x, TTFT at concurrency 4 1.13x), while questions after a stored system prompt
# (~30 tokens each, a burst's group of 16 at most ~440) step alone in a few milliseconds
# (benchmarks/ab/prefix-ttft-serve-joiners-first.md).
JOINERS_FIRST_TOKENS = 512


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 16  # rows decoded at once, all decoders together
    max_queue: int | None = None  # waiting requests; None = unbounded
    max_slots: int | None = None  # padded canvas slots held at once; None = unbounded
    # Requests joining a batch that is already decoding take their first step in a step of
    # their own, before the batch's next, where it is short (JOINERS_FIRST_TOKENS; docs/engine.md,
    # "Joiners first"): their first tokens come a batch step sooner, the batch's rows wait for
    # that small step. A server's choice (time to first token); off for offline decoding, where
    # only throughput counts.
    joiners_first: bool = False

    def __post_init__(self) -> None:
        if not (_is_int(self.max_running) and self.max_running >= 1):
            raise InputError(f"max_running must be an integer >= 1, got {self.max_running!r}")
        if not isinstance(self.joiners_first, bool):
            raise InputError(f"joiners_first must be True or False, got {self.joiners_first!r}")
        for key in ("max_queue", "max_slots"):
            v = getattr(self, key)
            if v is not None and not (_is_int(v) and v >= 0):
                raise InputError(f"{key} must be an integer >= 0 or None, got {v!r}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is not a count


class Scheduler:
    def __init__(self, config: SchedulerConfig, group_of: Callable[[Request], Hashable]) -> None:
        self.config = config
        self.group_of = group_of
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}

    def check_fits(self, req: Request) -> None:
        """A request that could never run, even alone, is refused at once (not queued forever)."""
        limit = self.config.max_slots
        if limit is not None and req.slots > limit:
            raise InputError(f"prompt ({req.prompt_len} tokens) + gen_length ({req.gen_length}) = "
                             f"{req.slots} slots exceeds the engine's slot budget {limit}")

    def add(self, req: Request) -> None:
        """Queue `req`. max_queue counts the requests that must wait for a row or slots: one
        that the next step admits does not wait, so max_queue 0 still serves whatever fits."""
        self.check_fits(req)
        limit = self.config.max_queue
        if limit is not None and len(self.waiting) >= limit:
            if len(self.waiting) + 1 - self._admits(self.running, [*self.waiting, req]) > limit:
                raise QueueFull(f"queue full ({limit} waiting requests)")
        self.waiting.append(req)

    def schedule(self) -> list[Request]:
        """Admit waiting requests in arrival order while they fit; the first that does not fit
        waits (later ones wait behind it, so a large request is not starved)."""
        admitted = []
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            if not self._fits_with(req):
                break
            self.waiting.popleft()
            self.running[req.request_id] = req
            admitted.append(req)
        return admitted

    def admitted_when_idle(self, reqs: list[Request]) -> int:
        """How many of `reqs`, arriving in this order at an idle engine, would run at once (the
        rest wait): what the row and slot budgets allow. It lets a caller tell a batch that
        could never be held (more than this + max_queue) from one that must wait its turn.

        Reads only the config and group_of, never this scheduler's queues, so any thread may
        call it."""
        return self._admits({}, reqs)

    def _admits(self, running: dict[str, Request], reqs: list[Request]) -> int:
        """How many of `reqs`, waiting in this order beside `running`, the next step admits (a
        scheduler of its own runs `schedule`: one rule for admission)."""
        sim = Scheduler(self.config, self.group_of)
        sim.running = dict(running)
        sim.waiting.extend(reqs)
        return len(sim.schedule())

    def finish(self, req: Request) -> None:
        self.running.pop(req.request_id, None)

    def remove_waiting(self, request_id: str) -> Request | None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return req
        return None

    def slots_in_use(self, extra: Request | None = None) -> int:
        """Padded canvas area of the running requests (plus `extra`): per decoder group, rows x
        (longest prompt + longest generation)."""
        groups: dict[Hashable, list[int]] = {}  # group -> [rows, max prompt, max gen]
        reqs = list(self.running.values()) + ([extra] if extra is not None else [])
        for r in reqs:
            g = groups.setdefault(self.group_of(r), [0, 0, 0])
            g[0] += 1
            g[1] = max(g[1], r.prompt_len)
            g[2] = max(g[2], r.canvas)
        return sum(rows * (p + n) for rows, p, n in groups.values())

    def _fits_with(self, req: Request) -> bool:
        limit = self.config.max_slots
        return limit is None or self.slots_in_use(req) <= limit
