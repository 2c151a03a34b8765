"""OpenCL: OpenCL C from TVM's code generator, compiled by clang to SPIR to check it.

The worked example of docs/adding-a-target.md: a target is one `TargetSpec` built from
the TVM target it wraps, its schedule rules, its code-generation hooks and its code check.
The TVM wheel has no OpenCL runtime, so these builds run nowhere here; the code check proves
the generated OpenCL C compiles.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import tvm

from .toolchain import find_tool, run_tool
from .gpu import (
    device_source,
    kernel_names,
    recording_codegen,
    require_kernels,
)
from .spec import CodegenRecord, DeviceCode, TargetSpec

_KERNEL_IN_SPIR = r"^define (?:dso_local )?spir_kernel void @(\w+)\("


def _clang() -> str | None:
    major = tvm.target.codegen.llvm_version_major()
    return find_tool(f"clang-{major}", "clang")


@contextlib.contextmanager
def codegen_hooks(target: tvm.target.Target):
    """Record the kernels TVM's `target.build.opencl` generates; no callbacks are needed."""
    with recording_codegen("opencl") as record:
        yield record


def check_code(module, record: CodegenRecord, target: tvm.target.Target) -> DeviceCode:
    """Compile the generated OpenCL C to SPIR with clang; every kernel must come out."""
    with tempfile.TemporaryDirectory(prefix="gimlet-opencl-") as folder:
        source = Path(folder, "kernels.cl")
        source.write_text(device_source(module, "opencl", "cl"))
        spir = run_tool(
            [_clang(), "-x", "cl", "-cl-std=CL3.0", "-Xclang", "-finclude-default-header",
             "-target", "spir64", "-S", "-emit-llvm", "-o", "-", os.fspath(source)],
            "compiling the OpenCL C",
        )
    kernels = require_kernels(record, kernel_names(_KERNEL_IN_SPIR, spir), "the SPIR module")
    return DeviceCode("OpenCL C source (compiles to SPIR)", kernels, "clang")


OPENCL = TargetSpec(
    name="opencl",
    kind="opencl",
    description="OpenCL devices: OpenCL C source, checked by compiling it to SPIR with clang",
    default_target=lambda: {"kind": "opencl"},
    host=lambda: {"kind": "llvm"},
    device_type="opencl",
    codegen_hooks=codegen_hooks,
    check_code=check_code,
    can_compile=lambda: None if _clang() else "clang not found (Debian: clang-22), needed to check",
    can_run=lambda: None if tvm.opencl(0).exist else "no OpenCL runtime in the TVM wheel",
)

TARGET = OPENCL
