"""The OpenAI-compatible HTTP API (FastAPI): `POST /v1/completions`, `POST
/v1/chat/completions` (both streamed as server-sent events with `"stream": true`), `GET
/v1/models`, `GET /health`, `GET /metrics`.

The request bodies are pydantic models that forbid unknown fields, so a field we do not
support (`logprobs`, `tools`, ...) is a 400 naming it, not silently ignored. Every error is
OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`): bad JSON, a bad
field, a prompt outside the vocabulary or the context window (`LLMError`) are 400, a full
queue is 429 with `Retry-After`, a missing or wrong API key 401.

Handlers run on the event loop; the prompt is tokenized in the thread pool and the model
runs on the scheduler's engine thread, which hands each job's events back to the loop. A
client that disconnects cancels its jobs, which frees their KV pages at the next step.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Literal, Sequence

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..errors import LLMError
from ..llm import LLM
from ..llm import Request as LLMRequest
from .metrics import CONTENT_TYPE
from .scheduler import Event, Job, QueueFull, Scheduler

# OpenAI's default for legacy completions; chat completions default to the context's rest.
COMPLETION_MAX_TOKENS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """The fields both endpoints take. `top_k` and `repetition_penalty` are extensions (as in
    vLLM); `temperature` defaults to 1 as in OpenAI's API (0: greedy)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionBody(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


class ChatBody(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class _Shape:
    """How one endpoint writes a choice, whole or as a streamed delta."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    @staticmethod
    def choice(index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    delta = choice

    @staticmethod
    def opening(index: int) -> dict | None:
        """A stream's first chunk for a choice, if the shape has one."""
        return None


class _ChatShape(_Shape):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    @staticmethod
    def choice(index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    @staticmethod
    def delta(index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": finish_reason}

    @staticmethod
    def opening(index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _field(loc: Sequence[Any]) -> str:
    return ".".join(str(part) for part in loc if part != "body")


async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    """Bad JSON or a bad field: 400, naming the fields (all unsupported ones at once)."""
    errors = exc.errors()
    unknown = [_field(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        names = ", ".join(f"'{name}'" for name in unknown)
        return error_response(400, f"unsupported field{'s' if len(unknown) > 1 else ''}: {names}",
                              param=unknown[0])
    first = errors[0]
    if first["type"] == "json_invalid":
        return error_response(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    field = _field(first["loc"])
    return error_response(400, f"{field or 'body'}: {first['msg']}", param=field or None)


def create_app(llm: LLM, scheduler: Scheduler, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app serving `llm` through `scheduler` (started and closed by the caller) under
    the model id `model_name`; with `api_key`, `/v1/*` needs `Authorization: Bearer KEY`."""
    app = FastAPI(title="gimlet-tvm", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(LLMError, lambda _, exc: error_response(400, str(exc)))
    app.add_exception_handler(QueueFull, lambda _, exc: error_response(
        429, str(exc), kind="rate_limit_error", headers={"Retry-After": str(exc.retry_after)}))
    app.add_exception_handler(HTTPException, lambda _, exc: error_response(
        exc.status_code, str(exc.detail), kind="authentication_error" if exc.status_code == 401 else
        "invalid_request_error", headers=exc.headers))

    async def authorize(request: Request) -> None:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if api_key is not None and not (scheme.lower() == "bearer" and secrets.compare_digest(key.strip(), api_key)):
            raise HTTPException(401, "a valid API key is needed: Authorization: Bearer <key>",
                                headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise HTTPException(404, f"model '{name}' is not served here; this server serves '{model_name}'")

    def requests_for(body: _Generation, prompt: str | list[int], max_tokens: int) -> list[LLMRequest]:
        sampling = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                    "repetition_penalty": body.repetition_penalty,
                    "stop": (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())}
        return [llm.request(prompt, max_tokens, seed=None if body.seed is None else body.seed + i, **sampling)
                for i in range(body.n)]

    @v1.post("/completions")
    async def completions(body: CompletionBody, http: Request) -> Response:
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise LLMError(f"one prompt per request is supported, not {len(prompt)}")
            prompt = prompt[0]
        requests = await run_in_threadpool(requests_for, body, prompt, body.max_tokens or COMPLETION_MAX_TOKENS)
        return await respond(_Shape, body, requests, http)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatBody, http: Request) -> Response:
        check_model(body.model)
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                     else "".join(part.text for part in m.content)} for m in body.messages]
        max_tokens = body.max_completion_tokens or body.max_tokens or llm.context_window
        requests = await run_in_threadpool(lambda: requests_for(body, llm.chat_prompt(messages), max_tokens))
        return await respond(_ChatShape, body, requests, http)

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "gimlet-tvm", "max_model_len": llm.context_window}]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not scheduler.alive:
            return error_response(503, "the engine thread has stopped", kind="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(scheduler.metrics.exposition(), media_type=CONTENT_TYPE)

    async def respond(shape: type[_Shape], body: _Generation, requests: list[LLMRequest], http: Request) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop has closed: the server is stopping
                pass

        jobs = scheduler.submit(requests, sink)
        head = {"id": f"{shape.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
        prompt_tokens = len(requests[0].prompt)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(stream(shape, head, jobs, queue, prompt_tokens if usage else None),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(shape, head, jobs, queue, prompt_tokens, http)

    async def events(jobs: list[Job], queue: asyncio.Queue[Event]) -> AsyncIterator[Event]:
        """The jobs' events until each has had its last; if the consumer stops first (the
        client went away), the jobs are cancelled."""
        left = len(jobs)
        try:
            while left:
                event = await queue.get()
                left -= event.last
                yield event
        finally:
            if left:
                scheduler.cancel(jobs)

    async def stream(shape: type[_Shape], head: dict, jobs: list[Job], queue: asyncio.Queue[Event],
                     prompt_tokens: int | None) -> AsyncIterator[str]:
        def chunk(choices: list[dict], **extra: Any) -> str:
            return _sse({**head, "object": shape.chunk_object, "choices": choices, **extra})

        tokens = [0] * len(jobs)
        openings = [shape.opening(job.index) for job in jobs]
        if all(openings):
            yield chunk(openings)
        async for event in events(jobs, queue):
            if event.error is not None:
                yield _sse({"error": {"message": event.error, "type": "server_error", "param": None,
                                      "code": None, "index": event.index}})
                continue
            tokens[event.index] = event.tokens
            yield chunk([shape.delta(event.index, event.text, event.finish_reason)])
        if prompt_tokens is not None:
            yield chunk([], usage=_usage(prompt_tokens, sum(tokens)))
        yield "data: [DONE]\n\n"

    async def collect(shape: type[_Shape], head: dict, jobs: list[Job], queue: asyncio.Queue[Event],
                      prompt_tokens: int, http: Request) -> Response:
        texts, finish, tokens = [""] * len(jobs), [None] * len(jobs), [0] * len(jobs)
        errors: list[str] = []
        async with anyio.create_task_group() as group:
            async def watch_disconnect() -> None:
                while (await http.receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()  # stops the loop below; `events` cancels the jobs

            group.start_soon(watch_disconnect)
            async for event in events(jobs, queue):
                texts[event.index] += event.text
                tokens[event.index], finish[event.index] = event.tokens, event.finish_reason
                if event.error is not None:
                    errors.append(event.error)
            group.cancel_scope.cancel()
        if errors:
            return error_response(500, f"the request failed: {errors[0]}", kind="server_error")
        return JSONResponse({**head, "object": shape.object,
                             "choices": [shape.choice(i, t, f) for i, (t, f) in enumerate(zip(texts, finish))],
                             "usage": _usage(prompt_tokens, sum(tokens))})

    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
