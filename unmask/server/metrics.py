"""Prometheus metrics of one server (prometheus-client, a registry per app).

Counters are totals since start (rates come from PromQL, e.g. rate(unmask_model_calls_total[1m])
is NFE per second); the `*_per_second` and `unmask_tpf` gauges are the same quantities over the
last `window` seconds, for a glance without a Prometheus server.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from unmask.engine.prefix_store import PrefixStore

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    def __init__(self, window: float = 10.0) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("unmask_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("unmask_running_requests", "Requests being decoded", registry=r)
        self.requests = Counter("unmask_requests", "Finished requests by outcome "
                                "(stop, length, abort, error, rejected)", ["outcome"], registry=r)
        self.model_calls = Counter(
            "unmask_model_calls", "Forward passes, one per decoder batch per step (engine-wide NFE)",
            registry=r)
        self.token_forwards = Counter("unmask_token_forwards", "Token positions forwarded",
                                      registry=r)
        self.decided = Counter("unmask_decided_positions", "Generated positions committed by a "
                               "forward's decision (TPF numerator)", registry=r)
        self.request_nfe = Counter("unmask_request_nfe", "Sum of per-request NFE (TPF "
                                   "denominator)", registry=r)
        self.useful = Counter("unmask_useful_tokens", "Generated tokens up to the first EOS",
                              registry=r)
        self.latency = Histogram("unmask_request_latency_seconds", "Request latency",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("unmask_time_to_first_token_seconds", "Time to the first "
                              "committed text", buckets=LATENCY_BUCKETS, registry=r)
        self.nfe_rate = Gauge("unmask_model_calls_per_second", "NFE per second (window)",
                              registry=r)
        self.tf_rate = Gauge("unmask_token_forwards_per_second", "Token-forwards per second "
                             "(window)", registry=r)
        self.useful_rate = Gauge("unmask_useful_tokens_per_second", "Useful tokens per second "
                                 "(window)", registry=r)
        self.tpf = Gauge("unmask_tpf", "Tokens per forward of requests finished in the window",
                         registry=r)
        self.window = window
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, int, int, int, int, int]] = deque()
        self._last = (0, 0)
        # Read when scraped, not set when a sample arrives: set on arrival they kept the last
        # busy window's values for as long as the server stayed idle.
        self.nfe_rate.set_function(lambda: self._window_sums()[0] / self.window)
        self.tf_rate.set_function(lambda: self._window_sums()[1] / self.window)
        self.useful_rate.set_function(lambda: self._window_sums()[2] / self.window)
        self.tpf.set_function(lambda: (lambda s: s[3] / s[4] if s[4] else 0.0)(self._window_sums()))

    def watch_prefix(self, store: PrefixStore | None) -> None:
        """Report the prefix store's counts, read from it when scraped (none without one)."""
        if store is not None:
            self.registry.register(_PrefixCollector(store))

    def engine_totals(self, model_calls: int, token_forwards: int) -> None:
        """Called after each step with the engine's running totals."""
        with self._lock:
            calls, tf = model_calls - self._last[0], token_forwards - self._last[1]
            self._last = (model_calls, token_forwards)
        self.model_calls.inc(calls)
        self.token_forwards.inc(tf)
        self._add(calls, tf, 0, 0, 0)

    def finished(self, outcome: str, nfe: int, decided: int, useful: int) -> None:
        self.requests.labels(outcome).inc()
        self.decided.inc(decided)
        self.request_nfe.inc(nfe)
        self.useful.inc(useful)
        self._add(0, 0, useful, decided, nfe)

    def _add(self, calls: int, tf: int, useful: int, decided: int, nfe: int) -> None:
        with self._lock:
            self._samples.append((time.monotonic(), calls, tf, useful, decided, nfe))
            self._prune()

    def _prune(self) -> None:
        now = time.monotonic()
        while self._samples and self._samples[0][0] < now - self.window:
            self._samples.popleft()

    def _window_sums(self) -> list[int]:
        """(calls, token-forwards, useful, decided, nfe) of the last `window` seconds."""
        with self._lock:
            self._prune()
            return [sum(s[i] for s in self._samples) for i in range(1, 6)]


class _PrefixCollector(Collector):
    """The prefix store's numbers (unmask.engine.prefix_store.PrefixStats) at scrape time."""

    def __init__(self, store: PrefixStore) -> None:
        self.store = store

    def collect(self):
        s = self.store.stats
        yield CounterMetricFamily("unmask_prefix_hit_tokens", "Prompt positions read from the "
                                  "prefix store instead of forwarded", value=s.hit_tokens)
        yield CounterMetricFamily("unmask_prefix_evicted_blocks", "Blocks evicted from the "
                                  "prefix store to stay under its budget", value=s.evictions)
        yield GaugeMetricFamily("unmask_prefix_stored_blocks", "Blocks the prefix store holds",
                                value=s.stored_blocks)
        yield GaugeMetricFamily("unmask_prefix_stored_bytes", "Bytes of K/V the prefix store "
                                "holds", value=s.stored_bytes)
        yield GaugeMetricFamily("unmask_prefix_budget_bytes", "The prefix store's budget",
                                value=self.store.budget)
