"""`gimlet-tvm chat MODEL`: an interactive conversation in the model's chat template. Each
line read is a user turn; the answer streams back. `/reset` starts over, `/exit` or end of
input ends. A turn the model cannot take (too long for the context) is reported and dropped."""

from __future__ import annotations

import sys

from ..errors import LLMError
from .generate import add_llm_args, load_from_args, print_stream, sampling_from_args, timings_line


def add_parser(sub) -> None:
    parser = sub.add_parser("chat", help="talk with an LLM in its chat template")
    add_llm_args(parser)
    parser.add_argument("--system", help="a system message to start the conversation with")
    parser.add_argument("--timings", action="store_true", help="print timings after each answer")
    parser.set_defaults(handler=run)


def run(args) -> int:
    llm = load_from_args(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return 0
        text = line.strip()
        if text == "/reset":
            messages = list(start)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        try:
            result = print_stream(llm.stream(llm.chat_prompt(messages), args.max_new_tokens,
                                             **sampling_from_args(args)))
        except LLMError as err:
            messages.pop()
            print(f"gimlet-tvm: error: {err}", file=sys.stderr)
            continue
        print()
        messages.append({"role": "assistant", "content": result.text})
        if args.timings:
            print(timings_line(result), file=sys.stderr)
