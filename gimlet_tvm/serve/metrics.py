"""The server's Prometheus metrics: what is waiting and running, the KV cache's pages, tokens
per second, and the latencies a user feels (time to the first token, time between tokens).

Each server has its own registry (not the process-wide default), so two servers in one
process, as in tests, do not share counts. The scheduler reports events; gauges read the
scheduler's state when scraped.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds. TTFT includes the wait in the queue; inter-token latency spans one engine step.
_TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Tokens per second is the tokens made in this many recent seconds, divided by them.
RATE_WINDOW_S = 10.0

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Counters and histograms the scheduler feeds (from its engine thread), gauges read on
    each scrape. `OUTCOMES` are the ways a request ends."""

    OUTCOMES = ("finished", "cancelled", "failed", "rejected")

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_length = Gauge("gimlet_queue_length", "Requests waiting for a place in the batch", registry=r)
        self.running = Gauge("gimlet_running_sequences", "Sequences in the KV cache (prefilling or decoding)",
                             registry=r)
        self.kv_pages_in_use = Gauge("gimlet_kv_pages_in_use", "KV-cache pages holding tokens", registry=r)
        self.kv_pages_total = Gauge("gimlet_kv_pages_total", "KV-cache pages in all", registry=r)
        self.tokens_per_s = Gauge("gimlet_tokens_per_second",
                                  f"Tokens generated per second over the last {RATE_WINDOW_S:g} s", registry=r)
        self.generated = Counter("gimlet_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("gimlet_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.requests = Counter("gimlet_requests", "Requests (one per choice) by how they ended", ["outcome"],
                                registry=r)
        self.preemptions = Counter("gimlet_preemptions", "Sequences taken out of a full KV cache to resume "
                                   "later", registry=r)
        self.ttft = Histogram("gimlet_time_to_first_token_seconds", "From submission to the first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("gimlet_inter_token_latency_seconds", "Between two tokens of one request",
                             buckets=_ITL_BUCKETS, registry=r)
        for outcome in self.OUTCOMES:
            self.requests.labels(outcome)  # present from the start, at 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self.tokens_per_s.set_function(self._rate)

    def watch(self, queue_length: Callable[[], int], running: Callable[[], int],
              kv_pages: Callable[[], tuple[int, int]]) -> None:
        """Read these on every scrape."""
        self.queue_length.set_function(queue_length)
        self.running.set_function(running)
        self.kv_pages_in_use.set_function(lambda: kv_pages()[0])
        self.kv_pages_total.set_function(lambda: kv_pages()[1])

    def tokens(self, count: int) -> None:
        """`count` tokens were generated just now."""
        self.generated.inc(count)
        with self._lock:
            self._recent.append((time.monotonic(), count))

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(count for _, count in self._recent) / RATE_WINDOW_S

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
