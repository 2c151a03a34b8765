"""`TargetSpec`: everything the compiler needs to know about one target, in one place.

The middle end never asks "is this CUDA?": it asks the spec for its TVM target, its device,
the kernel libraries and hand-written kernels it has and which ops they take, which schedule
rules to leave out, the code-generation hooks to install around `tvm.compile`, and how to
check the code that came out. Schedule rules are chosen by the TVM target's keys (`"cpu"`,
`"gpu"`), as TVM's own strategies are.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Mapping, Protocol, Sequence

import tvm

from .kernels import HandwrittenKernel
from .libraries import KernelLibrary


@dataclasses.dataclass(frozen=True)
class DeviceCode:
    """The generated code of one build, as the target's own tools read it back.

    format: what the code is (`"CUDA fatbin (sm_90 SASS + PTX)"`, `"AMDGPU code object"`).
    kernels: the kernel names found in it, sorted.
    checked_with: the tool that read it (`"cuobjdump"`, `"llvm-readelf"`).
    """

    format: str
    kernels: tuple[str, ...]
    checked_with: str

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "kernels": list(self.kernels), "checked_with": self.checked_with}


@dataclasses.dataclass(frozen=True)
class PerfFacts:
    """What the placement cost model assumes of a device: a roofline and its links.

    peak_gflops: fp32 arithmetic peak; memory_gbps: device memory bandwidth (GB/s);
    launch_us: fixed cost of one kernel launch; link_gbps: host <-> device copy bandwidth,
    None where the device computes in host memory (copies cost nothing); copy_us: fixed cost
    of one copy. Estimates, not measurements: `build(..., device_facts=...)` overrides them.
    """

    peak_gflops: float
    memory_gbps: float
    launch_us: float
    link_gbps: float | None
    copy_us: float = 10.0


# A discrete GPU of the A100 class behind PCIe 4: for GPU targets that say nothing better.
DISCRETE_GPU = PerfFacts(peak_gflops=19500, memory_gbps=1500, launch_us=8, link_gbps=20)


class OpGroup(Protocol):
    """What a target's default-kernel rule (`TargetSpec.default_kernel`) reads of an op group
    (kernel selection's `OpSignature` is one): the op, its dtype, whether its second operand is
    a constant weight, and for a matmul its (M, N, K), batch axes folded into M."""

    @property
    def op(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def weight(self) -> bool: ...

    @property
    def gemm(self) -> tuple[int, int, int]: ...


DefaultKernel = Callable[[tvm.target.Target, OpGroup], str | None]
"""The candidate (kernel selection's id, `source:name`) a build without a selection runs an op
group on, chosen by a rule without measuring; None: the target's ordinary path."""


@dataclasses.dataclass
class CodegenRecord:
    """What one build's code generation produced, collected by the target's hooks.

    kernels: names of the device kernels TVM handed to the target's code generator.
    binaries: device binaries the toolchain produced (fatbins, code objects), if any.
    """

    kernels: set[str] = dataclasses.field(default_factory=set)
    binaries: list[bytes] = dataclasses.field(default_factory=list)


CodegenHooks = Callable[[tvm.target.Target], ContextManager[CodegenRecord]]
"""Installs the target's code-generation callbacks for one build, yielding its record."""

CodeCheck = Callable[[tvm.runtime.Module, CodegenRecord, tvm.target.Target], DeviceCode]
"""Reads the built code back with the target's tools; raises `CodeCheckError` when it is not
what the build asked for (a kernel missing, another architecture)."""


@contextlib.contextmanager
def no_codegen_hooks(target: tvm.target.Target):
    yield CodegenRecord()


def no_device_code(module: tvm.runtime.Module, record: CodegenRecord, target) -> DeviceCode:
    return DeviceCode("host code only", (), "-")


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """A registered compilation target.

    name / aliases: what users type (`"llvm"`, `"cpu"`).
    kind: the TVM target kind this spec builds for.
    description: one line for `gimlet-tvm targets`.
    default_target: the TVM target dict for this machine (host detection lives here).
    host: for device targets, the TVM target dict of the host code; None for host targets.
    device_type: the device type name for `tvm.device` (`"cpu"`, `"cuda"`).
    arch: for CPU targets, the architecture the code runs on (`"x86_64"`, `"aarch64"`): it
      tells CPU specs of one TVM kind apart (a target dict's `mtriple`, else this machine's).
    dtypes: element types the target's code generator handles.
    libraries: the kernel libraries its runtime provides (`library_for` asks them).
    handwritten_kernels: the kernels kept in this repository for it (kernel selection's
      hand-written source).
    fast_math: whether exp, tanh and erf become fast polynomial approximations.
    transposed_matmul_kernels: whether a matmul by a transposed weight (`matmul(x,
      permute_dims(w))`, a linear layer) becomes one kernel reading `w` in place
      (`relax_passes.transposed_matmul`) instead of a transpose kernel copying `w` at every call and a
      matmul; a library's dispatch, which takes the pair itself, runs first.
    schedule_rules_without: default schedule rules (by name) known to fail this target.
    schedule_rules_first: the target's own schedule rules (by name, from the rule set's
      opt-in registry), tried before the defaults; a function of the TVM target, since what
      suits a device may depend on what kind of device it is.
    fix_library_kernels: the module with the TIR kernels TVM's libraries put in it (the paged
      KV cache's attention kernels) that are wrong or slow on this target replaced by ours; the
      pipeline's first step.
    codegen_hooks / check_code: how to generate device code, and how to check it.
    can_compile / can_run: whether this machine can generate code for / execute on it; each
      returns None when it can, else the reason it can't.
    linker: how an exported artifact's shared library is linked (TVM's `fcompile`, e.g. a
      cross linker); None: this machine's C++ compiler.
    device_runtime: the runtime extension that provides its device where TVM's runtime has
      none (`runtime.libraries.VULKAN_RUNTIME`); artifacts record it with its libraries'
      (`runtime_libraries`), so a device loads what they need without the compiler.
    perf_facts: the device's roofline, for cross-device placement.
    default_kernel: the target's built-in choices for builds without a kernel selection (a
      rule of op group and shape, made from measurements, not a tuning run); a selection's
      entries win over it, `$GIMLET_TVM_DEFAULT_KERNELS=0` turns it off.
    """

    name: str
    kind: str
    description: str
    default_target: Callable[[], dict[str, Any]]
    device_type: str
    aliases: tuple[str, ...] = ()
    host: Callable[[], dict[str, Any]] | None = None
    arch: str | None = None
    dtypes: tuple[str, ...] = ("float32", "float16", "int32", "int64", "bool")
    libraries: tuple[KernelLibrary, ...] = ()
    handwritten_kernels: tuple[HandwrittenKernel, ...] = ()
    fast_math: bool = False
    transposed_matmul_kernels: bool = False
    schedule_rules_without: tuple[str, ...] = ()
    schedule_rules_first: Callable[[tvm.target.Target], tuple[str, ...]] = lambda target: ()
    fix_library_kernels: Callable[[tvm.IRModule], tvm.IRModule] = lambda mod: mod
    codegen_hooks: CodegenHooks = no_codegen_hooks
    check_code: CodeCheck = no_device_code
    extra_facts: Callable[[], Mapping[str, Any]] = dict
    can_compile: Callable[[], str | None] = lambda: None
    can_run: Callable[[], str | None] = lambda: "no runtime for this target in this build"
    device_runtime: str | None = None
    linker: Callable[..., Any] | None = None
    perf_facts: Callable[[], PerfFacts] = lambda: DISCRETE_GPU
    default_kernel: DefaultKernel = lambda target, group: None

    @property
    def is_cpu(self) -> bool:
        """Whether the target is a CPU: its code runs where its host code runs (no device)."""
        return self.host is None

    def runs_here(self) -> bool:
        """Whether it is this machine's CPU, so C compiled here for it runs here."""
        return self.is_cpu and self.can_run() is None

    @property
    def runtime_libraries(self) -> tuple[str, ...]:
        """The runtime extensions its executables need: the device's, then its libraries'."""
        names = [self.device_runtime] if self.device_runtime else []
        return tuple(dict.fromkeys(names + [lib.runtime for lib in self.libraries]))

    def library_for(self, op: str, dtype: str) -> KernelLibrary | None:
        """The first of its libraries that takes `op` on `dtype` tensors, if any."""
        return next((lib for lib in self.libraries if lib.takes(op, dtype)), None)

    @property
    def tunes_cache_cold(self) -> bool:
        """Whether MetaSchedule times each candidate once per run with its operands (all but
        the first) flushed from the CPU caches, as kernel selection does: for host targets,
        whose repeated runs would otherwise keep a weight in the cache that a model evicts. Not
        for device targets: the flush runs on the CPU over the operands' addresses."""
        return self.is_cpu

    def make_target(self, overrides: Mapping[str, Any] | None = None) -> tvm.target.Target:
        """The TVM target: this machine's defaults with `overrides` on top."""
        config = dict(self.default_target())
        config.update(overrides or {})
        if self.host is None:
            return tvm.target.Target(config)
        return tvm.target.Target(config, host=self.host())

    def device(self, index: int = 0) -> tvm.runtime.Device:
        """The runtime device executables built for this target run on."""
        return tvm.device(self.device_type, index)

    def cannot_run(self, dtypes: Sequence[str]) -> str | None:
        """Why an op on tensors of `dtypes` cannot run on this target, or None (its capability
        check, as an execution provider declares what it runs)."""
        unsupported = sorted(set(dtypes) - set(self.dtypes))
        return f"{self.name} has no {', '.join(unsupported)} support" if unsupported else None

    def facts(self) -> dict[str, Any]:
        """Device facts the compiler uses, read from the default TVM target and the spec."""
        attrs = dict(self.make_target().export())
        facts = {
            key: attrs[attr]
            for key, attr in (
                ("max_threads_per_block", "max_num_threads"),
                ("warp_size", "thread_warp_size"),
                ("shared_memory_per_block", "max_shared_memory_per_block"),
            )
            if attr in attrs
        }
        facts.update(self.extra_facts())
        facts["dtypes"] = ",".join(self.dtypes)
        return facts
