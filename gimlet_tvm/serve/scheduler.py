"""Continuous batching over the engine's KV-cache steps, on one engine thread.

Requests (checked `gimlet_tvm.llm.Request`s) wait in a bounded queue. Each step the
scheduler

1. drops the jobs whose client went away, freeing their KV pages at once;
2. admits the oldest waiting jobs while there is a place in the batch and the KV pages for
   every admitted job's whole history plus one token;
3. runs one `decode` call for every job with one token to feed, and one `prefill` call for
   up to `prefill_chunk` tokens of the jobs still being prefilled, so a long prompt holds up
   the others' decode for one chunk at a time, not for all of it;
4. lets each job choose and accept its next token, sends what became visible to its sink,
   and removes finished jobs from the cache.

A job's history is its prompt and the tokens accepted so far; the tokens of it not yet in
the KV cache are fed next. That one rule covers prefill, decode, and resumption: when the
decode batch outgrows the cache, the newest job is preempted (its sequence removed, the job
put back at the head of the queue) and, once readmitted, prefills its whole history again
and goes on where it stopped (with greedy sampling, to the same tokens).

A failure stays with the jobs it concerns: an exception while choosing or accepting a token
fails that job; an engine call that raises fails the jobs in that call; the loop serves on.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from typing import Callable, Sequence

import numpy as np

from ..errors import LLMError, summary
from ..llm import LLM, Request
from ..llm.engine import PAGE_SIZE
from .metrics import Metrics

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The queue holds `max_queue` requests already; try again in `retry_after` seconds."""

    def __init__(self, max_queue: int, retry_after: int):
        super().__init__(f"the server's queue is full ({max_queue} requests waiting); retry later")
        self.retry_after = retry_after


@dataclasses.dataclass(frozen=True)
class Event:
    """What a step did for one job: `text` is newly visible text (a stop string's possible
    start is held back), `tokens` the tokens generated so far. A job's last event has a
    `finish_reason` ("stop", "length") or an `error`."""

    index: int
    text: str
    tokens: int
    finish_reason: str | None = None
    error: str | None = None

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


Sink = Callable[[Event], None]


class Job:
    """One request in the scheduler: its `Request` (whose `seq_id` is its sequence while it
    is in the KV cache), its place among the choices of one HTTP request (`index`), where its
    events go, and how much of its history the cache holds."""

    def __init__(self, request: Request, index: int, sink: Sink):
        self.request, self.index, self.sink = request, index, sink
        self.submitted = time.monotonic()
        self.last_token_at: float | None = None
        self.cached = 0        # tokens of the history in the KV cache
        self.shown = 0         # characters of visible text sent
        self.cancelled = False

    @property
    def history(self) -> list[int]:
        return self.request.prompt + self.request.new

    def pending(self) -> list[int]:
        """The history's tokens not yet in the cache: one while decoding."""
        return self.history[self.cached:]


def pages(tokens: int) -> int:
    """The KV pages a sequence of `tokens` tokens holds."""
    return math.ceil(tokens / PAGE_SIZE)


class Scheduler:
    """Runs `llm` for many requests at once on its own thread (`start`, `close`). `submit`
    and `cancel` may be called from any thread; sinks are called on the engine thread and
    must not block. While it runs, the scheduler owns the model's KV cache: nothing else may
    add sequences or step the model."""

    def __init__(self, llm: LLM, max_queue: int = 64, prefill_chunk: int = 64,
                 metrics: Metrics | None = None):
        self.llm, self.max_queue = llm, max_queue
        self.prefill_chunk = min(prefill_chunk, llm.prefill_chunk)
        if max_queue < 1 or self.prefill_chunk < 1:
            raise LLMError(f"max_queue and prefill_chunk must be at least 1, not {max_queue}, {prefill_chunk}")
        self.kv_pages = llm.kv_pages()   # (in use, in all), updated by the engine thread
        if llm.context_window > self.kv_pages[1] * PAGE_SIZE:
            raise LLMError(f"the KV cache ({self.kv_pages[1] * PAGE_SIZE} tokens) must hold one full "
                           f"context window ({llm.context_window} tokens)")
        self.metrics = metrics or Metrics()
        self.metrics.watch(lambda: len(self._waiting), lambda: len(self._running), lambda: self.kv_pages)
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []      # in the KV cache, oldest first
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="gimlet-engine", daemon=True)

    # --- any thread -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the engine thread; jobs still queued or running end with an error event."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, requests: Sequence[Request], sink: Sink) -> list[Job]:
        """Queue the requests (the choices of one HTTP request, events tagged with their
        index), all or none: `QueueFull` when they do not fit the queue."""
        if len(requests) > self.max_queue:
            raise LLMError(f"{len(requests)} choices do not fit the queue of {self.max_queue}")
        jobs = [Job(request, index, sink) for index, request in enumerate(requests)]
        with self._wake:
            if self._closing:
                raise LLMError("the server is shutting down")
            if len(self._waiting) + len(jobs) > self.max_queue:
                self.metrics.requests.labels("rejected").inc(len(jobs))
                raise QueueFull(self.max_queue, retry_after=1)
            self._waiting.extend(jobs)
            self._wake.notify()
        return jobs

    def cancel(self, jobs: Sequence[Job]) -> None:
        """The client went away: the engine thread drops these jobs before its next step
        (finished ones are gone already)."""
        with self._wake:
            for job in jobs:
                job.cancelled = True
            self._wake.notify()

    # --- the engine thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._closing or self._waiting or self._running):
                    self._wake.wait()
                if self._closing:
                    break
            try:
                self._step()
            except Exception as err:  # a fault of the scheduler itself: fail what runs, serve on
                log.exception("scheduler step failed")
                for job in list(self._running):
                    self._fail(job, err)
            self.kv_pages = self.llm.kv_pages()
        with self._wake:
            for job in [*self._running, *self._waiting]:
                self._fail(job, LLMError("the server is shutting down"))

    def _step(self) -> None:
        self._drop_cancelled()
        self._admit()
        decode, prefill = self._plan()
        if decode:
            self._decode(decode)
        if prefill:
            self._prefill(prefill)
        for job in [j for j in self._running if j.request.done]:
            self._leave(job, "finished")

    def _drop_cancelled(self) -> None:
        with self._wake:
            for job in [j for j in self._waiting if j.cancelled]:
                self._waiting.remove(job)
                self.metrics.requests.labels("cancelled").inc()
        for job in [j for j in self._running if j.cancelled]:
            self._leave(job, "cancelled")
        self.kv_pages = self.llm.kv_pages()

    def _admit(self) -> None:
        """Oldest first, while there is a place in the batch and pages for each admitted job's
        whole history and one token more (a job that does not fit waits, and so do the ones
        behind it)."""
        total = self.kv_pages[1]
        committed = sum(pages(len(j.history) + 1) for j in self._running)
        with self._wake:
            while self._waiting and len(self._running) < self.llm.max_batch_size:
                job = self._waiting[0]
                need = pages(len(job.history) + 1)
                if self._running and committed + need > total:
                    break
                self._waiting.popleft()
                job.request.seq_id = self.llm.add_sequence()
                self._running.append(job)
                committed += need
                if not job.request.new:
                    self.metrics.prompt_tokens.inc(len(job.request.prompt))

    def _plan(self) -> tuple[list[Job], list[tuple[Job, list[int]]]]:
        """This step's work: the jobs to decode, and (job, tokens) to prefill. A prompt
        longer than the chunk starts on an empty chunk, so it is split at the same places
        however many others run. Preempts the newest jobs while the work does not fit the
        cache."""
        while True:
            decode = [j for j in self._running if j.cached and len(j.pending()) == 1]
            prefill, room = [], self.prefill_chunk
            for job in self._running:
                todo = job.pending()
                if job in decode or not todo:
                    continue
                if len(todo) > room and room < self.prefill_chunk:
                    break
                take = todo[:room]
                prefill.append((job, take))
                room -= len(take)
                if not room:
                    break
            growth = {id(j): 1 for j in decode} | {id(j): len(t) for j, t in prefill}
            need = sum(pages(j.cached + growth.get(id(j), 0)) for j in self._running)
            if need <= self.kv_pages[1] or len(self._running) == 1:
                return decode, prefill
            self._preempt(self._running[-1])

    def _preempt(self, job: Job) -> None:
        self.llm.remove_sequence(job.request.seq_id)
        job.request.seq_id, job.cached = -1, 0
        self._running.remove(job)
        with self._wake:
            self._waiting.appendleft(job)
        self.metrics.preemptions.inc()

    def _decode(self, jobs: list[Job]) -> None:
        """One token for each job. (A speculative decoding step would go here: draft several
        tokens, verify them in one call, `popn` the rejected ones.)"""
        try:
            logits = self.llm.decode([j.request.seq_id for j in jobs], [j.pending()[0] for j in jobs])
        except Exception as err:
            for job in jobs:
                self._fail(job, err)
            return
        for job, row in zip(jobs, logits):
            job.cached += 1
            self._advance(job, row)

    def _prefill(self, work: list[tuple[Job, list[int]]]) -> None:
        try:
            logits = self.llm.prefill([j.request.seq_id for j, _ in work], [t for _, t in work])
        except Exception as err:
            for job, _ in work:
                self._fail(job, err)
            return
        for (job, tokens), row in zip(work, logits):
            job.cached += len(tokens)
            if job.cached == len(job.history):
                self._advance(job, row)

    def _advance(self, job: Job, logits: np.ndarray) -> None:
        """The job's next token from the logits after its history; its newly visible text
        to its sink."""
        request = job.request
        try:
            request.accept(request.choose(logits))
        except Exception as err:
            self._fail(job, err)
            return
        now = time.monotonic()
        if job.last_token_at is None:
            self.metrics.ttft.observe(now - job.submitted)
        else:
            self.metrics.itl.observe(now - job.last_token_at)
        job.last_token_at = now
        self.metrics.tokens(1)
        visible = request.visible_text()
        if len(visible) > job.shown or request.done:
            job.sink(Event(job.index, visible[job.shown:], len(request.new), request.finish_reason))
            job.shown = len(visible)

    def _leave(self, job: Job, outcome: str) -> None:
        """Take a job out of the batch and its pages out of the cache."""
        if job.request.seq_id >= 0:
            self.llm.remove_sequence(job.request.seq_id)
            job.request.seq_id = -1
        if job in self._running:
            self._running.remove(job)
        self.metrics.requests.labels(outcome).inc()

    def _fail(self, job: Job, err: BaseException) -> None:
        if not isinstance(err, LLMError):
            log.error("request failed: %s", summary(err), exc_info=err)
        if job in self._waiting:
            self._waiting.remove(job)
        self._leave(job, "failed")
        job.sink(Event(job.index, "", len(job.request.new), error=str(err) or summary(err)))
