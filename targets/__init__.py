"""Targets: one `TargetSpec` per target, and the registry that finds them."""

from .cuda import CUDA
from .llvm import LLVM_CPU
from .metal import METAL
from .opencl import OPENCL
from .rocm import ROCM
from .vulkan import VULKAN
from .registry import ENTRY_POINT_GROUP, TargetLike, lookup, register, registered
from .spec import DeviceCode, TargetSpec

register(LLVM_CPU)
register(CUDA)
register(ROCM)
register(METAL)
register(OPENCL)
register(VULKAN)

__all__ = ["DeviceCode", "ENTRY_POINT_GROUP", "TargetLike", "TargetSpec", "lookup", "register", "registered"]
