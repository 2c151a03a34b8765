"""Loading TVM's CUDA runtime, with or without an NVIDIA driver on the machine.

The CUDA runtime library of the TVM wheel (`libtvm_runtime_cuda.so`) holds the CUDA module
type and is what asks `nvcc` (through `tvm_callback_cuda_compile`) for kernel binaries. It
links against the driver (`libcuda.so.1`) and the CUDA runtime (`libcudart.so.13`); on a
machine without a driver TVM skips it, and CUDA builds carry source only. Here we load it
anyway, after a stub driver (`ext/cuda_driver_stub.cc`) where no real one exists, so CUDA
builds carry real fatbins everywhere.

`load_cuda_library` adds gimlet's cuBLAS functions (`ext/cuda_library.cc`, `gimlet.cuda.*`),
built against cuBLAS from the CUDA toolkit or PyPI's `nvidia-cublas` (the `cuda` extra).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

import tvm

from .extensions import CXXFLAGS, EXT_DIR, build_library, include_args, link_args

CUDART = "libcudart.so.13"
CUBLAS = "libcublas.so.13"
NVIDIA_WHEELS = Path(tvm.__file__).parents[1] / "nvidia" / "cu13"
"""Where PyPI's nvidia packages (cuobjdump, cuBLAS, the CUDA runtime) install."""

_library_loaded = False


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
        return True
    except OSError:
        return False


def _toolkit_roots() -> list[Path]:
    return [Path(root) for root in (os.environ.get("CUDA_PATH", ""), "/usr/local/cuda") if root]


def _find(name: str, folders: list[Path]) -> Path | None:
    return next((folder / name for folder in folders if (folder / name).is_file()), None)


def find_cudart() -> Path | None:
    """libcudart from the CUDA toolkit (CUDA_PATH, /usr/local/cuda) or PyPI's nvidia packages."""
    return _find(CUDART, [*(root / "lib64" for root in _toolkit_roots()), NVIDIA_WHEELS / "lib"])


def find_cublas() -> tuple[Path, Path] | None:
    """cuBLAS's header folder and library, from the CUDA toolkit or PyPI's nvidia-cublas."""
    for include, lib in [*((root / "include", root / "lib64") for root in _toolkit_roots()),
                         (NVIDIA_WHEELS / "include", NVIDIA_WHEELS / "lib")]:
        if (include / "cublas_v2.h").is_file() and (lib / CUBLAS).is_file():
            return include, lib / CUBLAS
    return None


def has_driver() -> bool:
    """Whether an NVIDIA driver (`libcuda.so.1`, or our stub once loaded) is loadable here."""
    return _loadable("libcuda.so.1")


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


def _cuda_library_args() -> list[str] | str:
    """The compiler flags for `ext/cuda_library.cc`, or why it cannot be built here."""
    cublas = find_cublas()
    if cublas is None:
        return f"cuBLAS not found: no cublas_v2.h and {CUBLAS} (pip install 'gimlet-tvm[cuda]')"
    runtime_api = _find("cuda_runtime_api.h", [root / "include" for root in _toolkit_roots()])
    cudart = find_cudart()
    if runtime_api is None or cudart is None:
        return f"the CUDA toolkit's cuda_runtime_api.h and {CUDART} not found (set CUDA_PATH)"
    include, library = cublas
    return [*CXXFLAGS, *include_args(), f"-I{include}", f"-I{runtime_api.parent}",
            *link_args((library.parent, f":{library.name}"), (cudart.parent, f":{cudart.name}"))]


def load_cuda_library() -> str | None:
    """Build (on first use) and load `ext/cuda_library.cc`, after TVM's CUDA runtime, so its
    `gimlet.cuda.*` functions register; None once they have, else why they cannot (cuBLAS
    or the CUDA toolkit missing). Loading again is a no-op."""
    global _library_loaded  # pylint: disable=global-statement
    if _library_loaded:
        return None
    args = _cuda_library_args()
    if isinstance(args, str):
        return args
    load_cuda_runtime()
    library = build_library("gimlet_cuda", [EXT_DIR / "cuda_library.cc"], args)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    _library_loaded = True
    return None
