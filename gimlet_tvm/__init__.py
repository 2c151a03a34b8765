"""gimlet-tvm: an ML compiler stack on Apache TVM.

    model = gimlet_tvm.build("model.onnx", "llvm")
    outputs = model(x)
    model.export("model.so"); model = gimlet_tvm.load("model.so")
"""

__version__ = "0.1.0"

from .compiler import build
from .errors import (
    ArtifactError,
    CodeCheckError,
    CompileError,
    GimletError,
    InputError,
    ModelImportError,
    ModelLoadError,
    TargetUnavailableError,
    UnknownTargetError,
    UnsupportedOpError,
)
from .runtime import BenchmarkResult, CompiledModel, load
from .tuning import tune

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
    "TargetUnavailableError",
    "UnknownTargetError",
    "UnsupportedOpError",
    "__version__",
    "build",
    "load",
    "tune",
]
