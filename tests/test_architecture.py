"""The house rules the code keeps: rooms import downward only, the middle end never names a
target, every module imports, every package installs.

Read from the sources (the AST of every module), so an import inside a function counts as much
as one at the top.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

import gimlet_tvm
from gimlet_tvm.targets import registered

from .conftest import load_script

# The rooms and the import scan live with the picture of them (scripts/module_graph.py).
graph = load_script("scripts/module_graph.py")
LAYERS, SURFACE, FOLDER_ROOMS = graph.LAYERS, graph.SURFACE, graph.FOLDER_ROOMS
MODULES = graph.modules()
_layer = graph.layer_of


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    return graph.imports_of(module, path, MODULES)


# The middle end: every room but targets/ (which owns target knowledge) and the device
# runtimes the runtime room keeps for the devices that need ours, with its table of them
# (they are that device's code; an artifact names its device, there is no spec to ask).
MIDDLE_END = [room for room, _ in LAYERS if room != "targets"]
DEVICE_RUNTIMES = ("gimlet_tvm.runtime.vulkan_runtime", "gimlet_tvm.runtime.cuda_runtime",
                   "gimlet_tvm.runtime.libraries")


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


@pytest.mark.parametrize("room", ["gimlet_tvm", *FOLDER_ROOMS])
def test_every_source_folder_is_a_package(room: str) -> None:
    """A folder of Python files without `__init__.py` is left out of the wheel."""
    root = Path(__file__).resolve().parents[1] / room
    folders = {p.parent for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(f.relative_to(root.parent)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"no __init__.py: {missing}"
