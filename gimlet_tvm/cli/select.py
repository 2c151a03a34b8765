"""`gimlet-tvm select MODEL -t TARGET --records DIR`: choose each op's kernel by verified
measurement (generated, library, hand-written, external, and a kernel generator's with
`--generator CMD`: docs/kernel-generators.md), on this machine or on a remote device (`--rpc
HOST:PORT`, or `--tracker HOST:PORT --key KEY`), and store the choice in DIR, where `compile
--records DIR` applies it."""

from __future__ import annotations

import collections
import sys
import time

import tvm

from ..compiler import resolve_target
from ..frontend import import_model, load_model
from ..schedules.kernel_selection.op_kinds import OP_KINDS, static_shape
from ..schedules.kernel_selection.choices import KernelSelection
from ..selection.generator import Generator
from ..selection.select import select_kernels, selected_sources
from .common import (add_remote_args, add_target_args, build_from_args, format_table, parse_input_shapes,
                     remote_device)


def add_parser(sub) -> None:
    parser = sub.add_parser("select", help="choose each op's kernel by verified measurement")
    parser.add_argument("model", help="ONNX model file")
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
    mod, _ = import_model(load_model(args.model), parse_input_shapes(args.input_shape))
    generator = Generator.named(args.generator, args.rounds, args.per_group_seconds) if args.generator else None
    selection = select_kernels(mod, target, external_dir=args.kernels, records=args.records,
                               timeout=args.timeout, remote=remote_device(args),
                               progress=lambda line: print(line, file=sys.stderr, flush=True), generator=generator)
    path = selection.save(args.records)
    print(format_selection(selection) or nothing_to_select(mod))
    counts = collections.Counter(selected_sources(selection))
    print(f"\nselected in {time.perf_counter() - start:.0f} s on {selection.device}: "
          + (", ".join(f"{n} {source}" for source, n in sorted(counts.items())) or "nothing")
          + f"; stored in {path}")
    build_from_args(args.model, args, records=args.records, selection=selection)
    print("model builds with the selection")
    return 0
