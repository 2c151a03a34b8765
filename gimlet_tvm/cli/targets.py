"""`gimlet-tvm targets`: registered targets, their facts, and what this machine can do."""

from __future__ import annotations

from ..targets import registered
from .common import format_table


def add_parser(sub) -> None:
    parser = sub.add_parser("targets", help="list registered targets")
    parser.set_defaults(handler=run)


def run(args) -> int:
    rows = []
    for spec in registered():
        facts = ", ".join(f"{k}={v}" for k, v in spec.facts().items())
        rows.append([
            spec.name,
            ",".join(spec.aliases) or "-",
            "yes" if spec.can_compile() else "no",
            "yes" if spec.can_run() else "no",
            spec.description,
            facts,
        ])
    header = ["target", "aliases", "compile here", "run here", "description", "facts"]
    print(format_table(header, rows))
    return 0
