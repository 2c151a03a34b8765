"""Vulkan: TIR kernels printed as GLSL compute shaders, compiled to SPIR-V by glslangValidator,
validated by spirv-val, and run by gimlet's own Vulkan runtime (the TVM wheel ships neither a
SPIR-V code generator nor a Vulkan runtime). Runs here on lavapipe (Mesa's CPU Vulkan driver).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from pathlib import Path
from typing import Any

import tvm

from ..errors import CodeCheckError
from ..runtime.libraries import VULKAN_RUNTIME
from ..runtime.vulkan_runtime import missing_toolchain, no_device_reason, vulkan_devices
from .toolchain import find_tool, run_tool
from .gpu import (
    device_modules,
    global_func_override,
    require_kernels,
)
from .llvm import host_perf
from .spec import DISCRETE_GPU, CodegenRecord, DeviceCode, PerfFacts, TargetSpec
from .vulkan_codegen import build_vulkan, glslang
from .vulkan_kernel_fixes import fix_library_kernels

# Cross-compiling defaults: what Vulkan guarantees (maxComputeWorkGroupInvocations >= 128,
# maxComputeSharedMemorySize >= 16384), with 256 threads as most desktop drivers allow.
DEFAULT_MAX_THREADS = 256
DEFAULT_SHARED_MEMORY = 16384
SPIRV_ENV = "vulkan1.1"

VULKAN_RULES_WITHOUT: tuple[str, ...] = ()


@functools.lru_cache(maxsize=None)
def _device() -> dict[str, Any] | None:
    """Facts of Vulkan device 0 from the driver, or None where there is none."""
    if missing_toolchain() is not None:
        return None
    devices = vulkan_devices()["devices"]
    return devices[0] if devices else None


def default_target() -> dict[str, Any]:
    """Limits read from this machine's Vulkan device where there is one, else defaults.

    `thread_warp_size` stays 1: the printer emits no subgroup operations, so reductions use
    shared memory (the device's subgroup size is reported in the facts).
    """
    device = _device()
    target: dict[str, Any] = {
        "kind": "vulkan",
        "max_num_threads": DEFAULT_MAX_THREADS,
        "max_threads_per_block": DEFAULT_MAX_THREADS,
        "max_shared_memory_per_block": DEFAULT_SHARED_MEMORY,
        "thread_warp_size": 1,
        "supports_int64": True,
    }
    if device is not None:
        threads = min(DEFAULT_MAX_THREADS, device["max_workgroup_invocations"])
        target.update(
            max_num_threads=threads,
            max_threads_per_block=threads,
            max_shared_memory_per_block=device["max_shared_memory"],
            supports_int64=device["int64"],
            max_push_constants_size=device["max_push_constants"],
            max_storage_buffer_range=device["max_storage_buffer_range"],
            device_name=device["name"],
            device_type=device["kind"],
        )
    return target


def extra_facts() -> dict[str, Any]:
    device = _device()
    if device is None:
        return {"device": "none (cross-compiling with Vulkan's guaranteed limits)"}
    return {
        "device": device["name"],
        "vulkan_api": device["api_version"],
        "device_max_workgroup_invocations": device["max_workgroup_invocations"],
        "subgroup_size": device["subgroup_size"],
    }


def first_rules(target: tvm.target.Target) -> tuple[str, ...]:
    """On a CPU device (lavapipe), whose threads are SIMD lanes, matmuls reduce per thread
    (`LaneReduction`): DLight's rules reduce across threads through shared memory."""
    return ("LaneReduction",) if target.attrs.get("device_type") == "cpu" else ()


def perf_facts() -> PerfFacts:
    """A CPU Vulkan driver (lavapipe) computes in host memory with half the host's vector width
    and pays a driver round trip per dispatch; a GPU is taken to be a discrete one."""
    device = _device()
    if device is None or device["kind"] != "cpu":
        return DISCRETE_GPU
    host = host_perf()
    return PerfFacts(peak_gflops=host.peak_gflops / 2, memory_gbps=host.memory_gbps,
                     launch_us=50, link_gbps=host.memory_gbps, copy_us=20)


@contextlib.contextmanager
def codegen_hooks(target: tvm.target.Target):
    """Install our SPIR-V code generator as `target.build.vulkan` for the build."""
    record = CodegenRecord()

    def build(mod: tvm.IRModule, build_target: tvm.target.Target) -> tvm.runtime.Module:
        record.kernels |= {
            gv.name_hint for gv, func in mod.functions.items() if isinstance(func, tvm.tirx.PrimFunc)
        }
        return build_vulkan(mod, build_target)

    with global_func_override("target.build.vulkan", build):
        yield record


def validate_module(module: tvm.runtime.Module) -> set[str]:
    """Validate every kernel's SPIR-V of one Vulkan module with spirv-val; the names found.

    Raises `CodeCheckError` naming the first kernel that fails validation.
    """
    spirv = tvm.get_global_func("gimlet.vulkan.module_spirv")(module)
    with tempfile.TemporaryDirectory(prefix="gimlet-spirv-") as folder:
        for name, blob in spirv.items():
            path = Path(folder, f"{name}.spv")
            path.write_bytes(bytes(blob))
            try:
                run_tool([_spirv_val(), "--target-env", SPIRV_ENV, os.fspath(path)],
                         f"validating the SPIR-V of kernel '{name}'")
            except CodeCheckError as err:
                raise CodeCheckError(f"kernel '{name}' fails SPIR-V validation: {err}") from None
    return set(spirv.keys())


def check_code(module, record: CodegenRecord, target: tvm.target.Target) -> DeviceCode:
    """Every kernel is present as SPIR-V and passes spirv-val."""
    modules = device_modules(module, "vulkan")
    if not modules:
        raise CodeCheckError("the build contains no vulkan device module")
    found: set[str] = set()
    for device_module in modules:
        found |= validate_module(device_module)
    kernels = require_kernels(record, found, "the SPIR-V modules")
    return DeviceCode(f"SPIR-V ({SPIRV_ENV}, from GLSL 450)", kernels, "spirv-val")


def _spirv_val() -> str | None:
    return find_tool("spirv-val")


def _missing_tools() -> str | None:
    if glslang() is None:
        return "glslangValidator not found (Debian: glslang-tools)"
    if _spirv_val() is None:
        return "spirv-val not found (Debian: spirv-tools)"
    return missing_toolchain()


VULKAN = TargetSpec(
    name="vulkan",
    aliases=("spirv",),
    kind="vulkan",
    description="Vulkan devices: GLSL compute shaders compiled to SPIR-V, run by gimlet's Vulkan runtime",
    default_target=default_target,
    host=lambda: {"kind": "llvm"},
    device_type="vulkan",
    device_runtime=VULKAN_RUNTIME,
    dtypes=("float32", "int32", "int64", "bool", "int8", "uint8"),
    transposed_matmul_kernels=True,
    schedule_rules_without=VULKAN_RULES_WITHOUT,
    schedule_rules_first=first_rules,
    fix_library_kernels=fix_library_kernels,
    codegen_hooks=codegen_hooks,
    check_code=check_code,
    extra_facts=extra_facts,
    can_compile=_missing_tools,
    can_run=no_device_reason,
    perf_facts=perf_facts,
)

TARGET = VULKAN
