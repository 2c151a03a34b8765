"""`gimlet-tvm targets`: registered targets, their facts, and what this machine can do."""

from __future__ import annotations

from ..targets import registered
from .common import format_table


def add_parser(sub) -> None:
    parser = sub.add_parser("targets", help="list registered targets")
    parser.set_defaults(handler=run)


def _yes_or_why(reason: str | None) -> str:
    return "yes" if reason is None else f"no ({reason})"


def run(args) -> int:
    rows = []
    for spec in registered():
        facts = ", ".join(f"{k}={v}" for k, v in spec.facts().items())
        rows.append([
            spec.name,
            ",".join(spec.aliases) or "-",
            _yes_or_why(spec.can_compile()),
            _yes_or_why(spec.can_run()),
            spec.description,
            facts,
        ])
    header = ["target", "aliases", "compile here", "run here", "description", "facts"]
    print(format_table(header, rows))
    return 0
