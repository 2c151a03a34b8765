"""`gimlet-tvm serve MODEL`: an OpenAI-compatible HTTP server for an LLM (`/v1/completions`,
`/v1/chat/completions`, `/v1/models`, `/health`, `/metrics`), batching concurrent requests
on the paged KV cache. Listens on the loopback interface unless `--host` says otherwise, and
then warns loudly; `--api-key-file` makes `/v1/*` require `Authorization: Bearer <key>`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import uvicorn

from ..errors import InputError
from ..logs import verbose
from ..runtime.rpc_auth import is_loopback
from ..serve import Scheduler, create_app
from .generate import add_model_args, load_from_args

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    parser = sub.add_parser("serve", help="serve an LLM over an OpenAI-compatible HTTP API")
    add_model_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, "
                        "this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=16, help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting for a place; more are answered 429 (default: %(default)s)")
    parser.add_argument("--context-window", type=int, help="tokens of one sequence (default: the model's)")
    parser.add_argument("--kv-cache-tokens", type=int,
                        help="KV-cache room of all sequences together (default: one context window)")
    parser.add_argument("--prefill-chunk", type=int, default=64,
                        help="prompt tokens prefilled per step, between decode steps: a longer prompt "
                             "holds up the others' next token for one chunk at a time (default: %(default)s)")
    parser.add_argument("--api-key-file", help="a file holding the API key clients must send")
    parser.set_defaults(handler=run)


def _api_key(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        key = Path(path).read_text().strip()
    except OSError as err:
        raise InputError(f"--api-key-file {path}: {err.strerror}") from err
    if not key:
        raise InputError(f"--api-key-file {path} is empty")
    return key


def run(args) -> int:
    api_key = _api_key(args.api_key_file)
    if not is_loopback(args.host):
        log.warning("listening on %s: the server is reachable from other machines%s", args.host,
                    "" if api_key else ", and WITHOUT an API key anyone who reaches it can use it "
                    "(--api-key-file)")
    llm = load_from_args(args, max_batch_size=args.max_batch, context_window=args.context_window,
                         kv_cache_tokens=args.kv_cache_tokens)
    scheduler = Scheduler(llm, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk)
    scheduler.start()
    name = Path(args.model).name
    print(f"gimlet-tvm: serving {name} on http://{args.host}:{args.port}/v1 (max batch {args.max_batch}, "
          f"context {llm.context_window}, KV cache {llm.kv_cache_tokens} tokens)", file=sys.stderr, flush=True)
    try:
        uvicorn.run(create_app(llm, scheduler, name, api_key), host=args.host, port=args.port,
                    log_level="info" if verbose() else "warning", access_log=verbose(),
                    timeout_graceful_shutdown=5)
    finally:
        scheduler.close()
    return 0
