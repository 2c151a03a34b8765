"""gimlet's Vulkan runtime (`ext/vulkan/`): TVM's `device_api.vulkan`, the Vulkan module that
launches SPIR-V kernels, and its loader for exported artifacts.

The TVM wheel ships no Vulkan runtime; this one is built with g++ against the wheel's headers
and the system's Vulkan loader (Debian `libvulkan-dev`) on first use, and loaded into the
process. Device buffers live in host-visible memory (every Vulkan device has some), so copies
are host memcpys after the queued kernels finish: right for lavapipe, slower than staging
copies on a discrete GPU.
"""

from __future__ import annotations

import ctypes
import functools
import json
from pathlib import Path
from typing import Any

import tvm

from .extensions import CXXFLAGS, EXT_DIR, build_library, include_args, link_args

VULKAN_SOURCES = sorted((EXT_DIR / "vulkan").glob("*.cc"))
VULKAN_HEADER = Path("/usr/include/vulkan/vulkan.h")


def missing_toolchain() -> str | None:
    """Why the Vulkan runtime cannot be built here, or None."""
    if not VULKAN_HEADER.is_file():
        return "Vulkan headers not found (Debian: libvulkan-dev)"
    return None


@functools.lru_cache(maxsize=None)
def load_vulkan_runtime() -> Path:
    """Build (if needed) and load the Vulkan runtime; returns the library's path."""
    reason = missing_toolchain()
    if reason is not None:
        raise RuntimeError(f"cannot build the Vulkan runtime: {reason}")
    library = build_library(
        "gimlet_vulkan", VULKAN_SOURCES, [*CXXFLAGS, *include_args(), *link_args(), "-lvulkan"]
    )
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    return library


def vulkan_devices() -> dict[str, Any]:
    """`{"devices": [{name, limits...}], "error": why none}` as the driver reports them."""
    load_vulkan_runtime()
    return json.loads(tvm.get_global_func("gimlet.vulkan.devices")())


def no_device_reason() -> str | None:
    """Why no Vulkan device can run kernels in this process, or None when one can."""
    try:
        info = vulkan_devices()
    except RuntimeError as err:
        return str(err)
    if info["devices"]:
        return None
    return info.get("error", "no Vulkan device")
