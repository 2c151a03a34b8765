"""The runtime stands alone: it imports nothing of the compiler, and artifacts tell it what
they need (device type, runtime libraries), old artifacts included."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gimlet_tvm
from gimlet_tvm.errors import ArtifactError
from gimlet_tvm.runtime import artifact

from .conftest import compiled_suite_model

RUNTIME_DIR = Path(gimlet_tvm.runtime.__file__).parent
BASE_MODULES = {"", "errors", "files", "io_spec", "carriers", "resources"}  # `from .. import __version__`
THIRD_PARTY = {"numpy", "tvm", "tvm_ffi", "scipy_openblas32", "matplotlib"}
COMPILER_SIDE = ("gimlet_tvm.compiler", "gimlet_tvm.frontend", "gimlet_tvm.targets",
                 "gimlet_tvm.relax_passes", "gimlet_tvm.schedules", "gimlet_tvm.cli",
                 "tvm.relax", "tvm.s_tir", "tvm.topi")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(relative level, module) of every import in a file, function-local ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


@pytest.mark.parametrize("path", sorted(RUNTIME_DIR.glob("*.py")), ids=lambda p: p.name)
def test_runtime_modules_import_only_the_base(path: Path) -> None:
    for level, module in _imports(path):
        if level == 0:
            top = module.split(".")[0]
            assert top in THIRD_PARTY or top in sys.stdlib_module_names, f"{path.name}: {module}"
            assert not module.startswith(COMPILER_SIDE), f"{path.name}: {module}"
        else:
            assert level == 1 or module.split(".")[0] in BASE_MODULES, f"{path.name}: {module}"


def test_importing_the_runtime_loads_no_compiler(tmp_path) -> None:
    """In TVM's runtime-only mode (what the runtime bundle runs in), nothing compiler-side
    is imported, TVM's included."""
    code = ("import sys, gimlet_tvm.runtime\n"
            f"print([m for m in sys.modules if m.startswith({COMPILER_SIDE!r})])")
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=120, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def _rewrite_metadata(source: Path, path: Path, change) -> None:
    """Copy an artifact with its metadata changed by `change(meta)`, checksum kept valid."""
    data = source.read_bytes()
    meta = artifact.read_metadata(source)
    library = data[:data.rindex(json.dumps(meta, sort_keys=True).encode())]
    change(meta)
    for key in ("format", "library_sha256"):
        meta.pop(key)
    artifact.write(path, lambda tmp: Path(tmp).write_bytes(library), meta)


def test_artifact_records_what_the_runtime_needs(tmp_path) -> None:
    compiled_suite_model("mlp").export(tmp_path / "m.so")
    (target,) = artifact.read_metadata(tmp_path / "m.so")["targets"]
    assert target["device_type"] == "cpu"
    assert target["runtime_libraries"] == ["cpu_library"]


def test_artifact_without_runtime_fields_still_loads(tmp_path) -> None:
    """Artifacts written before the fields existed fall back to the built-in target's."""
    model = compiled_suite_model("mlp")
    model.export(tmp_path / "new.so")

    def strip(meta):
        for target in meta["targets"]:
            del target["device_type"], target["runtime_libraries"]

    _rewrite_metadata(tmp_path / "new.so", tmp_path / "old.so", strip)
    x = np.ones((2, 1024), np.float32)
    np.testing.assert_array_equal(gimlet_tvm.load(tmp_path / "old.so")(x)[0], model(x)[0])


def test_old_artifact_of_an_unknown_target_is_refused(tmp_path) -> None:
    compiled_suite_model("mlp").export(tmp_path / "new.so")

    def rename(meta):
        for target in meta["targets"]:
            del target["device_type"], target["runtime_libraries"]
            target["name"] = "acme-cpu"

    _rewrite_metadata(tmp_path / "new.so", tmp_path / "old.so", rename)
    with pytest.raises(ArtifactError, match="'acme-cpu' does not record its device type"):
        gimlet_tvm.load(tmp_path / "old.so")
