"""Load test of `gimlet-tvm serve` against llama.cpp's OpenAI-compatible server
(``llama-cpp-python[server]``), both serving SmolLM2-135M-Instruct from the same Q4_1 GGUF
with the same number of threads, on 127.0.0.1 only.

    .venv/bin/python benchmarks/serve.py [--concurrency 1 4 16 32] [--requests-per-client 2]
                                         [--max-tokens 64] [--rounds 3] [--threads 2]
                                         [--quantization q4] [--engines ours llamacpp] [--json OUT]

Both servers are started once, in their own processes, and warmed up. Each round then runs
every concurrency level against each server in turn (so drifts in the machine's load hit both
alike): C clients send streaming completions back to back, ``C * --requests-per-client``
requests in all (at least 8), and no new request starts after ``--max-seconds``. The prompts
are counting prompts, on which ours greedily generates all ``--max-tokens`` tokens; llama.cpp's
greedy text ends early on some of them, so it gets ``min_tokens`` (its server's extension)
too. A request that streams fewer chunks than that is reported with a WARNING.

Measured from the client: throughput (streamed tokens of all requests / the level's wall
time), time to first token (request sent to first text) and inter-token latency (gaps between
successive text chunks of one stream; one chunk is one token for both servers here, ASCII
text). Reported: median throughput over the rounds with its range, and the p50/p99 of TTFT
and ITL over every request of every round.

llama.cpp's server runs one request at a time (its Python server has no continuous batching;
``--interrupt_requests False`` makes later requests wait instead of cutting the running one
off); ours batches up to ``--max-batch`` (default: serve's own, 16; on 2 cores a decode step
of 32 sequences costs more than two of 16).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import llm_models  # noqa: E402  (benchmarks/ is not a package)
from machine_info import cpu_name, versions  # noqa: E402

ENGINES = ("ours", "llamacpp")
LABELS = {"ours": "gimlet-tvm serve", "llamacpp": "llama.cpp server (llama-cpp-python)"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One server in a child process on a free loopback port; `model` is the id it serves."""

    def __init__(self, engine: str, args: argparse.Namespace, log_dir: Path):
        self.engine, self.port = engine, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        gguf = str(llm_models.gguf_path())
        if engine == "ours":
            command = [sys.executable, "-m", "gimlet_tvm", "--threads", str(args.threads), "serve", gguf,
                       "-q", args.quantization, "--port", str(self.port),
                       *(["--max-batch", str(args.max_batch)] if args.max_batch else []),
                       "--max-queue", str(4 * max(args.concurrency)), "--context-window", "2048"]
        else:
            command = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                       "--port", str(self.port), "--n_threads", str(args.threads),
                       "--n_threads_batch", str(args.threads), "--n_ctx", "2048",
                       "--interrupt_requests", "False"]
        self.log = log_dir / f"{engine}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        self.model = ""

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                models = httpx.get(f"{self.url}/v1/models", timeout=2)
                if models.status_code == 200:
                    self.model = models.json()["data"][0]["id"]
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.engine} did not come up in {timeout} s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def prompt(index: int) -> str:
    start = 10 + 37 * index
    return "Count: " + ", ".join(str(start + k) for k in range(4)) + ","


async def one_request(http: httpx.AsyncClient, server: Server, text: str, max_tokens: int) -> dict:
    """One streamed completion: its TTFT, the gaps between its chunks, its token count."""
    body = {"model": server.model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if server.engine == "llamacpp":
        body["min_tokens"] = max_tokens  # its greedy text ends early on some prompts; ours counts on
    start = time.perf_counter()
    stamps = []
    async with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.engine}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{server.engine}: a stream without text")
    return {"ttft": stamps[0] - start, "gaps": list(np.diff(stamps)), "tokens": len(stamps)}


async def load_level(server: Server, clients: int, requests: int, max_tokens: int, max_seconds: float) -> dict:
    """`clients` concurrent clients, `requests` in all, none started after `max_seconds`."""
    next_index = 0
    results: list[dict] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start = time.perf_counter()

        async def client() -> None:
            nonlocal next_index
            while next_index < requests and time.perf_counter() - start < max_seconds:
                index, next_index = next_index, next_index + 1
                results.append(await one_request(http, server, prompt(index), max_tokens))

        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    short = sum(r["tokens"] < max_tokens for r in results)
    if short:
        print(f"WARNING: {server.engine}: {short} of {len(results)} requests streamed fewer than {max_tokens} "
              "tokens (an early end, or chunks of several tokens)", flush=True)
    return {"requests": len(results), "tokens": tokens, "short": short, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft": [r["ttft"] for r in results], "itl": [g for r in results for g in r["gaps"]]}


def summarize(runs: dict) -> dict:
    """Per engine and level: throughput median and range over rounds; TTFT and ITL p50/p99
    (ms) over all requests."""
    out: dict = {}
    for engine, levels in runs.items():
        for level, rounds in levels.items():
            rates = [r["tokens_per_s"] for r in rounds]
            ttft = np.concatenate([r["ttft"] for r in rounds]) * 1e3
            itl = np.concatenate([r["itl"] for r in rounds]) * 1e3
            out.setdefault(engine, {})[level] = {
                "tokens_per_s": float(np.median(rates)), "tokens_per_s_range": [min(rates), max(rates)],
                "ttft_ms_p50": float(np.percentile(ttft, 50)), "ttft_ms_p99": float(np.percentile(ttft, 99)),
                "itl_ms_p50": float(np.percentile(itl, 50)), "itl_ms_p99": float(np.percentile(itl, 99)),
                "requests": sum(r["requests"] for r in rounds)}
    return out


def table(summary: dict, engines: list[str], levels: list[int]) -> str:
    lines = ["| clients | server | tokens/s, median (range) | TTFT p50 / p99 ms | ITL p50 / p99 ms | requests |",
             "|---|---|---|---|---|---|"]
    for level in levels:
        for engine in engines:
            s = summary.get(engine, {}).get(level)
            if s is None:
                continue
            low, high = s["tokens_per_s_range"]
            lines.append(f"| {level} | {LABELS[engine]} | {s['tokens_per_s']:.1f} ({low:.1f}–{high:.1f}) | "
                         f"{s['ttft_ms_p50']:.0f} / {s['ttft_ms_p99']:.0f} | "
                         f"{s['itl_ms_p50']:.1f} / {s['itl_ms_p99']:.1f} | {s['requests']} |")
    if {"ours", "llamacpp"} <= summary.keys():
        lines += ["", "| clients | throughput ours / llama.cpp | TTFT p50 ours / llama.cpp | ITL p50 ours / llama.cpp |",
                  "|---|---|---|---|"]
        for level in levels:
            o, l = summary["ours"].get(level), summary["llamacpp"].get(level)
            if o and l:
                lines.append(f"| {level} | {o['tokens_per_s'] / l['tokens_per_s']:.2f}x | "
                             f"{o['ttft_ms_p50'] / l['ttft_ms_p50']:.2f}x | {o['itl_ms_p50'] / l['itl_ms_p50']:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16, 32])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=300, help="no new request after this, per level")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default="q4", choices=["q4", "q8"],
                        help="ours: q4 keeps the GGUF's Q4_1 blocks as llama.cpp does (default)")
    parser.add_argument("--max-batch", type=int, help="ours: the batch (default: serve's, 16)")
    parser.add_argument("--json", help="write every measurement here")
    args = parser.parse_args()

    unavailable = {}
    engines = list(args.engines)
    if "llamacpp" in engines:
        try:
            import llama_cpp.server  # noqa: F401
        except ImportError as err:
            unavailable["llamacpp"] = f"llama-cpp-python[server] is not installed ({err})"
            engines.remove("llamacpp")
    load_at_start = os.getloadavg()[0]
    log_dir = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    servers = {engine: Server(engine, args, log_dir) for engine in engines}
    runs: dict = {engine: {} for engine in engines}
    try:
        for server in servers.values():
            server.wait_ready()
            asyncio.run(load_level(server, 1, 2, args.max_tokens, args.max_seconds))  # warm-up
        for round_index in range(args.rounds):
            for level in args.concurrency:
                for engine in engines if round_index % 2 == 0 else engines[::-1]:
                    requests = max(8, level * args.requests_per_client)
                    result = asyncio.run(load_level(servers[engine], level, requests, args.max_tokens,
                                                    args.max_seconds))
                    runs[engine].setdefault(level, []).append(result)
                    print(f"round {round_index + 1} clients {level:>2} {engine:>8}: {result['tokens_per_s']:7.1f} "
                          f"tokens/s, {result['requests']} requests in {result['wall_s']:.1f} s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    summary = summarize(runs)
    header = (f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}. Machine: {cpu_name()}, {os.cpu_count()} logical "
              f"cores. Threads: {args.threads} per server. Ours: -q {args.quantization}, max batch "
              f"{args.max_batch or 16}, prefill chunk 64. {args.rounds} rounds; per level "
              f"max(8, clients x {args.requests_per_client}) streamed requests of {args.max_tokens} tokens. "
              f"Load average (1 min) at the start {load_at_start:.2f}, at the end {os.getloadavg()[0]:.2f}.\nVersions: "
              + ", ".join(f"{k} {v}" for k, v in versions(("gimlet-tvm", "apache-tvm", "llama-cpp-python", "fastapi", "uvicorn")).items() if v))
    print()
    print(header)
    print()
    print(table(summary, engines, args.concurrency))
    for engine, reason in unavailable.items():
        print(f"\n{LABELS[engine]}: not run: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "summary": summary, "unavailable": unavailable,
                                               "runs": runs}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
