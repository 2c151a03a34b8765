"""What GPU targets share: reading device modules back and checking their kernels."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator

import tvm
import tvm_ffi

from ..errors import CodeCheckError
from .spec import CodegenRecord

def device_modules(module: tvm.runtime.Module, kind: str) -> list[tvm.runtime.Module]:
    """Every module of `kind` imported, directly or not, by the built `module`."""
    found = []
    for imported in module.imports:
        if imported.kind == kind:
            found.append(imported)
        found += device_modules(imported, kind)
    return found


def device_source(module: tvm.runtime.Module, kind: str, fmt: str = "") -> str:
    """The generated source of the build's `kind` device modules, concatenated."""
    modules = device_modules(module, kind)
    if not modules:
        raise CodeCheckError(f"the build contains no {kind} device module")
    return "\n".join(m.inspect_source(fmt) for m in modules)


def kernel_names(pattern: str, text: str) -> set[str]:
    """Names captured by `pattern` (group 1) in generated source or tool output."""
    return set(re.findall(pattern, text, flags=re.MULTILINE))


def require_kernels(record: CodegenRecord, found: set[str], where: str) -> tuple[str, ...]:
    """Check every kernel handed to the code generator is present in its output."""
    if not record.kernels:
        raise CodeCheckError(f"no kernels were generated (checking {where})")
    missing = sorted(record.kernels - found)
    if missing:
        raise CodeCheckError(f"{len(missing)} kernel(s) missing from {where}: {missing[:5]}")
    return tuple(sorted(record.kernels))


@contextlib.contextmanager
def binaries_on_disk(record: CodegenRecord, suffix: str, what: str) -> Iterator[list[str]]:
    """The record's device binaries as temporary files, for the toolchain to read back."""
    if not record.binaries:
        raise CodeCheckError(f"no {what} was produced (the toolchain was not called)")
    with tempfile.TemporaryDirectory(prefix="gimlet-check-") as folder:
        paths = [os.path.join(folder, f"kernels{i}{suffix}") for i in range(len(record.binaries))]
        for path, binary in zip(paths, record.binaries):
            Path(path).write_bytes(binary)
        yield paths


@contextlib.contextmanager
def recording_codegen(kind: str) -> Iterator[CodegenRecord]:
    """Wrap TVM's `target.build.<kind>` to record the kernels of each device module it builds."""
    record = CodegenRecord()
    build = tvm.get_global_func(f"target.build.{kind}")

    def recording_build(mod: tvm.IRModule, target: tvm.target.Target):
        record.kernels |= {
            gv.name_hint for gv, func in mod.functions.items() if isinstance(func, tvm.tirx.PrimFunc)
        }
        return build(mod, target)

    with global_func_override(f"target.build.{kind}", recording_build):
        yield record


@contextlib.contextmanager
def global_func_override(name: str, func) -> Iterator[None]:
    """Register `func` as TVM global `name` for the duration; restore the previous one."""
    previous = tvm.get_global_func(name, allow_missing=True)
    tvm_ffi.register_global_func(name, func, override=True)
    try:
        yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func(name, previous, override=True)
        else:
            tvm_ffi.remove_global_func(name)
