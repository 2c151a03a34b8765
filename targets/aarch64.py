"""64-bit Arm CPUs (an Arm server, a Graviton, a Raspberry Pi 4/5) through LLVM, cross-compiled
from any machine: the code is AArch64 with NEON, read back with LLVM's readelf.

Everything a CPU target has comes from what CPU targets share (`cpu.py`): the CPU library
(compiled on the device when the model runs there), the hand-written GEMMs sized to NEON's 32
registers, the CPU schedule rules (its TVM target is keyed "cpu"). On an AArch64 machine it
runs; elsewhere it compiles only.
"""

from __future__ import annotations

import os
import platform
import tempfile
from typing import Any

import tvm
from tvm.support import cc

from ..errors import CodeCheckError
from .cpu import CPU_KERNELS, cpu_perf, num_cores, vector_bits
from .cpu_attention import replace_attention_kernels
from .gpu import device_modules
from .libraries import CPU_LIBRARY
from .spec import CodegenRecord, DeviceCode, TargetSpec
from .toolchain import llvm_tool, run_tool

ARCH = "aarch64"
TRIPLE = "aarch64-linux-gnu"
# A Neoverse N1 (Graviton 2, Ampere Altra): ARMv8.2 with dot product and fp16; override `mcpu`
# for others (`{"kind": "llvm", "mtriple": ..., "mcpu": "cortex-a76"}`).
DEFAULT_MCPU = "neoverse-n1"
ENTRY_PREFIX = "__tvm_ffi_"  # the symbols of the functions a built module exports


def default_target() -> dict[str, Any]:
    return {"kind": "llvm", "mtriple": TRIPLE, "mcpu": DEFAULT_MCPU, "num-cores": num_cores()}


def _facts() -> dict[str, Any]:
    return {"mcpu": DEFAULT_MCPU, "vector_bits": vector_bits(default_target())}


def check_code(module: tvm.runtime.Module, record: CodegenRecord, target: tvm.target.Target) -> DeviceCode:
    """The build's LLVM module is an AArch64 ELF object holding the model's functions."""
    llvm = device_modules(module, "llvm")
    if not llvm:
        raise CodeCheckError("the build contains no LLVM module")
    with tempfile.TemporaryDirectory(prefix="gimlet-check-") as folder:
        path = os.path.join(folder, "model.o")
        llvm[0].write_to_file(path)
        header = run_tool([llvm_tool("llvm-readelf"), "--file-header", path], "reading the object")
        if "AArch64" not in header:
            machine = next((line.split(":", 1)[1].strip() for line in header.splitlines() if "Machine:" in line), "?")
            raise CodeCheckError(f"the object is for {machine}, not AArch64")
        symbols = run_tool([llvm_tool("llvm-readelf"), "--symbols", "--wide", path], "listing functions")
    functions = sorted({name for name in (line.split()[-1] for line in symbols.splitlines() if " FUNC " in line)
                        if name.startswith(ENTRY_PREFIX)})
    if not functions:
        raise CodeCheckError("the AArch64 object defines none of the model's functions")
    return DeviceCode(f"AArch64 ELF object ({target.attrs.get('mcpu', DEFAULT_MCPU)})", tuple(functions),
                      "llvm-readelf")


def link(output: str, objects: list[str], **kwargs: Any) -> None:
    """Link an artifact's objects into an AArch64 shared library with clang and lld (TVM's
    `fcompile`): without libc, whose symbols the device's loader resolves."""
    cc.cross_compiler(llvm_tool("clang"), options=[f"--target={TRIPLE}", "-fuse-ld=lld", "-nostdlib"])(
        output, objects, **kwargs)


link.output_format = "so"


def _missing_toolchain() -> str | None:
    missing = [tool for tool in ("llvm-readelf", "clang", "ld.lld") if llvm_tool(tool) is None]
    return f"{', '.join(missing)} not found (Debian: llvm-22, clang-22, lld-22)" if missing else None


def _cannot_run() -> str | None:
    machine = platform.machine()
    return None if machine in ("aarch64", "arm64") else f"this machine is {machine}, not AArch64"


TARGET = TargetSpec(
    name="aarch64",
    aliases=("arm64",),
    kind="llvm",
    description="64-bit Arm CPUs through LLVM (NEON), cross-compiled",
    default_target=default_target,
    device_type="cpu",
    arch=ARCH,
    extra_facts=_facts,
    libraries=(CPU_LIBRARY,),
    handwritten_kernels=CPU_KERNELS,
    fast_math=True,
    fix_library_kernels=replace_attention_kernels,
    check_code=check_code,
    linker=link,
    can_compile=_missing_toolchain,
    can_run=_cannot_run,
    perf_facts=lambda: cpu_perf(default_target()),
)
