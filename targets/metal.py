"""Metal: Metal Shading Language from TVM's code generator, exported with the artifact.

No Metal compiler exists on Linux, so the check is structural: every kernel handed to the
code generator is defined as a `kernel void` function in the MSL, the source includes the
Metal standard library, and its brackets balance. Compiling and running need a Mac.
"""

from __future__ import annotations

import contextlib

import tvm

from ..errors import CodeCheckError
from .gpu import device_source, kernel_names, recording_codegen, require_kernels
from .spec import CodegenRecord, DeviceCode, TargetSpec

_KERNEL_IN_MSL = r"^kernel void (\w+)\("
_PAIRS = {")": "(", "]": "[", "}": "{"}


def brackets_balance(source: str) -> bool:
    """Whether (), [] and {} nest properly in `source` (string literals aside: MSL from TVM
    has none)."""
    stack = []
    for char in source:
        if char in "([{":
            stack.append(char)
        elif char in _PAIRS and (not stack or stack.pop() != _PAIRS[char]):
            return False
    return not stack


@contextlib.contextmanager
def codegen_hooks(target: tvm.target.Target):
    with recording_codegen("metal") as record:
        yield record


def check_code(module, record: CodegenRecord, target: tvm.target.Target) -> DeviceCode:
    source = device_source(module, "metal", "metal")
    if "#include <metal_stdlib>" not in source:
        raise CodeCheckError("the Metal source does not include <metal_stdlib>")
    if not brackets_balance(source):
        raise CodeCheckError("the Metal source is malformed: unbalanced brackets")
    kernels = require_kernels(record, kernel_names(_KERNEL_IN_MSL, source), "the Metal source")
    return DeviceCode("Metal Shading Language source", kernels, "MSL structure check")


METAL = TargetSpec(
    name="metal",
    aliases=("apple",),
    kind="metal",
    description="Apple GPUs: Metal Shading Language source (compiled by the Metal runtime)",
    default_target=lambda: {"kind": "metal"},
    host=lambda: {"kind": "llvm"},
    device_type="metal",
    dtypes=("float32", "float16", "int32", "bool"),
    # DLight's Matmul rule segfaulted once on Metal and makes its builds slow: left out.
    schedule_rules_without=("Matmul",),
    codegen_hooks=codegen_hooks,
    check_code=check_code,
    can_run=lambda: None if tvm.metal(0).exist else "no Metal device (needs macOS)",
)

TARGET = METAL
