"""What a target's executables need at run time, read from the artifact, not the compiler.

An artifact records, per target it was built for, the TVM device type its code runs on
(`device_type`) and the names of gimlet's runtime extension libraries its executables may
call into (`runtime_libraries`, keys of `LIBRARIES`). The compiler writes both at build
time; this module maps them to devices and loaders, so a device machine that has only the
runtime (`gimlet-tvm runtime-bundle`) can load and run the artifact.
"""

from __future__ import annotations

import dataclasses
import platform
from typing import Any, Callable, Mapping, Sequence

import tvm

from ..errors import ArtifactError
from .cuda_runtime import has_driver, load_cuda_library, load_cuda_runtime
from .extensions import load_extensions
from .vulkan_runtime import load_vulkan_runtime, no_device_reason


@dataclasses.dataclass(frozen=True)
class RuntimeLibrary:
    """A runtime extension: the device type it serves and its loader (built on first use;
    returns why it cannot load where that is not an error, None when it did)."""

    device_type: str
    load: Callable[[], Any]


CPU_LIBRARY, CUDA_LIBRARY, VULKAN_RUNTIME = "cpu_library", "cuda_library", "vulkan"
LIBRARIES: dict[str, RuntimeLibrary] = {
    CPU_LIBRARY: RuntimeLibrary("cpu", load_extensions),          # gimlet.cpu.* (OpenBLAS)
    CUDA_LIBRARY: RuntimeLibrary("cuda", load_cuda_library),      # gimlet.cuda.* (cuBLAS)
    VULKAN_RUNTIME: RuntimeLibrary("vulkan", load_vulkan_runtime),  # the Vulkan device + module
}

# Artifacts written before targets recorded their runtime needs: the built-in targets'.
_BUILT_IN_TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "llvm": ("cpu", ("cpu_library",)),
    "cuda": ("cuda", ("cuda_library",)),
    "vulkan": ("vulkan", ("vulkan",)),
    "rocm": ("rocm", ()),
    "metal": ("metal", ()),
    "opencl": ("opencl", ()),
}


@dataclasses.dataclass(frozen=True)
class TargetRuntime:
    """One built-for target, as the runtime sees it: name, device type, libraries to load,
    and for CPU code the architecture it was compiled for (None: any, as old artifacts)."""

    name: str
    device_type: str
    libraries: tuple[str, ...]
    arch: str | None = None

    @classmethod
    def from_metadata(cls, entry: Mapping[str, Any]) -> "TargetRuntime":
        """Read an artifact's target entry; entries older than the `device_type` and
        `runtime_libraries` fields fall back to the built-in target of that name."""
        name = entry.get("name", "?")
        if "device_type" in entry:
            device_type, libraries = entry["device_type"], tuple(entry.get("runtime_libraries", ()))
        elif name in _BUILT_IN_TARGETS:
            device_type, libraries = _BUILT_IN_TARGETS[name]
        else:
            raise ArtifactError(
                f"artifact's target '{name}' does not record its device type (built by an older "
                "gimlet-tvm for a target that is not built in): rebuild it"
            )
        unknown = sorted(set(libraries) - set(LIBRARIES))
        if unknown:
            raise ArtifactError(f"target '{name}' needs runtime libraries this runtime lacks: "
                                f"{', '.join(unknown)}")
        return cls(name, device_type, libraries, entry.get("arch"))

    def device(self, index: int = 0) -> tvm.runtime.Device:
        """The runtime device the target's code runs on."""
        return tvm.device(self.device_type, index)

    def cannot_run(self) -> str | None:
        """Why this machine cannot run the target's code, or None when it can."""
        machine = _ARCH_NAMES.get(platform.machine(), platform.machine())
        if self.arch is not None and self.arch != machine:
            return f"its code is for {self.arch}; this machine is {machine}"
        return cannot_run(self.device_type)

    def load_libraries(self) -> None:
        """Load the runtime extensions the target's executables may call."""
        for name in self.libraries:
            LIBRARIES[name].load()


# What `platform.machine()` says on some systems, as LLVM names the architecture.
_ARCH_NAMES = {"arm64": "aarch64", "AMD64": "x86_64"}


def cannot_run(device_type: str) -> str | None:
    """Why no `device_type` device can run code in this process, or None when one can."""
    if device_type == "cpu":
        return None
    if device_type == "vulkan":
        return no_device_reason()
    if device_type == "cuda" and has_driver():
        # TVM loads its CUDA runtime at import only where libcudart is on the loader's path;
        # ours finds it in the CUDA toolkit or PyPI's nvidia packages (or the runtime bundle).
        try:
            load_cuda_runtime()
        except (RuntimeError, OSError) as err:
            return f"TVM's CUDA runtime does not load: {err}"
    if not tvm.device(device_type, 0).exist:
        return f"no {device_type} device or driver"
    return None


def load_available() -> None:
    """Load every runtime extension whose device exists here (an RPC server does, at start-up,
    so remote artifacts find their functions)."""
    for library in LIBRARIES.values():
        if cannot_run(library.device_type) is None:
            library.load()


def target_runtimes(targets: Sequence[Mapping[str, Any]]) -> list[TargetRuntime]:
    """An artifact's `targets` metadata, read as `TargetRuntime`s."""
    return [TargetRuntime.from_metadata(entry) for entry in targets]
