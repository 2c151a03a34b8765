"""Loading TVM's CUDA runtime, with or without an NVIDIA driver on the machine.

The CUDA runtime library of the TVM wheel (`libtvm_runtime_cuda.so`) holds the CUDA module
type and is what asks `nvcc` (through `tvm_callback_cuda_compile`) for kernel binaries. It
links against the driver (`libcuda.so.1`) and the CUDA runtime (`libcudart.so.13`); on a
machine without a driver TVM skips it, and CUDA builds carry source only. Here we load it
anyway, after a stub driver (`ext/cuda_driver_stub.cc`) where no real one exists, so CUDA
builds carry real fatbins everywhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import tvm

from .extensions import EXT_DIR, build_library

CUDART = "libcudart.so.13"


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
        return True
    except OSError:
        return False


def find_cudart() -> Path | None:
    """libcudart from the CUDA toolkit (CUDA_PATH, /usr/local/cuda) or PyPI's nvidia packages."""
    roots = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    candidates = [Path(root, "lib64", CUDART) for root in roots if root]
    candidates.append(Path(tvm.__file__).parents[1] / "nvidia" / "cu13" / "lib" / CUDART)
    return next((path for path in candidates if path.is_file()), None)


def load_cuda_runtime() -> None:
    """Make TVM's CUDA runtime available in this process (a no-op once it is)."""
    if tvm.get_global_func("ffi.Module.load_from_bytes.cuda", allow_missing=True) is not None:
        return
    if not _loadable("libcuda.so.1"):
        stub = build_library(
            "cuda_driver_stub",
            [EXT_DIR / "cuda_driver_stub.cc"],
            ["-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1"],
        )
        ctypes.CDLL(str(stub), mode=ctypes.RTLD_GLOBAL)
    if not _loadable(CUDART):
        cudart = find_cudart()
        if cudart is None:
            raise RuntimeError(f"{CUDART} not found (install the CUDA toolkit or set CUDA_PATH)")
        ctypes.CDLL(str(cudart), mode=ctypes.RTLD_GLOBAL)
    library = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
