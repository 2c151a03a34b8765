"""ROCm: LLVM's AMDGPU backend, linked by `ld.lld` against ROCm's device-library bitcode
(Debian's `rocm-device-libs`), checked with `llvm-readelf`.

TVM links each kernel object through the global `tvm_callback_rocm_link`; the build installs
ours, which links with the lld matching TVM's LLVM (22) and keeps the code object to check.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from pathlib import Path
import tvm

from ..errors import CodeCheckError
from .toolchain import llvm_tool, run_tool
from .gpu import (
    binaries_on_disk,
    global_func_override,
    kernel_names,
    recording_codegen,
    require_kernels,
)
from .spec import CodegenRecord, DeviceCode, TargetSpec

DEFAULT_MCPU = "gfx90a"
# Where Debian's rocm-device-libs puts amdgcn/bitcode; ROCM_PATH overrides it.
_ROCM_PATHS = ("/opt/rocm", "/usr/lib/x86_64-linux-gnu")
_KERNEL_SYMBOL = r"^\s*\d+:\s+[0-9a-f]+\s+\d+\s+FUNC\s+GLOBAL\s+\w+\s+\d+\s+(\w+)\s*$"


def _rocm_path() -> str | None:
    candidates = [os.environ["ROCM_PATH"]] if "ROCM_PATH" in os.environ else list(_ROCM_PATHS)
    return next((p for p in candidates if Path(p, "amdgcn", "bitcode", "ocml.bc").is_file()), None)


def _lld() -> str | None:
    return llvm_tool("ld.lld")


def _readelf() -> str | None:
    return llvm_tool("llvm-readelf")


@contextlib.contextmanager
def codegen_hooks(target: tvm.target.Target):
    def link_with_lld(obj: bytes) -> bytearray:
        with tempfile.TemporaryDirectory(prefix="gimlet-lld-") as folder:
            obj_path, out_path = os.path.join(folder, "k.o"), os.path.join(folder, "k.co")
            Path(obj_path).write_bytes(bytes(obj))
            proc = subprocess.run(
                [_lld(), "--no-undefined", "-shared", obj_path, "-o", out_path],
                capture_output=True, text=True,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"ld.lld failed: {proc.stderr or proc.stdout}")
            record.binaries.append(Path(out_path).read_bytes())
        return bytearray(record.binaries[-1])

    previous = os.environ.get("ROCM_PATH")
    os.environ["ROCM_PATH"] = _rocm_path() or ""
    try:
        with recording_codegen("rocm") as record:
            with global_func_override("tvm_callback_rocm_link", link_with_lld):
                yield record
    finally:
        if previous is None:
            del os.environ["ROCM_PATH"]
        else:
            os.environ["ROCM_PATH"] = previous


def check_code(module, record: CodegenRecord, target: tvm.target.Target) -> DeviceCode:
    """The code object is an AMDGPU ELF for the target's mcpu defining every kernel."""
    mcpu = str(target.attrs["mcpu"])
    found: set[str] = set()
    with binaries_on_disk(record, ".co", "AMDGPU code object") as paths:
        for path in paths:
            header = run_tool([_readelf(), "--file-header", path], "reading the code object")
            if "EM_AMDGPU" not in header or not re.search(rf"Flags:.*\b{mcpu}\b", header):
                raise CodeCheckError(f"code object is not an AMDGPU ELF for {mcpu}:\n{header}")
            symbols = run_tool([_readelf(), "--symbols", "--wide", path], "listing kernels")
            found |= kernel_names(_KERNEL_SYMBOL, symbols)
    kernels = require_kernels(record, found, f"the {mcpu} code object")
    return DeviceCode(f"AMDGPU code object ({mcpu})", kernels, "llvm-readelf")


def _missing_toolchain() -> str | None:
    if _rocm_path() is None:
        return "ROCm device bitcode not found (Debian: rocm-device-libs)"
    if _lld() is None:
        major = tvm.target.codegen.llvm_version_major()
        return f"ld.lld-{major} not found (Debian: lld-{major})"
    if _readelf() is None:
        major = tvm.target.codegen.llvm_version_major()
        return f"llvm-readelf-{major} not found (Debian: llvm-{major})"
    return None


ROCM = TargetSpec(
    name="rocm",
    aliases=("amd", "hip"),
    kind="rocm",
    description="AMD GPUs: LLVM AMDGPU code objects linked against ROCm device libraries",
    default_target=lambda: {"kind": "rocm", "mcpu": DEFAULT_MCPU},
    host=lambda: {"kind": "llvm"},
    device_type="rocm",
    codegen_hooks=codegen_hooks,
    check_code=check_code,
    can_compile=_missing_toolchain,
    can_run=lambda: None if tvm.rocm(0).exist else "no ROCm device or runtime",
)

TARGET = ROCM
