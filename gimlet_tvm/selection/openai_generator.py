"""A kernel generator that asks a language model: the task sent to an OpenAI-compatible
chat-completions endpoint, its answer turned into the protocol's candidate list.

    gimlet-tvm select model.onnx --records DIR --generator "openai --url https://HOST/v1 --model MODEL"

The key is read from the environment variable `--key-env` names (default OPENAI_API_KEY;
none: no Authorization header). It speaks the kernel generator protocol
(docs/kernel-generators.md): the task from standard input goes to the model as JSON with
`PROMPT` as the system message; the model's reply must hold a JSON list of candidates, bare or
in a ```json block. Whatever it answers is checked by the compiler like any generator's:
malformed output fails the round, and every kernel is verified before it can win. Standard
library only: it runs as a script, without the package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request
from typing import Any

PROMPT = """You write fast, correct compute kernels for a compiler. The user message is a JSON task:
the op group to implement (group), what it computes (reference: TVMScript and a numpy
expression), the target (its CPU features), the source formats accepted (formats) and the exact
interface for each (interface), the best kernel so far and its time (best), and your earlier
attempts with their verdicts and errors (history). Learn from the history: fix what was wrong,
make what was right faster. Answer with only a JSON list of candidates, each
{"format": one of the task's formats, "source": the complete source, "name": a short name}."""
FENCED = re.compile(r"```(?:json)?\s*(\[.*?\])\s*```", re.DOTALL)


def ask(url: str, model: str, key: str | None, task: dict[str, Any], timeout: float) -> str:
    """The model's reply to the task (the first choice's message content)."""
    body = {"model": model, "messages": [{"role": "system", "content": PROMPT},
                                         {"role": "user", "content": json.dumps(task)}]}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url.rstrip("/") + "/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)["choices"][0]["message"]["content"]


def candidates(reply: str) -> Any:
    """The JSON list in a reply: the whole reply, else its first ```json block; else the reply
    as it is (the compiler then calls it malformed)."""
    for text in (reply, *(m.group(1) for m in FENCED.finditer(reply))):
        try:
            return json.loads(text)
        except ValueError:
            continue
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the API's base URL, e.g. https://api.openai.com/v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--key-env", default="OPENAI_API_KEY", help="environment variable holding the key")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the reply")
    args = parser.parse_args()
    try:
        reply = ask(args.url, args.model, os.environ.get(args.key_env), json.load(sys.stdin), args.timeout)
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as err:
        sys.exit(f"the endpoint gave no answer: {err}")
    found = candidates(reply)
    print(found if isinstance(found, str) else json.dumps(found))


if __name__ == "__main__":
    main()
