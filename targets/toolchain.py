"""Finding and running the toolchain programs targets check their code with (nvcc, cuobjdump,
LLVM's readelf and objdump, glslang)."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Sequence

import tvm

from ..errors import CodeCheckError


def find_tool(*names: str) -> str | None:
    """The first of `names` found on PATH."""
    return next((path for path in map(shutil.which, names) if path), None)


def run_tool(args: Sequence[str], what: str) -> str:
    """Run a toolchain program; its failure becomes a `CodeCheckError` naming `what`."""
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise CodeCheckError(f"{what} failed ({os.path.basename(args[0])}): {' | '.join(detail)}")
    return proc.stdout


def llvm_tool(name: str) -> str | None:
    """LLVM's `name` (`llvm-readelf`, `ld.lld`) of the version TVM's code generator is."""
    major = tvm.target.codegen.llvm_version_major()
    return find_tool(f"{name}-{major}", f"/usr/lib/llvm-{major}/bin/{name}")
