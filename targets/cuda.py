"""CUDA: kernels compiled by `nvcc` to a fatbin (SASS for the arch, plus PTX), checked with
`cuobjdump`.

TVM asks the global `tvm_callback_cuda_compile` for the binary of the generated CUDA source;
the build installs ours, which runs nvcc for the target's `arch`. Without it TVM would embed
source only.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path
import tvm

from ..errors import CodeCheckError
from ..runtime.cuda_runtime import NVIDIA_WHEELS, find_cudart, load_cuda_runtime
from .toolchain import find_tool, run_tool
from .gpu import (
    binaries_on_disk,
    global_func_override,
    kernel_names,
    recording_codegen,
    require_kernels,
)
from .kernels import HandwrittenKernel
from .kernels.cuda_gemm import cuda_gemm
from .libraries import CUDA_LIBRARY
from .spec import CodegenRecord, DeviceCode, TargetSpec

DEFAULT_ARCH = "sm_80"
_KERNEL_ENTRY = r"^FUNC\s+GLOBAL\s+\w+\s+ENTRY\s+(\w+)\s*$"


def _cuobjdump() -> str | None:
    """cuobjdump from the toolkit, or from PyPI's nvidia-cuda-cuobjdump."""
    bundled = NVIDIA_WHEELS / "bin" / "cuobjdump"
    return find_tool("cuobjdump") or (str(bundled) if bundled.is_file() else None)


def _arch() -> str:
    """This machine's GPU arch when it has one, else a cross-compilation default."""
    device = tvm.cuda(0)
    if device.exist:
        return "sm_" + device.compute_version.replace(".", "")
    return DEFAULT_ARCH


def default_target() -> dict:
    return {
        "kind": "cuda",
        "arch": _arch(),
        "max_threads_per_block": 1024,
        "max_shared_memory_per_block": 49152,
    }


def _nvcc_fatbin(source: str, arch: str) -> bytes:
    """Compile CUDA source to a fatbin with SASS for `arch` and PTX for newer GPUs."""
    compute = arch.replace("sm_", "compute_")
    with tempfile.TemporaryDirectory(prefix="gimlet-nvcc-") as folder:
        src, out = os.path.join(folder, "kernels.cu"), os.path.join(folder, "kernels.fatbin")
        Path(src).write_text(source)
        proc = subprocess.run(
            ["nvcc", "--fatbin", "-O3", f"-gencode=arch={compute},code=[{arch},{compute}]",
             "-o", out, src],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{proc.stderr[-4000:]}")
        return Path(out).read_bytes()


@contextlib.contextmanager
def codegen_hooks(target: tvm.target.Target):
    load_cuda_runtime()

    def compile_with_nvcc(source: str, *_):
        binary = _nvcc_fatbin(source, str(target.attrs["arch"]))
        record.binaries.append(binary)
        return bytearray(binary)

    with recording_codegen("cuda") as record:
        with global_func_override("tvm_callback_cuda_compile", compile_with_nvcc):
            yield record


def check_code(module, record: CodegenRecord, target: tvm.target.Target) -> DeviceCode:
    """Every generated kernel has SASS for the target's arch in the fatbin nvcc produced."""
    arch = str(target.attrs["arch"])
    found: set[str] = set()
    with binaries_on_disk(record, ".fatbin", "CUDA fatbin") as paths:
        for path in paths:
            elves = run_tool([_cuobjdump(), "--list-elf", path], "listing the fatbin's ELF images")
            if f".{arch}." not in elves:
                raise CodeCheckError(f"fatbin has no SASS for {arch}: {elves.strip()}")
            if f".{arch}.ptx" not in run_tool([_cuobjdump(), "--list-ptx", path], "listing PTX"):
                raise CodeCheckError(f"fatbin has no PTX for {arch} (needed by newer GPUs)")
            symbols = run_tool([_cuobjdump(), "--dump-elf-symbols", path], "listing kernels")
            found |= kernel_names(_KERNEL_ENTRY, symbols)
    kernels = require_kernels(record, found, f"the {arch} SASS")
    return DeviceCode(f"CUDA fatbin ({arch} SASS + PTX)", kernels, "cuobjdump")


def _missing_toolchain() -> str | None:
    if find_tool("nvcc") is None:
        return "nvcc not found"
    if _cuobjdump() is None:
        return "cuobjdump not found (pip install nvidia-cuda-cuobjdump)"
    if find_cudart() is None:
        return "libcudart.so.13 not found (CUDA toolkit)"
    return None


CUDA_KERNELS = (
    HandwrittenKernel("cuda_gemm_16x16", "matmul", lambda target, m, n, k, *epilogue: cuda_gemm(m, n, k),
                      str(Path(__file__).resolve().parent / "kernels" / "cuda_gemm.py"), fuses_epilogue=False),
)

CUDA = TargetSpec(
    name="cuda",
    aliases=("nvidia",),
    kind="cuda",
    description="NVIDIA GPUs: CUDA C from TVM, compiled by nvcc to a fatbin",
    default_target=default_target,
    host=lambda: {"kind": "llvm"},
    device_type="cuda",
    libraries=(CUDA_LIBRARY,),
    handwritten_kernels=CUDA_KERNELS,
    codegen_hooks=codegen_hooks,
    check_code=check_code,
    can_compile=_missing_toolchain,
    can_run=lambda: None if tvm.cuda(0).exist else "no CUDA device or driver",
)

TARGET = CUDA
