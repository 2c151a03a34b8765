"""`gimlet-tvm serve` as users meet it: the real server, started by its console entry point on
127.0.0.1, SmolLM2-135M (q8), talked to with OpenAI's own Python client and with raw HTTP.

Two servers run for the module: a roomy one (batch 8, queue 32, an API key) and a cramped
one (batch 2, queue 2, a KV cache of 256 tokens) for overload: the 429 of a full queue and
preemption when the cache fills.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

import gimlet_tvm.llm as gllm
from gimlet_tvm.serve import Event, Scheduler
from tests.llm_models import SMOLLM2_GGUF

MODEL = Path(SMOLLM2_GGUF).name
KEY = "test-key-1234"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Prompts SmolLM2 goes on with for hundreds of tokens (greedy), for long-running requests.
COUNTING = "Count: 1, 2, 3, 4, 5,"
COUNTING_TOO = "Count: 100, 101, 102, 103,"


class Server:
    """`gimlet-tvm serve` in a child process on a free loopback port; its log in `log`."""

    def __init__(self, folder: Path, *options: str):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"serve-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gimlet_tvm", "--threads", "2", "serve", SMOLLM2_GGUF, "-q", "q8",
                 "--port", str(self.port), *options], stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600) -> None:
        """Until /health answers (the first run compiles the model: a minute or two)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"the server did not come up in {timeout} s:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        """The /metrics samples by name (labels included), e.g. 'gimlet_kv_pages_in_use'."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r"^(\w+(?:\{[^}]*\})?) (\S+)$", text, re.MULTILINE)}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    (folder / "key").write_text(KEY + "\n")
    roomy = Server(folder, "--max-batch", "8", "--max-queue", "32", "--context-window", "512",
                   "--api-key-file", str(folder / "key"))
    cramped = Server(folder, "--max-batch", "2", "--max-queue", "2", "--context-window", "256",
                     "--kv-cache-tokens", "256")
    try:
        roomy.wait_ready()
        cramped.wait_ready()
        yield roomy, cramped
    finally:
        roomy.stop()
        cramped.stop()


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def cramped(servers) -> Server:
    return servers[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def complete(server: Server, prompt, max_tokens: int = 1, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields})


def test_completions_and_chat_whole_and_streamed(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    whole = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    [choice] = whole.choices
    assert "Paris" in choice.text and choice.finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 8)
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8
    stopped = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                        temperature=0, stop=["."])
    assert stopped.choices[0].text == " Paris" and stopped.choices[0].finish_reason == "stop"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert "Paris" in answer.choices[0].message.content and answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.role == "assistant"
    pieces = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == answer.choices[0].message.content
    assert pieces[-1].choices[0].finish_reason == "stop"

    # Sampling: n choices, repeatable with a seed.
    sampled = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                                         top_p=0.9, seed=7, n=2) for _ in range(2)]
    assert [c.index for c in sampled[0].choices] == [0, 1]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]


def test_32_concurrent_streams_get_their_greedy_tokens_alone(server, client):
    prompts = [f"Fact number {i} about the number {7 * i + 3}:" for i in range(32)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts]

    async def run_all() -> tuple[list, float]:
        together = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        busiest = 0.0
        done = asyncio.Event()

        async def one(prompt: str) -> tuple[str, str, int]:
            stream = await together.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                       stream=True, stream_options={"include_usage": True})
            text, finish, tokens = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return text, finish, tokens

        async def watch() -> None:
            nonlocal busiest
            async with httpx.AsyncClient() as http:
                while not done.is_set():
                    text = (await http.get(f"{server.url}/metrics")).text
                    busiest = max(busiest, float(re.search(r"^gimlet_running_sequences (\S+)$", text, re.M)[1]))
                    await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(one(p) for p in prompts))
        done.set()
        await watcher
        await together.close()
        return results, busiest

    results, busiest = asyncio.run(run_all())
    for prompt, single, (text, finish, tokens) in zip(prompts, alone, results):
        assert (text, finish, tokens) == (single.choices[0].text, single.choices[0].finish_reason,
                                          single.usage.completion_tokens), prompt
    assert busiest > 1, "the requests were never decoded in one batch"


def _settled(server: Server, timeout: float = 10) -> dict[str, float]:
    """The metrics once no sequence holds KV pages (or when `timeout` has passed)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        if (metrics["gimlet_kv_pages_in_use"], metrics["gimlet_running_sequences"]) == (0, 0) \
                or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


CANCELLED = 'gimlet_requests_total{outcome="cancelled"}'
FINISHED = 'gimlet_requests_total{outcome="finished"}'


def test_a_client_that_disconnects_frees_its_pages(server):
    """Mid-stream, and while waiting for a whole completion: 400 tokens would take seconds;
    the pages are free long before, and the request counts as cancelled, not finished."""
    before = server.metrics()
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 400, "temperature": 0}
    with httpx.Client(headers=AUTH, timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            seen = [line for line, _ in zip(lines, range(4)) if line.startswith("data:")]
            assert len(seen) >= 2
            during = server.metrics()
            assert during["gimlet_running_sequences"] == 1 and during["gimlet_kv_pages_in_use"] >= 1
    after = _settled(server)
    assert (after["gimlet_kv_pages_in_use"], after["gimlet_running_sequences"]) == (0, 0)
    assert after[CANCELLED] == before[CANCELLED] + 1 and after[FINISHED] == before[FINISHED]

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=1.5)
    final = _settled(server)
    assert (final["gimlet_kv_pages_in_use"], final["gimlet_running_sequences"]) == (0, 0)
    assert final[CANCELLED] == after[CANCELLED] + 1 and final[FINISHED] == after[FINISHED]
    assert complete(server, "Hi").status_code == 200


BAD_REQUESTS = [
    ("completions", b'{"prompt": "Hi", ', "not valid JSON"),
    ("completions", b"[1, 2]", "body"),
    ("completions", {"prompt": "Hi", "frobnicate": 1}, "unsupported field: 'frobnicate'"),
    ("completions", {"prompt": "Hi", "logprobs": 2, "echo": True}, "unsupported fields: 'logprobs', 'echo'"),
    ("completions", {"prompt": "hello " * 600}, "do not fit the context window of 512"),
    ("completions", {"prompt": [49152]}, "token id 49152 is outside the vocabulary"),
    ("completions", {"prompt": [1, -5]}, "token id -5 is outside the vocabulary"),
    ("completions", {"prompt": ""}, "empty"),
    ("completions", {"prompt": ["a", "b"]}, "one prompt per request"),
    ("completions", {"prompt": "Hi", "temperature": -1}, "temperature must be >= 0"),
    ("completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "Hi", "n": 40}, "do not fit the queue"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi", "name": "x"}]},
     "unsupported field: 'messages.0.name'"),
]


@pytest.mark.parametrize("endpoint,body,message", BAD_REQUESTS, ids=[m for _, _, m in BAD_REQUESTS])
def test_a_bad_request_is_a_400_naming_the_problem(server, endpoint, body, message):
    url = f"{server.url}/v1/{endpoint}"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={**AUTH, "Content-Type": "application/json"})
    else:
        response = httpx.post(url, json=body, headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert complete(server, "Hi").status_code == 200


def test_the_api_key_is_required(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 401
    wrong = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    unknown = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "gpt-4"}, headers=AUTH)
    assert unknown.status_code == 404 and MODEL in unknown.json()["error"]["message"]


def test_a_full_queue_answers_429_with_retry_after(cramped):
    """Batch 2 and queue 2: of 8 long requests sent at once, some must wait their turn
    at the client."""
    results: list[httpx.Response] = []

    def send() -> None:
        results.append(complete(cramped, COUNTING, max_tokens=60))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429} and codes.count(200) >= 2, codes
    for response in results:
        if response.status_code == 429:
            assert response.headers["Retry-After"] == "1"
            assert response.json()["error"]["type"] == "rate_limit_error"
    assert complete(cramped, "Hi").status_code == 200


def test_a_full_kv_cache_preempts_and_resumes(cramped):
    """Two counting requests of 160 tokens each cannot share a KV cache of 256 tokens: the
    newer one is preempted, resumed when the older ends, and gets its tokens alone."""
    alone = [complete(cramped, p, max_tokens=160).json()["choices"][0] for p in (COUNTING, COUNTING_TOO)]
    before = cramped.metrics()["gimlet_preemptions_total"]
    results: dict[str, dict] = {}

    def send(prompt: str) -> None:
        results[prompt] = complete(cramped, prompt, max_tokens=160).json()["choices"][0]

    threads = [threading.Thread(target=send, args=(p,)) for p in (COUNTING, COUNTING_TOO)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cramped.metrics()["gimlet_preemptions_total"] > before
    assert [results[p] for p in (COUNTING, COUNTING_TOO)] == alone
    assert cramped.metrics()["gimlet_kv_pages_in_use"] == 0


class FaultyRequest(gllm.Request):
    """A request whose third token choice raises: a fault on the engine thread, which no
    client input reaches (bad input is refused before it is queued)."""

    def choose(self, logits):
        if len(self.new) == 2:
            raise RuntimeError("injected fault")
        return super().choose(logits)


def test_a_fault_in_one_request_fails_that_request_only():
    """In process, the scheduler alone: the faulty request and a good one share the batch;
    the good one ends with its tokens alone, the cache ends empty, the next request runs."""
    llm = gllm.load(SMOLLM2_GGUF, quantization="q8", max_batch_size=4, context_window=256)
    prompt = "The capital of France is"
    alone = llm.generate(prompt, 8).text
    base = llm.request(COUNTING, 8)
    faulty = FaultyRequest(base.prompt, 8, base.params, llm.tokenizer, llm.context_window)
    scheduler = Scheduler(llm)
    scheduler.start()
    try:
        events: list[Event] = []
        scheduler.submit([faulty, llm.request(prompt, 8)], events.append)
        deadline = time.monotonic() + 120
        while sum(e.last for e in events) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        bad, good = ([e for e in events if e.index == i] for i in (0, 1))
        assert bad[-1].error == "injected fault" and bad[-1].tokens == 2
        assert "".join(e.text for e in good) == alone and good[-1].finish_reason is not None
        samples = scheduler.metrics.registry.get_sample_value
        assert samples("gimlet_requests_total", {"outcome": "failed"}) == 1
        while samples("gimlet_kv_pages_in_use") and time.monotonic() < deadline:  # read after each step
            time.sleep(0.05)
        assert samples("gimlet_kv_pages_in_use") == 0
        after: list[Event] = []
        scheduler.submit([llm.request(prompt, 8)], after.append)
        while not (after and after[-1].last) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "".join(e.text for e in after) == alone
    finally:
        scheduler.close()


def test_serve_warns_when_listening_beyond_loopback(cli):
    code, _, err = cli("serve", "missing.gguf", "--host", "0.0.0.0")
    assert "warning: listening on 0.0.0.0" in err and "WITHOUT an API key" in err
    assert code == 2 and "error:" in err
