"""`gimlet-tvm select MODEL -t TARGET --records DIR`: choose each op's kernel by verified
measurement (generated, library, hand-written, external, and a kernel generator's with
`--generator CMD`: docs/kernel-generators.md), on this machine or on a remote device (`--rpc
HOST:PORT`, or `--tracker HOST:PORT --key KEY`), and store the choice in DIR, where `compile
--records DIR` applies it. With `--quantization q8|q4` the model is a language model (an HF
folder or a .gguf file): its decode GEMVs' kernels are chosen (`select_llm_kernels`), which
`gimlet_tvm.llm.load(..., records=DIR)` applies."""

from __future__ import annotations

import collections
import os
import sys
import time

import tvm

from ..compiler import resolve_target
from ..errors import GimletError
from ..frontend import import_model, load_model
from ..llm.compile import compile_llm
from ..llm.kernel_selection import select_llm_kernels
from ..llm.quantization import QUANTIZATIONS
from ..llm.weights import open_checkpoint
from ..schedules.kernel_selection.op_kinds import OP_KINDS, static_shape
from ..schedules.kernel_selection.choices import SELECTION_FILE, KernelSelection
from ..selection.generator import Generator
from ..selection.select import select_kernels, selected_sources
from .common import (add_remote_args, add_target_args, build_from_args, format_table, parse_input_shapes,
                     remote_device)


def add_parser(sub) -> None:
    parser = sub.add_parser("select", help="choose each op's kernel by verified measurement")
    parser.add_argument("model", help="ONNX model file; with --quantization an LLM: an HF model folder or a .gguf file")
    add_target_args(parser)
    parser.add_argument("--records", metavar="DIR", required=True,
                        help="records directory to store the selection in (created if missing)")
    parser.add_argument("--kernels", metavar="DIR",
                        help="external kernel directory (with kernels.json) to take candidates from")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds one candidate's compile, check and timing may take (default 120)")
    parser.add_argument("--generator", metavar="CMD",
                        help="kernel generator: a shell command that reads a JSON task on stdin and prints "
                             "JSON candidates (docs/kernel-generators.md), or a bundled one: 'search' (a search "
                             "over a C GEMM template), 'openai --url URL --model MODEL' (a chat-completions "
                             "endpoint; key from $OPENAI_API_KEY)")
    parser.add_argument("--rounds", type=int, default=3, help="generator rounds per op group (default 3)")
    parser.add_argument("--per-group-seconds", type=float, default=300.0,
                        help="seconds the generator may take on one op group, rounds together (default 300)")
    parser.add_argument("-q", "--quantization", choices=[q for q in QUANTIZATIONS if q],
                        help="the model is a language model with its linear weights kept in this format: "
                             "select its decode GEMVs' kernels (this machine only)")
    add_remote_args(parser)
    parser.set_defaults(handler=run)


def format_selection(selection: KernelSelection) -> str:
    """A table per op: candidates, verified or why not, latency (the candidates raced
    together: median and range of their rounds), winner (a tie: see `SOURCE_PREFERENCE`)."""
    blocks = []
    for key, choice in selection.choices.items():
        fastest = min((t.seconds for t in choice.tried if t.verified), default=None)
        rows = [[t.id, ("yes (cached)" if t.cached else "yes") if t.verified else f"no: {t.reason}",
                 f"{t.seconds * 1e3:.3f}" if t.seconds is not None else "-",
                 f"{min(t.rounds) * 1e3:.3f}-{max(t.rounds) * 1e3:.3f} ({len(t.rounds)})" if t.rounds else "",
                 ("<- winner" + (" (ties the fastest)" if t.seconds > fastest else "")) if t.id == choice.winner
                 else ""] for t in choice.tried]
        header = f"{key}  (x{choice.count})  winner: {choice.winner or 'none verified: default'}"
        rounds = [f"generator round {r.round} ({r.seconds:.1f} s): "
                  + (f"failed: {r.failure}" if r.failure else f"{len(r.candidates)} candidates")
                  for r in choice.generator_rounds]
        blocks.append("\n".join([header, format_table(["candidate", "verified", "ms", "raced: range (rounds)", ""],
                                                      rows), *rounds]))
    return "\n\n".join(blocks)


def _symbolic_inputs(mod) -> list[str]:
    """`main`'s tensor inputs with a symbolic dim, as "name [batch, 1024]"."""
    found = []
    for param in mod["main"].params:
        dims = getattr(getattr(param.ty, "shape", None), "values", None)
        if dims is not None and static_shape(param) is None:
            shown = (str(d.value) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in dims)
            found.append(f"{param.name} [{', '.join(shown)}]")
    return found


def nothing_to_select(mod) -> str:
    """Why the selection is empty, and how to fix the shapes when that is why."""
    message = f"no op in this model has kernel candidates (static-shape {', '.join(OP_KINDS)})"
    symbolic = _symbolic_inputs(mod)
    if symbolic:
        message += (f"; inputs with symbolic dims: {', '.join(symbolic)}: fix them with "
                    "--input-shape NAME=D0,D1,... to select kernels at those shapes")
    return message


def run(args) -> int:
    start = time.perf_counter()
    _, target = resolve_target(args.target)
    generator = Generator.named(args.generator, args.rounds, args.per_group_seconds) if args.generator else None
    if args.quantization is not None:
        if remote_device(args) is not None or args.kernels or args.input_shape or not isinstance(args.target, str):
            raise GimletError("an LLM's kernels are selected on this machine, for one target, without --kernels or "
                              "--input-shape")
        selection = select_llm_kernels(args.model, args.target, args.quantization, records=args.records,
                                       generator=generator, timeout=args.timeout, progress=_progress)
        print(format_selection(selection) or "no op of this LLM has kernel candidates")
        _summary(selection, start, args.records)
        compile_llm(open_checkpoint(args.model).config, args.target, args.quantization, args.records)
        print("the LLM builds with the selection")
        return 0
    mod, _ = import_model(load_model(args.model), parse_input_shapes(args.input_shape))
    selection = select_kernels(mod, target, external_dir=args.kernels, records=args.records,
                               timeout=args.timeout, remote=remote_device(args), progress=_progress,
                               generator=generator)
    selection.save(args.records)
    print(format_selection(selection) or nothing_to_select(mod))
    _summary(selection, start, args.records)
    build_from_args(args.model, args, records=args.records, selection=selection)
    print("model builds with the selection")
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _summary(selection: KernelSelection, start: float, records: str) -> None:
    """How long selection took, where, what won, and where it is stored."""
    counts = collections.Counter(selected_sources(selection))
    print(f"\nselected in {time.perf_counter() - start:.0f} s on {selection.device}: "
          + (", ".join(f"{n} {source}" for source, n in sorted(counts.items())) or "nothing")
          + f"; stored in {os.path.join(records, SELECTION_FILE)}")
