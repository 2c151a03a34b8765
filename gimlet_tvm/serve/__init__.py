"""Serving an LLM over HTTP: an OpenAI-compatible API with continuous batching.

    gimlet-tvm serve SmolLM2-135M-Instruct.Q4_1.gguf -q q8 --port 8000

Modules: `scheduler` (continuous batching over the engine's KV-cache steps on one engine
thread: admission, chunked prefill, preemption when the cache is full, cancellation),
`api` (the FastAPI app: OpenAI's request and response shapes, errors, streaming),
`metrics` (Prometheus text: queue, batch, KV pages, tokens/s, latency histograms). The
`gimlet-tvm serve` subcommand (`gimlet_tvm.cli.serve`) puts them together on uvicorn.
"""

from .api import create_app
from .metrics import Metrics
from .scheduler import Event, Job, QueueFull, Scheduler

__all__ = ["Event", "Job", "Metrics", "QueueFull", "Scheduler", "create_app"]
