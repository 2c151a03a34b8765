"""`gimlet-tvm generate MODEL --prompt TEXT`: stream a completion from an LLM (an HF folder or
a GGUF file), then one line of timings. Also the model options `chat` and `serve` share, and
the sampling options of `chat`.

With `--draft`, decoding is speculative (prompt lookup, or a draft model: another model with
the same vocabulary, or this one cut to `--draft-layers` or quantized with
`--draft-quantization`); the same prompt then runs once more without the draft, and a second
line compares the two."""

from __future__ import annotations

import sys
from typing import Generator

from ..llm import LLM, Draft, Generation, load
from ..llm.speculative import PROMPT_LOOKUP
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


def speculation_line(draft: Draft, result: Generation, plain: Generation) -> str:
    stats = result.speculation
    same = "same tokens" if result.token_ids == plain.token_ids else "other tokens (sampled)"
    return (f"[speculative, {draft.name}: {stats.accepted} of {stats.proposed} proposals accepted "
            f"({stats.acceptance_rate:.0%}), decode {result.decode_tokens_per_s:.1f} tokens/s; without: "
            f"{plain.decode_tokens_per_s:.1f} tokens/s ({result.decode_tokens_per_s / plain.decode_tokens_per_s:.2f}x), "
            f"{same}]")


def add_parser(sub) -> None:
    parser = sub.add_parser("generate", help="stream an LLM's completion of a prompt")
    add_llm_args(parser)
    parser.add_argument("-p", "--prompt", required=True)
    parser.add_argument("--export-compiled", metavar="PATH",
                        help="also write the compiled architecture (no weights) to PATH")
    parser.add_argument("--draft", metavar=f"MODEL|{PROMPT_LOOKUP}",
                        help="speculative decoding: proposals from prompt lookup or a draft model")
    parser.add_argument("--draft-target", help="where the draft model runs (default: --target)")
    parser.add_argument("--draft-quantization", choices=[q for q in QUANTIZATIONS if q])
    parser.add_argument("--draft-layers", type=int, help="keep only the draft model's first layers")
    parser.add_argument("--draft-k", type=int, default=4, help="proposals per round at most")
    parser.set_defaults(handler=run)


def draft_from_args(args) -> Draft | None:
    if args.draft is None:
        return None
    if args.draft == PROMPT_LOOKUP:
        return Draft(PROMPT_LOOKUP, k=args.draft_k)
    model = load(args.draft, args.draft_target or args.target, args.draft_quantization, layers=args.draft_layers)
    return Draft(model, k=args.draft_k)


def run(args) -> int:
    llm = load_from_args(args)
    if args.export_compiled:
        llm.export_compiled(args.export_compiled)
    draft = draft_from_args(args)
    sampling = sampling_from_args(args)
    result = print_stream(llm.stream(args.prompt, args.max_new_tokens, speculative=draft, **sampling))
    print()
    print(timings_line(result))
    if draft is not None:
        print(speculation_line(draft, result, llm.generate(args.prompt, args.max_new_tokens, **sampling)))
    return 0
