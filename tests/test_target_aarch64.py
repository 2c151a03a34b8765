"""The AArch64 CPU target, added as one module (`targets/aarch64.py`): the suite compiles for it
on this machine, the code is AArch64 with NEON vector instructions, and it is not run here."""

from __future__ import annotations

import re
import subprocess

import pytest
import tvm
from tvm.relax.frontend.onnx import from_onnx

import gimlet_tvm
from gimlet_tvm import models
from gimlet_tvm.compiler import graph_passes
from gimlet_tvm.relax_passes.dispatch_cpu_library import direct_conv_block
from gimlet_tvm.relax_passes.library_dispatch import library_passes
from gimlet_tvm.errors import GimletError
from gimlet_tvm.targets import lookup, spec_for
from gimlet_tvm.targets.gpu import device_modules
from gimlet_tvm.targets.toolchain import llvm_tool

SPEC, _ = lookup("aarch64")
pytestmark = pytest.mark.skipif(SPEC.can_compile() is not None, reason=f"cannot compile: {SPEC.can_compile()}")


def test_registered_and_told_apart_from_the_host_cpu() -> None:
    assert lookup("arm64")[0] is SPEC
    target = SPEC.make_target()
    assert spec_for(target) is SPEC
    assert spec_for(lookup("llvm")[0].make_target()) is not SPEC
    assert lookup({"kind": "llvm", "mtriple": "aarch64-unknown-linux-gnu", "mcpu": "cortex-a76"})[0] is SPEC
    assert "cpu" in target.keys and "arm_cpu" in target.keys  # CPU schedule rules apply


@pytest.mark.parametrize("name", [name for name, info in models.SUITE.items() if info.in_tests])
def test_suite_model_compiles_to_aarch64(name: str) -> None:
    model = gimlet_tvm.build(models.SUITE[name].builder(), "aarch64")
    code = model.targets[0]["device_code"]
    assert code["format"].startswith("AArch64 ELF object") and code["checked_with"] == "llvm-readelf"
    assert code["kernels"] and all(name.startswith("__tvm_ffi_") for name in code["kernels"])


def test_code_uses_neon(tmp_path) -> None:
    """A depthwise convolution (generated TIR, not a library call) vectorizes to NEON."""
    model = gimlet_tvm.build(models.SUITE["mobilenet_cnn"].builder(), "aarch64")
    obj = tmp_path / "model.o"
    device_modules(model._module, "llvm")[0].write_to_file(str(obj))
    disassembly = subprocess.run([llvm_tool("llvm-objdump"), "-d", str(obj)], capture_output=True, text=True,
                                 check=True).stdout
    assert re.search(r"\bfml[as]\s+v\d+\.4s", disassembly), "no NEON float32 FMA in the code"


def test_does_not_run_on_another_machine() -> None:
    if SPEC.can_run() is None:
        pytest.skip("this machine is AArch64")
    model = gimlet_tvm.build(models.SUITE["mlp"].builder(), "aarch64")
    with pytest.raises(GimletError, match="for aarch64; this machine is"):
        model.run(models.SUITE["mlp"].example_inputs())


def test_exported_artifact_is_an_aarch64_library_refused_here(tmp_path) -> None:
    """Export links with the target's cross linker (clang + lld); loading it here says why not."""
    path = tmp_path / "mlp.so"
    gimlet_tvm.build(models.SUITE["mlp"].builder(), "aarch64").export(path)
    header = subprocess.run([llvm_tool("llvm-readelf"), "--file-header", str(path)], capture_output=True, text=True,
                            check=True).stdout
    assert re.search(r"Type:\s+DYN", header) and re.search(r"Machine:\s+AArch64", header)
    if SPEC.can_run() is None:
        pytest.skip("this machine is AArch64")
    with pytest.raises(GimletError, match="for aarch64; this machine is"):
        gimlet_tvm.load(path).run(models.SUITE["mlp"].example_inputs())


@pytest.mark.parametrize("name", ["resnet_cnn", "mobilenet_cnn"])
def test_conv_kernels_picked_by_this_cpu_stay_off_a_cross_build(name: str) -> None:
    """The CPU library's direct, Winograd, row and depthwise conv kernels are chosen by this
    machine's instruction sets (AVX2, AVX-512): an AArch64 build gets the generic conv call,
    while the host build of the same model takes them (where this CPU has them)."""
    mod = from_onnx(models.SUITE[name].build(), keep_params_in_input=False)
    calls = {}
    for spec in (SPEC, lookup("llvm")[0]):
        dispatched = tvm.transform.Sequential([*graph_passes(), *library_passes(spec)])(mod)
        calls[spec.name] = set(re.findall(r'"(gimlet\.cpu\.\w+)"', dispatched.script()))
    assert "gimlet.cpu.conv2d_nchw" in calls[SPEC.name]
    assert not {c for c in calls[SPEC.name] if c.startswith("gimlet.cpu.conv2d_") or "nchwc" in c} - {
        "gimlet.cpu.conv2d_nchw"}
    if direct_conv_block():
        assert calls["llvm"] - calls[SPEC.name]
