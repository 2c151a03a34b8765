"""The rooms of gimlet-tvm, the imports between them, and a picture of both.

`LAYERS` names the rooms bottom first: a module may import its own room and the rooms below.
The imports are read from the sources (every `import`, at the top of a module or inside a
function), so the picture and `tests/test_architecture.py`, which checks the rule, see the
same graph.

    .venv/bin/python scripts/module_graph.py [docs/architecture.svg]
"""

from __future__ import annotations

import ast
import collections
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

import gimlet_tvm

LAYERS = (
    ("base", ("gimlet_tvm.errors", "gimlet_tvm.files", "gimlet_tvm.io_spec", "gimlet_tvm.carriers",
              "gimlet_tvm.logs", "gimlet_tvm.resources")),
    ("runtime", ("gimlet_tvm.runtime",)),
    ("targets", ("gimlet_tvm.targets",)),
    ("relax_passes", ("gimlet_tvm.relax_passes",)),
    ("schedules", ("gimlet_tvm.schedules",)),
    ("frontend", ("gimlet_tvm.frontend", "gimlet_tvm.onnx_ops", "gimlet_tvm.models")),
    ("compiler", ("gimlet_tvm.compiler", "gimlet_tvm.tuning", "gimlet_tvm.selection", "gimlet_tvm.op_timing",
                  "gimlet_tvm.peers", "gimlet_tvm.runtime_bundle")),
    ("llm", ("gimlet_tvm.llm",)),
    ("serve", ("gimlet_tvm.serve",)),
    ("cli", ("gimlet_tvm.cli", "gimlet_tvm.__main__")),
)
# What each room owns, for the picture.
OWNS = {
    "base": "typed errors, atomic files, IO specs, quiet logs, memory limits",
    "runtime": "CompiledModel, artifacts, RPC, C++ extensions",
    "targets": "TargetSpec per target, libraries, kernels",
    "relax_passes": "fusion, library dispatch, placement",
    "schedules": "rules, tuning records, selection parts",
    "frontend": "ONNX import, converters, suite models",
    "compiler": "build, tune, select, runtime bundle",
    "llm": "LLM families, weights, KV-cache engine",
    "serve": "OpenAI-compatible server, continuous batching",
    "cli": "gimlet-tvm subcommands",
}
# The package's own __init__ is the public surface: it re-exports from every room (lazily) and
# every room may read `__version__` from it.
SURFACE = "gimlet_tvm"
# The rooms kept in folders of their own at the top of the repository.
FOLDER_ROOMS = ("targets", "relax_passes", "schedules", "runtime")


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> source file (the folder rooms are walked on
    their own: in an editable install they are not under gimlet_tvm/)."""
    found = {SURFACE: Path(gimlet_tvm.__file__)}
    for package in [gimlet_tvm, *(importlib.import_module(f"{SURFACE}.{room}") for room in FOLDER_ROOMS)]:
        found[package.__name__] = Path(package.__file__)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            found[info.name] = Path(importlib.util.find_spec(info.name).origin)
    return found


def layer_of(module: str) -> int | None:
    """The index in `LAYERS` of the room `module` belongs to, None for no room."""
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported gimlet_tvm module, line, inside a function) for every import in the source."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    in_function = {id(node) for func in ast.walk(tree) if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(func)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            # `from . import x` names a submodule or an attribute: the submodule where it is one.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(name, node.lineno, id(node) in in_function) for name in names
                  if name == SURFACE or name.startswith(SURFACE + ".")]
    return found


def room_edges(known: dict[str, Path]) -> collections.Counter:
    """(importing room, imported room) -> number of imports, between different rooms."""
    edges: collections.Counter = collections.Counter()
    for module, path in known.items():
        own = layer_of(module)
        for imported, _, _ in imports_of(module, path, known):
            other = layer_of(imported)
            if module != SURFACE and imported != SURFACE and None not in (own, other) and own != other:
                edges[(LAYERS[own][0], LAYERS[other][0])] += 1
    return edges


def draw(edges: collections.Counter, path: Path) -> None:
    """The rooms as a stack, bottom first, and their imports as arrows (left: downward; right:
    against the layers, red), written atomically to `path` (SVG or PNG by its suffix)."""
    rooms = [name for name, _ in LAYERS]
    y = {name: index * 1.4 for index, name in enumerate(rooms)}
    fig, ax = plt.subplots(figsize=(8, 1.0 * len(rooms) + 1))
    for name in rooms:
        ax.add_patch(plt.Rectangle((0, y[name] - 0.4), 4.6, 0.8, facecolor="#e8eef7", edgecolor="#345"))
        ax.text(2.3, y[name] + 0.1, name, ha="center", va="center", fontsize=12, weight="bold")
        ax.text(2.3, y[name] - 0.2, OWNS[name], ha="center", va="center", fontsize=8, color="#444")
    ordered = sorted(edges.items(), key=lambda item: (y[item[0][0]], y[item[0][1]]))
    for slot, ((src, dst), count) in enumerate(ordered):
        upward = y[dst] > y[src]
        x = 4.9 + 0.12 * slot if not upward else -0.3 - 0.12 * slot
        ax.annotate("", xy=(x, y[dst] + (-0.4 if upward else 0.4)), xytext=(x, y[src] + (0.4 if upward else -0.4)),
                    arrowprops={"arrowstyle": "->", "color": "#c22" if upward else "#567", "lw": 0.8})
    ax.set_xlim(-1.5, 4.9 + 0.12 * len(ordered) + 0.5)
    ax.set_ylim(-0.8, y[rooms[-1]] + 0.8)
    ax.axis("off")
    ax.set_title("gimlet-tvm rooms: each imports only the rooms below it (arrows: one per room pair)", fontsize=10)
    tmp = path.with_name(path.name + ".tmp" + path.suffix)
    fig.savefig(tmp, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else Path(__file__).resolve().parents[1] / "docs" / "architecture.svg")
    known = modules()
    edges = room_edges(known)
    draw(edges, out)
    for (src, dst), count in sorted(edges.items()):
        print(f"{src:>12} -> {dst:<12} {count} imports")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
