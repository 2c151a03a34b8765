"""gimlet-tvm: an ML compiler stack on Apache TVM.

    model = gimlet_tvm.build("model.onnx", "llvm")
    outputs = model(x)
    model.export("model.so"); model = gimlet_tvm.load("model.so")

The runtime side (`load`, `CompiledModel`, the errors) is imported here directly; the compiler
side (`build`, `tune`) only when first used (`__getattr__` below), so that `import
gimlet_tvm.runtime` on a device that runs exported artifacts needs no compiler: neither our
compiler packages nor TVM's compiler library (`gimlet-tvm runtime-bundle` ships without them).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from .errors import (
    ArtifactError,
    CodeCheckError,
    CompileError,
    GimletError,
    InputError,
    ModelImportError,
    ModelLoadError,
    ResourceLimitError,
    RunError,
    TargetUnavailableError,
    UnknownTargetError,
    UnsupportedOpError,
)
from .runtime import BenchmarkResult, CompiledModel, load

_COMPILER_SIDE = {"build": "gimlet_tvm.compiler", "tune": "gimlet_tvm.tuning"}
"""Public names imported on first use, and the module each comes from."""
_LAZY_PACKAGES = ("llm",)
"""Subpackages on the compiler side, imported on first use (`gimlet_tvm.llm.load(...)`)."""


def __getattr__(name: str) -> Any:
    """PEP 562: import `build` / `tune` / `llm` (and with them the compiler) when first asked for."""
    if name in _COMPILER_SIDE:
        value = getattr(importlib.import_module(_COMPILER_SIDE[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_PACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'gimlet_tvm' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_COMPILER_SIDE) | set(_LAZY_PACKAGES))


__all__ = [
    "ArtifactError",
    "BenchmarkResult",
    "CodeCheckError",
    "CompiledModel",
    "CompileError",
    "GimletError",
    "InputError",
    "ModelImportError",
    "ModelLoadError",
    "ResourceLimitError",
    "RunError",
    "TargetUnavailableError",
    "UnknownTargetError",
    "UnsupportedOpError",
    "__version__",
    "build",
    "llm",
    "load",
    "tune",
]
