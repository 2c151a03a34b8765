"""`gimlet-tvm generate MODEL --prompt TEXT`: stream a completion from an LLM (an HF folder or
a GGUF file), then one line of timings. Also the model options `chat` and `serve` share, and
the sampling options of `chat`."""

from __future__ import annotations

import sys
from typing import Generator

from ..llm import LLM, Generation, load
from ..llm.quantization import QUANTIZATIONS
from ..targets import DEFAULT_TARGET


def add_model_args(parser) -> None:
    """The model and where it runs."""
    parser.add_argument("model", help="an HF model folder (config.json, *.safetensors) or a .gguf file")
    parser.add_argument("-t", "--target", default=DEFAULT_TARGET, help="target name (default: %(default)s)")
    parser.add_argument("-q", "--quantization", choices=[q for q in QUANTIZATIONS if q],
                        help="keep linear weights quantized in memory")
    parser.add_argument("--compiled", help="a compiled architecture from `generate --export-compiled`")


def add_llm_args(parser) -> None:
    """The model, where it runs, and how it samples."""
    add_model_args(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def load_from_args(args, **options) -> LLM:
    """The model the command line names; `options`: more keyword arguments of `load`."""
    return load(args.model, args.target, args.quantization, compiled=args.compiled, **options)


def sampling_from_args(args) -> dict:
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
            "repetition_penalty": args.repetition_penalty, "seed": args.seed, "stop": tuple(args.stop)}


def print_stream(pieces: Generator[str, None, Generation]) -> Generation:
    """Write the pieces as they come; the finished generation."""
    while True:
        try:
            piece = next(pieces)
        except StopIteration as done:
            return done.value
        sys.stdout.write(piece)
        sys.stdout.flush()


def timings_line(result: Generation) -> str:
    prefill_rate = result.prompt_tokens / (result.prefill_ms / 1e3) if result.prefill_ms else 0.0
    return (f"[{result.prompt_tokens} prompt tokens, prefill {result.prefill_ms:.1f} ms "
            f"({prefill_rate:.1f} tokens/s); {len(result.token_ids)} new tokens, decode "
            f"{result.decode_tokens_per_s:.1f} tokens/s; finished: {result.finish_reason}]")


def add_parser(sub) -> None:
    parser = sub.add_parser("generate", help="stream an LLM's completion of a prompt")
    add_llm_args(parser)
    parser.add_argument("-p", "--prompt", required=True)
    parser.add_argument("--export-compiled", metavar="PATH",
                        help="also write the compiled architecture (no weights) to PATH")
    parser.set_defaults(handler=run)


def run(args) -> int:
    llm = load_from_args(args)
    if args.export_compiled:
        llm.export_compiled(args.export_compiled)
    result = print_stream(llm.stream(args.prompt, args.max_new_tokens, **sampling_from_args(args)))
    print()
    print(timings_line(result))
    return 0
