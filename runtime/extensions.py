"""Build and load gimlet's C++ runtime extensions (`runtime/ext/`).

The sources are compiled with g++ on first use into a cache keyed by the source hash, the TVM
and tvm-ffi versions, the compiler and its flags, and the host CPU (the code is built with
`-march=native`, so a cache shared between machines must not hand one CPU's build to another).
The cache lives in `$GIMLET_TVM_CACHE` or `~/.cache/gimlet-tvm`; builds go to a temporary file
that is renamed into place, under a file lock, so concurrent processes neither race nor load a
half-written library.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import scipy_openblas32
import tvm
import tvm_ffi
import tvm_ffi.libinfo

EXT_DIR = Path(__file__).resolve().parent / "ext"
CPU_LIBRARY_SOURCES = [EXT_DIR / "cpu_library.cc"]
COMPILER = os.environ.get("CXX", "g++")
CXXFLAGS = ("-std=c++17", "-O3", "-march=native", "-fopenmp-simd", "-fPIC", "-shared", "-Wall")
PREBUILT_CPU_LIBRARY = EXT_DIR.parent / "prebuilt" / "libgimlet_cpu.so"
"""The CPU library built for a baseline x86-64 CPU, which `gimlet-tvm runtime-bundle` ships:
used on a machine without a C++ compiler."""

_loaded: ctypes.CDLL | None = None


def cache_dir() -> Path:
    """Where built extensions are kept."""
    return Path(os.environ.get("GIMLET_TVM_CACHE", Path.home() / ".cache" / "gimlet-tvm"))


def _host_cpu() -> str:
    """The host CPU model and feature flags: what `-march=native` depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n".join(wanted)


def link_args(*libraries: tuple[Path, str]) -> list[str]:
    """Linker flags for TVM's runtime and tvm-ffi plus `(folder, name)` libraries, each
    folder also on the rpath."""
    tvm_lib = (Path(tvm.__file__).parent / "lib", "tvm_runtime")
    ffi_lib = (Path(tvm_ffi.__file__).parent / "lib", "tvm_ffi")
    args = []
    for folder, name in (tvm_lib, ffi_lib, *libraries):
        args += [f"-L{folder}", f"-Wl,-rpath,{folder}", f"-l{name}"]
    return args


def include_args() -> list[str]:
    includes = [
        Path(tvm.__file__).parent / "include",
        Path(tvm_ffi.libinfo.find_include_path()),
        Path(scipy_openblas32.get_include_dir()),
    ]
    dlpack = Path(tvm_ffi.libinfo.find_dlpack_include_path())
    return [f"-I{path}" for path in includes + [dlpack]]


def _build_key(sources: list[Path], args: list[str], compiler: str) -> str:
    digest = hashlib.sha256()
    headers = {h for source in sources for h in source.parent.glob("*.h")}
    for source in [*sources, *sorted(headers)]:
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    compiler_version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    for part in (tvm.__version__, tvm_ffi.__version__, compiler_version, " ".join(args)):
        digest.update(part.encode())
    digest.update(_host_cpu().encode())
    return digest.hexdigest()[:24]


def build_library(name: str, sources: list[Path], args: list[str], compiler: str = COMPILER,
                  suffix: str = ".so") -> Path:
    """Compile `sources` with `args` into a shared library (or, with `-c` and suffix ".o", an
    object file) in the cache, or return the cached one (built under a lock, written to a
    temporary file and renamed into place). The cache key covers the sources, the headers
    beside them, the flags and the compiler."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"lib{name}_{_build_key(sources, args, compiler)}{suffix}"
    if library.exists():
        return library
    with open(directory / f"{library.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # another process built it while we waited
            return library
        fd, temporary = tempfile.mkstemp(suffix=suffix, dir=directory)
        os.close(fd)
        try:
            command = [compiler, *map(str, sources), "-o", temporary, *args]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                lines = result.stderr.splitlines()
                first_error = next((line for line in lines if "error" in line), lines[0] if lines else "")
                raise RuntimeError(f"building {name} failed: {first_error}\n{result.stderr}")
            os.replace(temporary, library)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return library


def build_extensions() -> Path:
    """Compile the CPU library extension, or return the cached build; without a C++ compiler
    on this machine, the prebuilt one where there is one (`PREBUILT_CPU_LIBRARY`)."""
    if shutil.which(COMPILER) is None and PREBUILT_CPU_LIBRARY.is_file():
        return PREBUILT_CPU_LIBRARY
    return build_library(
        "gimlet_cpu",
        CPU_LIBRARY_SOURCES,
        [
            *CXXFLAGS,
            *include_args(),
            *link_args((Path(scipy_openblas32.get_lib_dir()), scipy_openblas32.get_library())),
        ],
    )


def use_all_cores_in_tvm_thread_pool() -> None:
    """Size TVM's thread pools to the cores this process may run on, unless the user chose.

    On x86 TVM assumes two hyper-threads per core and starts half as many threads as there
    are CPUs: on a 2-core machine without SMT, every parallel kernel (and OpenBLAS, which
    runs on that pool) would use one core. TVM reads `TVM_NUM_THREADS` when a thread first
    creates its pool, so this must run before any parallel kernel.
    """
    if "TVM_NUM_THREADS" not in os.environ and hasattr(os, "sched_getaffinity"):
        os.environ["TVM_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))


def load_extensions() -> None:
    """Build (if needed) and load the extensions so their `gimlet.cpu.*` globals register,
    after sizing TVM's thread pool (`use_all_cores_in_tvm_thread_pool`).

    Loading again is a no-op.
    """
    global _loaded  # pylint: disable=global-statement
    if _loaded is None:
        use_all_cores_in_tvm_thread_pool()
        _loaded = ctypes.CDLL(str(build_extensions()), mode=ctypes.RTLD_GLOBAL)
