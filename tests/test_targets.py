"""Targets: the registry, and device code for every GPU target checked with real toolchains.

CUDA fatbins are read back with cuobjdump, ROCm code objects with llvm-readelf, OpenCL C is
compiled by clang, Metal source is checked for structure (no Metal compiler on Linux).
"""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

import gimlet_tvm
from gimlet_tvm import targets
from gimlet_tvm.errors import CodeCheckError, TargetUnavailableError
from gimlet_tvm.targets.gpu import require_kernels
from gimlet_tvm.targets.metal import brackets_balance
from gimlet_tvm.targets.spec import CodegenRecord

from .conftest import TEST_MODELS, suite_model

GPU_BUILDS = {
    "cuda-sm_80": ({"kind": "cuda", "arch": "sm_80"}, "CUDA fatbin (sm_80 SASS + PTX)"),
    "cuda-sm_90": ({"kind": "cuda", "arch": "sm_90"}, "CUDA fatbin (sm_90 SASS + PTX)"),
    "rocm-gfx90a": ({"kind": "rocm", "mcpu": "gfx90a"}, "AMDGPU code object (gfx90a)"),
    "metal": ("metal", "Metal Shading Language source"),
    "opencl": ("opencl", "OpenCL C source (compiles to SPIR)"),
}


@pytest.mark.parametrize("build", GPU_BUILDS)
@pytest.mark.parametrize("name", TEST_MODELS)
def test_model_suite_compiles_and_checks(tmp_path, name: str, build: str) -> None:
    target, expected_format = GPU_BUILDS[build]
    model = gimlet_tvm.build(suite_model(name), target)
    code = model.targets[0]["device_code"]
    assert code["format"] == expected_format
    assert len(code["kernels"]) >= 3 and all(k.endswith("_kernel") for k in code["kernels"])
    path = tmp_path / f"{name}.so"
    model.export(path)
    with pytest.raises(TargetUnavailableError, match="cannot run on this machine"):
        gimlet_tvm.load(path)
    with pytest.raises(TargetUnavailableError, match="cannot run on this machine"):
        model(*(np.zeros([1 if isinstance(d, str) else d for d in s.shape], s.dtype)
                for s in model.inputs))


def test_cuda_artifact_embeds_the_checked_fatbin(tmp_path) -> None:
    model = gimlet_tvm.build(suite_model("mlp"), {"kind": "cuda", "arch": "sm_90"})
    model.export(tmp_path / "mlp.so")
    fatbin_magic = (0xBA55ED50).to_bytes(4, "little")
    assert fatbin_magic in (tmp_path / "mlp.so").read_bytes()


def test_cuda_arch_override_reaches_nvcc() -> None:
    model = gimlet_tvm.build(suite_model("mlp"), {"kind": "cuda", "arch": "sm_75"})
    assert model.targets[0]["target"]["arch"] == "sm_75"
    assert model.targets[0]["device_code"]["format"] == "CUDA fatbin (sm_75 SASS + PTX)"


def test_missing_kernel_is_reported() -> None:
    record = CodegenRecord(kernels={"a_kernel", "b_kernel"})
    with pytest.raises(CodeCheckError, match=r"1 kernel\(s\) missing from the SASS: \['b_kernel'\]"):
        require_kernels(record, {"a_kernel"}, "the SASS")
    with pytest.raises(CodeCheckError, match="no kernels were generated"):
        require_kernels(CodegenRecord(), set(), "the SASS")


def test_malformed_metal_source_is_caught() -> None:
    assert brackets_balance("kernel void k(device float* a) { a[0] = (1.0f); }")
    assert not brackets_balance("kernel void k(device float* a) { a[0] = (1.0f; }")
    assert not brackets_balance("kernel void k() { }}")


def test_every_target_listed_with_facts(cli) -> None:
    code, out, err = cli("targets")
    assert code == 0, err
    for name in ("llvm", "cuda", "rocm", "metal", "opencl"):
        assert any(line.startswith(f"{name} ") for line in out.splitlines()), name
    assert "warp_size=32" in out and "warp_size=64" in out


def test_facts_come_from_the_target() -> None:
    cuda, _ = targets.lookup("cuda")
    facts = cuda.facts()
    assert facts["max_threads_per_block"] == 1024 and facts["warp_size"] == 32
    assert facts["shared_memory_per_block"] == 49152
    rocm, _ = targets.lookup("amd")
    assert rocm.name == "rocm" and rocm.facts()["warp_size"] == 64


def test_duplicate_registration_refused() -> None:
    llvm, _ = targets.lookup("llvm")
    with pytest.raises(ValueError, match="already registered"):
        targets.register(llvm)


def test_entry_point_adds_a_target(tmp_path, monkeypatch) -> None:
    """A package outside ours registers a target through the entry-point group."""
    (tmp_path / "acme_targets.py").write_text(textwrap.dedent('''
        from gimlet_tvm.targets import TargetSpec

        ACME = TargetSpec(
            name="acme-cpu",
            kind="llvm",
            description="ACME's CPU (a renamed LLVM target)",
            default_target=lambda: {"kind": "llvm", "num-cores": 1},
            device_type="cpu",
            can_run=lambda: None,
        )
    '''))
    dist = tmp_path / "acme_targets-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-targets\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[gimlet_tvm.targets]\nacme = acme_targets:ACME\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(targets.registry, "_entry_points_loaded", False)
    monkeypatch.setattr(targets.registry, "_SPECS", dict(targets.registry._SPECS))
    monkeypatch.setattr(targets.registry, "_ALIASES", dict(targets.registry._ALIASES))
    assert "acme-cpu" in [spec.name for spec in targets.registered()]
    model = gimlet_tvm.build(suite_model("mlp"), "acme-cpu")
    assert model.targets[0]["name"] == "acme-cpu"
    x = np.ones((2, 1024), np.float32)
    assert model(x)[0].shape == (2, 1024)
    sys.modules.pop("acme_targets", None)
