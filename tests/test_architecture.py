"""The house rules the code keeps: rooms import downward only, the middle end never names a
target, every module imports, every package installs.

Read from the sources (the AST of every module), so an import inside a function counts as much
as one at the top.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gimlet_tvm
from gimlet_tvm.targets import registered

# The rooms, bottom first: a module may import its own room and the rooms below it. A module
# no room claims fails the test: a new one has to be given its place.
LAYERS = (
    ("base", ("gimlet_tvm.errors", "gimlet_tvm.files", "gimlet_tvm.io_spec", "gimlet_tvm.carriers")),
    ("runtime", ("gimlet_tvm.runtime",)),
    ("targets", ("gimlet_tvm.targets",)),
    ("relax_passes", ("gimlet_tvm.relax_passes",)),
    ("schedules", ("gimlet_tvm.schedules",)),
    ("frontend", ("gimlet_tvm.frontend", "gimlet_tvm.onnx_ops", "gimlet_tvm.models")),
    ("compiler", ("gimlet_tvm.compiler", "gimlet_tvm.tuning", "gimlet_tvm.selection", "gimlet_tvm.op_timing",
                  "gimlet_tvm.peers")),
    ("cli", ("gimlet_tvm.cli", "gimlet_tvm.__main__")),
)
# The package's own __init__ is the public surface: it re-exports from every room (lazily,
# see its docstring) and every room may read `__version__` from it.
SURFACE = "gimlet_tvm"
# The middle end: every room but targets/ (which owns target knowledge) and the device
# runtimes the runtime room keeps for the devices that need ours (they are that device's code).
MIDDLE_END = [room for room, _ in LAYERS if room != "targets"]
DEVICE_RUNTIMES = ("gimlet_tvm.runtime.vulkan_runtime", "gimlet_tvm.runtime.cuda_runtime")


# The rooms that live in folders of their own at the top of the repository.
FOLDER_ROOMS = ("targets", "relax_passes", "schedules", "runtime")


def _modules() -> dict[str, Path]:
    """Every module of the installed package: dotted name -> source file (the folder rooms
    are walked on their own: in an editable install they are not under gimlet_tvm/)."""
    found = {SURFACE: Path(gimlet_tvm.__file__)}
    for package in [gimlet_tvm, *(importlib.import_module(f"{SURFACE}.{room}") for room in FOLDER_ROOMS)]:
        found[package.__name__] = Path(package.__file__)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            found[info.name] = Path(importlib.util.find_spec(info.name).origin)
    return found


MODULES = _modules()


def _layer(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
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
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from . import x` names a submodule or an attribute: count the submodule if it is one.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(name, node.lineno, id(node) in in_function) for name in names
                  if name == SURFACE or name.startswith(SURFACE + ".")]
    return found


def test_every_module_has_a_room() -> None:
    homeless = sorted(m for m in MODULES if m != SURFACE and _layer(m) is None)
    assert not homeless, f"modules in no room of LAYERS: {homeless}"


def test_rooms_import_downward_only() -> None:
    upward = []
    for module, path in MODULES.items():
        if module == SURFACE:
            continue
        own = _layer(module)
        for imported, line, _ in _imports(module, path):
            target = _layer(imported)
            if imported != SURFACE and target is not None and own is not None and target > own:
                upward.append(f"{path.relative_to(Path(gimlet_tvm.__file__).parents[1])}:{line} "
                              f"({LAYERS[own][0]}) imports {imported} ({LAYERS[target][0]})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_import_hidden_in_a_function() -> None:
    """Imports of our own modules sit at the top of the module: none dodges a cycle (the
    package surface's lazy names excepted)."""
    hidden = [f"{module}:{line} imports {imported}" for module, path in MODULES.items() if module != SURFACE
              for imported, line, inside in _imports(module, path) if inside]
    assert not hidden, "\n".join(hidden)


def test_every_module_imports() -> None:
    for module in MODULES:
        if module != "gimlet_tvm.__main__":
            importlib.import_module(module)


def _target_names() -> set[str]:
    return {name for spec in registered() for name in (spec.name, spec.kind)}


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_the_middle_end_never_names_a_target() -> None:
    """No module outside targets/ holds a target's name or TVM kind as a string: it asks the
    target's spec (`spec_for(target)`, its libraries, kernels, keys) instead."""
    names = _target_names()
    found = []
    for module, path in MODULES.items():
        layer = _layer(module)
        if (layer is not None and LAYERS[layer][0] not in MIDDLE_END) or module in DEVICE_RUNTIMES:
            continue
        for node in _string_constants(ast.parse(path.read_text())):
            if node.value in names:
                found.append(f"{module}:{node.lineno} {node.value!r}")
    assert not found, "target names outside targets/:\n" + "\n".join(found)


def test_the_name_check_catches_a_comparison(tmp_path) -> None:
    """The check above reads what it should: a kind comparison in the middle end's style."""
    tree = ast.parse('def on_cpu(target):\n    return target.kind.name == "llvm"\n')
    assert [n.value for n in _string_constants(tree) if n.value in _target_names()] == ["llvm"]


def test_the_runtime_imports_without_the_compiler() -> None:
    """`import gimlet_tvm.runtime` (what a device runs) loads no compiler room."""
    code = ("import sys, gimlet_tvm.runtime; "
            "print(' '.join(m for m in sys.modules if m.startswith('gimlet_tvm.')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    above = [m for m in loaded if (_layer(m) or 0) > _layer("gimlet_tvm.runtime")]
    assert not above, f"importing the runtime loaded: {above}"


@pytest.mark.parametrize("room", ["gimlet_tvm", *FOLDER_ROOMS])
def test_every_source_folder_is_a_package(room: str) -> None:
    """A folder of Python files without `__init__.py` is left out of the wheel."""
    root = Path(__file__).resolve().parents[1] / room
    folders = {p.parent for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(f.relative_to(root.parent)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"no __init__.py: {missing}"
