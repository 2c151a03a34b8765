"""The runtime bundle: one folder with what a device needs to run exported artifacts and serve
TVM RPC, on a machine with Python 3.11 (or the versions named to `make_bundle`), numpy and the
device driver but no TVM installed.

Layout (`make_bundle`):

    run.py, rpc_server.py    launchers: put python/ first on sys.path, TVM in runtime-only mode
    python/tvm/              the modules of TVM's Python package that its runtime-only mode
                             imports, its RPC server, lib/libtvm_runtime.so (+
                             libtvm_runtime_cuda.so) and the runtime headers; no
                             libtvm_compiler.so
    python/tvm_ffi/          tvm-ffi: Python, its extension (one a Python version), libtvm_ffi.so
                             and headers
    python/gimlet_tvm/       the base modules and gimlet_tvm.runtime with its C++ extension
                             sources (compiled with g++ on the device on first use) and the
                             CPU library prebuilt for a baseline CPU, for devices without g++
    python/...               what those import besides numpy: ml_dtypes, typing_extensions,
                             scipy_openblas32 (the CPU library links it), and cloudpickle and
                             psutil (TVM's RPC server); libcudart where the CUDA runtime is
                             shipped (python/nvidia/cu13/lib, where runtime/cuda_runtime.py looks)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import tvm
import tvm_ffi

from . import runtime
from .errors import GimletError
from .runtime.cuda_runtime import CUDART, find_cudart
from .runtime.extensions import COMPILER, CPU_LIBRARY_SOURCES, PREBUILT_CPU_LIBRARY, include_args

MAX_BYTES = 44 * 2**20
"""The bundle's size limit: device machines take 64 MiB of files per call, artifacts included
(38.9 MiB for this Python, 2.9 MiB more for another's extensions)."""

TVM_PACKAGES = ("exec", "rpc", "runtime", "support")
"""TVM's Python subpackages shipped whole (the RPC server and its workers import from them
lazily); of the rest, only the modules `import tvm` in runtime-only mode imports (`_tvm_modules`)."""

_TRACE = """
import sys
import gimlet_tvm.runtime.standalone, tvm.exec.popen_worker, tvm.exec.rpc_server
print("\\n".join(m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)))
"""

TVM_LIBRARIES = ("libtvm_runtime.so", "libtvm_runtime_cuda.so")
BASE_MODULES = ("__init__.py", "errors.py", "files.py", "io_spec.py", "carriers.py", "resources.py")
DEPENDENCIES = ("ml_dtypes", "typing_extensions", "scipy_openblas32", "cloudpickle", "psutil")
"""Python packages the runtime needs on a device that has only numpy."""

VERSIONED_EXTENSIONS = {"tvm_ffi": "apache-tvm-ffi", "ml_dtypes": "ml-dtypes"}
"""Bundled packages (and their distributions) whose extension modules are built for one Python
version (`*.cpython-3XY-*.so`); psutil's is `abi3` and loads in any version."""

MANYLINUX = [f"manylinux_2_{minor}" for minor in range(17, 36)] + ["manylinux2014"]
"""The platform tags a wheel for another Python version may carry (pip matches them exactly)."""

_SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc")

LAUNCHER = '''"""{doc}

Uses the runtime bundle beside this file (python/): no TVM install needed.
"""

import os
import sys

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python")
sys.path.insert(0, PYTHON_DIR)
# Child processes (the RPC server's session workers) import from the bundle too.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [PYTHON_DIR, os.environ.get("PYTHONPATH")]))
os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")  # TVM's runtime-only mode: no compiler library

from gimlet_tvm.runtime.standalone import {main}  # noqa: E402

sys.exit({main}())
'''

LAUNCHERS = {
    "run.py": ("python run.py ARTIFACT --inputs in.npz --outputs out.npz [--device cpu|cuda|vulkan]",
               "run_main"),
    "rpc_server.py": ("python rpc_server.py --host H --port P: the server `gimlet-tvm rpc server` runs",
                      "rpc_server_main"),
}


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise GimletError(f"cannot make the runtime bundle: package '{name}' is not installed")
    return Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin)


def _tvm_modules() -> list[Path]:
    """TVM's Python files that the runtime's entry points import in TVM's runtime-only mode
    (traced in a fresh interpreter): the rest of `import tvm`'s 3 MB is compiler-side."""
    env = dict(os.environ, TVM_USE_RUNTIME_LIB="1")
    listed = subprocess.run([sys.executable, "-c", _TRACE], capture_output=True, text=True,
                            env=env, cwd=tempfile.gettempdir(), check=True, timeout=300).stdout
    root = Path(tvm.__file__).parent
    return [Path(line) for line in listed.splitlines() if Path(line).is_relative_to(root)]


def _copy_tvm(python: Path) -> None:
    source, target = Path(tvm.__file__).parent, python / "tvm"
    for path in _tvm_modules():
        (target / path.parent.relative_to(source)).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target / path.relative_to(source))
    for package in TVM_PACKAGES:
        shutil.copytree(source / package, target / package, ignore=_SKIPPED, dirs_exist_ok=True)
    shutil.copytree(source / "include", target / "include", ignore=_SKIPPED)
    (target / "lib").mkdir()
    for name in TVM_LIBRARIES:
        if (source / "lib" / name).is_file():
            shutil.copy2(source / "lib" / name, target / "lib" / name)


def _copy_tvm_ffi(python: Path) -> None:
    source, target = Path(tvm_ffi.__file__).parent, python / "tvm_ffi"
    skipped = shutil.ignore_patterns("__pycache__", "*.pyc", "src", "3rdparty", "cython", "share", "stub",
                                     "cmake", "CMakeLists.txt")
    shutil.copytree(source, target, ignore=skipped)


def _copy_gimlet(python: Path) -> None:
    source, target = Path(__file__).parent, python / "gimlet_tvm"
    target.mkdir()
    for name in BASE_MODULES:
        shutil.copy2(source / name, target / name)
    shutil.copytree(Path(runtime.__file__).parent, target / "runtime", ignore=_SKIPPED)


def _prebuild_cpu_library(python: Path) -> None:
    """The CPU library for a baseline CPU of this architecture (x86-64-v2 on x86-64), linked
    to the bundle's libraries by run paths relative to itself."""
    library = python / "gimlet_tvm" / "runtime" / PREBUILT_CPU_LIBRARY.relative_to(
        Path(runtime.__file__).parent)
    library.parent.mkdir()
    up = os.path.relpath(python, library.parent)
    libraries = {"tvm/lib": "tvm_runtime", "tvm_ffi/lib": "tvm_ffi",
                 "scipy_openblas32/lib": "scipy_openblas"}
    march = ["-march=x86-64-v2"] if platform.machine() == "x86_64" else []
    command = [COMPILER, *map(str, CPU_LIBRARY_SOURCES), "-o", str(library), "-std=c++17", "-O3",
               *march, "-fopenmp-simd", "-fPIC", "-shared", *include_args()]
    for folder, name in libraries.items():
        command += [f"-L{python / folder}", f"-Wl,-rpath,$ORIGIN/{up}/{folder}", f"-l{name}"]
    try:
        subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
    except (OSError, subprocess.CalledProcessError) as err:
        raise GimletError(f"cannot prebuild the CPU library with {COMPILER}: "
                          f"{getattr(err, 'stderr', '') or err}") from None


def _copy_dependencies(python: Path) -> None:
    # The CPU library uses OpenBLAS's CBLAS only: its LAPACK headers (1.6 MB) stay out.
    skipped = shutil.ignore_patterns("__pycache__", "*.pyc", "lapack*.h")
    for name in DEPENDENCIES:
        source = _package_dir(name)
        if source.is_dir():
            shutil.copytree(source, python / source.name, ignore=skipped)
        else:
            shutil.copy2(source, python / source.name)
    cudart = find_cudart()
    if (python / "tvm" / "lib" / "libtvm_runtime_cuda.so").is_file() and cudart is not None:
        (python / "nvidia" / "cu13" / "lib").mkdir(parents=True)
        shutil.copy2(cudart, python / "nvidia" / "cu13" / "lib" / CUDART)


def add_python_version(python: Path, version: str) -> None:
    """Add the extension modules of `VERSIONED_EXTENSIONS` for CPython `version` (such as
    "3.12") to the bundle's `python` folder, from the wheels of the installed releases (`pip
    download`): Python loads the file tagged with its own version, so one bundle serves a device
    whose Python differs from this machine's (the H200 machines run 3.12)."""
    tag = f".cpython-{version.replace('.', '')}-"
    for package, distribution in VERSIONED_EXTENSIONS.items():
        pin = f"{distribution}=={importlib.metadata.version(distribution)}"
        with tempfile.TemporaryDirectory(prefix="gimlet-wheels-") as wheels:
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                       "--only-binary=:all:", "--python-version", version, "--implementation",
                       "cp", "--dest", wheels, pin]
            for platform_tag in MANYLINUX:
                command += ["--platform", f"{platform_tag}_{platform.machine()}"]
            try:
                subprocess.run(command, capture_output=True, text=True, check=True, timeout=600)
            except (OSError, subprocess.SubprocessError) as err:
                raise GimletError(f"cannot fetch {pin} for Python {version}: "
                                  f"{getattr(err, 'stderr', '') or err}") from None
            found = 0
            for wheel in Path(wheels).glob("*.whl"):
                with zipfile.ZipFile(wheel) as archive:
                    for member in archive.namelist():
                        if member.startswith(f"{package}/") and tag in member:
                            (python / member).parent.mkdir(parents=True, exist_ok=True)
                            (python / member).write_bytes(archive.read(member))
                            found += 1
        if not found:
            raise GimletError(f"the wheel of {pin} for Python {version} has no extension for it")


def size_of(folder: Path) -> int:
    """Bytes of the files under `folder`."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def make_bundle(out_dir: str | os.PathLike, python_versions: tuple[str, ...] = ()) -> int:
    """Write the runtime bundle to `out_dir` (which must not exist, or be empty) and return its
    size in bytes; `python_versions` adds extension modules for those CPython versions besides
    this interpreter's (`add_python_version`). It is assembled in a temporary folder beside `out_dir` and renamed into
    place, so a failure leaves nothing at `out_dir`."""
    out = Path(out_dir).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GimletError(f"{out} exists and is not an empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".gimlet-bundle-", dir=out.parent))
    try:
        python = staging / "python"
        python.mkdir()
        _copy_tvm(python)
        _copy_tvm_ffi(python)
        _copy_gimlet(python)
        _copy_dependencies(python)
        for version in python_versions:
            add_python_version(python, version)
        _prebuild_cpu_library(python)
        for name, (doc, main) in LAUNCHERS.items():
            (staging / name).write_text(LAUNCHER.format(doc=doc, main=main))
        size = size_of(staging)
        if size > MAX_BYTES:
            raise GimletError(f"the runtime bundle would be {size / 2**20:.1f} MiB, over the "
                              f"{MAX_BYTES / 2**20:.0f} MiB limit")
        staging.chmod(0o755)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return size
