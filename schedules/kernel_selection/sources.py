"""Where candidates come from: one function per source in `SOURCES`, each listing the
candidates it has for an op signature on a target (unavailable ones too, with the reason).

- generated: the op legalized to TIR (an op that is itself a shipped TIR kernel, the
  dequant_gemv, keeps that kernel: `OpKind.baseline`); with an epilogue, the group fused into one TIR kernel on
  its own (FuseOps in the model could fuse it otherwise, e.g. a residual add of two
  convolutions into the other one, and then neither the kernel measured nor its tuning
  records would be the one that runs);
  the build schedules it with MetaSchedule records when the records directory has one for
  it, else with the target's default rules;
- library: a call into one of the target's libraries that takes the op (`TargetSpec.libraries`;
  the CPU library's `gimlet.cpu.matmul` (OpenBLAS) or `.attention` through
  `DispatchCPULibrary`, epilogue included; for conv2d, each of its conv algorithms
  (`dispatch_cpu_library.CONV_ALGORITHMS`: Winograd F(4x4) and F(2x2), direct with 16- and
  8-channel blocks, row-vectorized, im2col + OpenBLAS; on NCHW{B}c data, `conv2d_nchwc`, the
  Winograd ones and the direct one of the data's block) as its own candidate whose rewrite
  emits that kernel's call, so the library's default rule no longer decides for it; the CUDA
  library's cuBLAS SGEMM for matmul, `gimlet.cuda.matmul`, where cuBLAS is installed);
- handwritten: the target's hand-written kernels for the op (`TargetSpec.handwritten_kernels`);
- external: kernels in a directory described by `kernels.json` (see `external.py`);
- generator: kernels a kernel generator wrote during selection, kept in a directory of the same
  form (`gimlet_tvm.selection.generator`).

Each source takes the directories of those last two as `KernelDirs`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Callable

import numpy as np
import tvm
from tvm import relax

from ...relax_passes.dispatch_cpu_library import (CONV_ALGORITHMS, ConvAlgorithm, ConvShape,
                                                  DispatchCPULibrary, direct_conv_block)
from ...runtime.cuda_runtime import load_cuda_library
from ...targets import spec_for
from ...targets.kernels import MAX_ADDENDS
from ...targets.libraries import CPU_LIBRARY, CUDA_LIBRARY
from .candidates import Candidate, OpSignature, Rewrite, call_prim_func, emit_epilogue
from .external import external_candidates
from .op_kinds import find_group

CUBLAS_MATMUL = f"{CUDA_LIBRARY.name}.matmul"


@dataclasses.dataclass(frozen=True)
class KernelDirs:
    """Where kernels from outside the compiler live: `external` (given by the user) and
    `generated` (written by a kernel generator during selection); None: none."""

    external: str | None = None
    generated: str | None = None


def generated(sig: OpSignature, target: tvm.target.Target, dirs: KernelDirs) -> list[Candidate]:
    if not sig.kind.legalizes:
        return [Candidate("generated", "tir", "LegalizeOps TIR", _keep,
                          unavailable=f"LegalizeOps has no TIR for {sig.op}")]
    if sig.kind.baseline is not None:
        return [Candidate("generated", "tir", f"the shipped TIR kernel ({sig.kind.baseline}); MetaSchedule "
                          "records do not reschedule it", _keep)]

    def rewrite(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        kind, group = find_group(call)
        call_sig = OpSignature.of_call(call)
        # A lone op (attention, a depthwise conv) is left to FuseOps, which may fuse what follows
        # it, as in the default build; so is a group that does not fuse into one kernel.
        fused = _fused(call_sig, str(target)) if group.steps else None
        if fused is None:
            op = bb.normalize(kind.emit(group.operands, group.attrs))
            out = op.op.get_attr("FLegalize")(bb, op)
            return emit_epilogue(bb, bb.emit(out) if group.steps else out, group.addends, group.steps)
        func, name, order = fused
        args = [*group.operands, *group.addends]
        gvar = bb.add_func(func, name)
        return relax.call_tir(gvar, [args[i] for i in order], relax.TensorType(call_sig.out_shape, call_sig.dtype))

    return [Candidate("generated", "tir", "LegalizeOps TIR, a group with an epilogue as one kernel; MetaSchedule "
                      "record or default schedule", rewrite)]


@functools.lru_cache(maxsize=256)
def _fused(sig: OpSignature, target_json: str) -> tuple[tvm.tirx.PrimFunc, str, tuple[int, ...]] | None:
    """`sig.module()` legalized and fused (LegalizeOps, AnnotateTIROpPattern, FuseOps, FuseTIR):
    its one kernel (opaque to FuseOps), the kernel's name and which of the group's operands
    then addends it takes in order; None when the group does not become a single kernel.
    Cached: a model repeats its groups (the target as its JSON text, to be hashable)."""
    mod = sig.module()
    params = list(mod["main"].params)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with tvm.target.Target(json.loads(target_json)):
        mod = tvm.transform.Sequential(passes)(mod)
    call_tir = tvm.ir.Op.get("relax.call_tir")
    calls = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: calls.append(e)
                                    if isinstance(e, relax.Call) and e.op == call_tir else None)
    if len(calls) != 1:
        return None
    gvar, args = calls[0].args[0], calls[0].args[1].fields
    order = tuple(next((i for i, p in enumerate(params) if p.same_as(arg)), -1) for arg in args)
    if -1 in order:
        return None
    return mod[gvar].with_attr("op_pattern", 8), gvar.name_hint, order


def _keep(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    return call


def _cpu_library_call(sig: OpSignature) -> str | None:
    """The packed function `DispatchCPULibrary` turns the op into, if it does (with a constant
    weight where the signature's is one: some kernels take only those)."""
    weights = [np.zeros(sig.shapes[1], sig.dtype)] if sig.weight else []
    for _, func in DispatchCPULibrary()(sig.module(weights)).functions_items():
        found = []
        relax.analysis.post_order_visit(func.body, lambda e: found.append(e.global_symbol)
                                        if isinstance(e, relax.ExternFunc) else None)
        if found:
            return found[0]
    return None


def _cpu_library(name: str) -> Callable[[OpSignature, tvm.target.Target], list[Candidate]]:
    """The CPU library's candidate `name` (its function for the op, as `DispatchCPULibrary`
    calls it, from runtime/ext/cpu_library.cc)."""
    def candidates(sig: OpSignature, target: tvm.target.Target) -> list[Candidate]:
        func = _cpu_library_call(sig)
        reason = None if func else "DispatchCPULibrary does not take this op"
        return [Candidate("library", name, f"{func or CPU_LIBRARY.name} ({CPU_LIBRARY.source})",
                          _keep, unavailable=reason)]
    return candidates


def _cpu_conv2d(sig: OpSignature, target: tvm.target.Target) -> list[Candidate]:
    """One candidate per conv algorithm of the CPU library (`CONV_ALGORITHMS`: `library:conv_
    winograd4`, ...), unavailable where it cannot run the shape; for NCHW, also
    `library:openblas`, the default rule's pick (what versions before those candidates recorded
    as the winner; listed as unavailable, so selection does not time one of the others twice,
    but still applied where older records chose it)."""
    cpu_block = direct_conv_block() if spec_for(target).runs_here() else 0
    shape = signature_conv_shape(sig)

    def rewrite(algorithm: ConvAlgorithm) -> Rewrite:
        return lambda bb, call: algorithm.emit(bb, call, cpu_block)

    older = [] if shape.block else [
        Candidate("library", "openblas", f"the default rule's conv algorithm ({CPU_LIBRARY.source})", _keep,
                  unavailable="the default rule, kept for older records: each algorithm is its own candidate")]
    return [
        *(Candidate("library", f"conv_{a.name}", f"{a.func} ({CPU_LIBRARY.source})", rewrite(a),
                    unavailable=a.unavailable(shape, cpu_block)) for a in CONV_ALGORITHMS.values()),
        *older,
    ]


def signature_conv_shape(sig: OpSignature) -> ConvShape:
    """A conv2d signature (NCHW or NCHW{B}c) as the conv algorithms read it."""
    p = {name: int(value) for name, value in sig.attrs}
    out_c, in_c, kh, kw = sig.shapes[1]
    params = (p["stride_h"], p["stride_w"], p["pad_top"], p["pad_left"], p["dilation_h"], p["dilation_w"])
    block = sig.shapes[0][4] if len(sig.shapes[0]) == 5 else 0
    return ConvShape(out_c, in_c, (kh, kw), tuple(sig.out_shape[2:4]), params, p["groups"], sig.weight, block)


def _cublas(sig: OpSignature, target: tvm.target.Target) -> list[Candidate]:
    """cuBLAS's SGEMM for a matmul without epilogue (the CUDA op groups have none)."""
    reason = load_cuda_library()
    if reason is None and (sig.dtype != "float32" or sig.epilogue):
        reason = "float32 matmul without epilogue only"
    return [Candidate("library", "cublas", f"{CUBLAS_MATMUL} ({CUDA_LIBRARY.source})",
                      _call_cublas, unavailable=reason)]


def _call_cublas(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    _, group = find_group(call)
    return relax.call_dps_packed(CUBLAS_MATMUL, group.operands, call.ty)


# The candidates of each library (by name) and op: the CPU library's matmul calls OpenBLAS, its
# conv2d has several algorithms (Winograd, direct, row-vectorized, im2col + OpenBLAS), its
# attention is its own (blocked scores, softmax, weighted sum).
LIBRARY_CANDIDATES = {
    CPU_LIBRARY.name: {"matmul": _cpu_library("openblas"), "conv2d": _cpu_conv2d, "conv2d_nchwc": _cpu_conv2d,
                       "attention": _cpu_library("gimlet_attention")},
    CUDA_LIBRARY.name: {"matmul": _cublas},
}


def library(sig: OpSignature, target: tvm.target.Target, dirs: KernelDirs) -> list[Candidate]:
    return [c for lib in spec_for(target).libraries if sig.op in LIBRARY_CANDIDATES.get(lib.name, {})
            for c in LIBRARY_CANDIDATES[lib.name][sig.op](sig, target)]


def handwritten(sig: OpSignature, target: tvm.target.Target, dirs: KernelDirs) -> list[Candidate]:
    def rewrite(kernel):
        def emit(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
            call_sig = OpSignature.of_call(call)
            m, n, k = call_sig.gemm
            func = kernel.prim_func(target, m, n, k, call_sig.epilogue, call_sig.addends_2d())
            packed = kernel.packed_b(target, n, k) if kernel.packed_b else None
            return call_prim_func(bb, call, func, kernel.name, packed)
        return emit

    def unavailable(kernel) -> str | None:
        if sig.dtype != "float32":
            return "float32 only"
        if kernel.packed_b and not sig.weight:
            return "takes B packed: B must be a constant weight"
        if sig.epilogue and not kernel.fuses_epilogue:
            return "fuses no epilogue"
        if sig.addends_2d() is None or len(sig.addend_shapes) > MAX_ADDENDS:
            return f"epilogue adds it cannot fuse (at most {MAX_ADDENDS}, each a row, column or tensor)"
        return None

    return [
        Candidate("handwritten", kernel.name, kernel.file, rewrite(kernel), unavailable=unavailable(kernel))
        for kernel in spec_for(target).handwritten_kernels
        if kernel.op == sig.op
    ]


def external(sig: OpSignature, target: tvm.target.Target, dirs: KernelDirs) -> list[Candidate]:
    return external_candidates(dirs.external, sig, target) if dirs.external else []


def generator(sig: OpSignature, target: tvm.target.Target, dirs: KernelDirs) -> list[Candidate]:
    return external_candidates(dirs.generated, sig, target, "generator") if dirs.generated else []


SOURCES = {"generated": generated, "library": library, "handwritten": handwritten, "external": external,
           "generator": generator}


def candidates(sig: OpSignature, target: tvm.target.Target, external_dir: str | None = None,
               generated_dir: str | None = None) -> list[Candidate]:
    """Every candidate for `sig` on `target`, from every source."""
    dirs = KernelDirs(external_dir, generated_dir)
    return [c for source in SOURCES.values() for c in source(sig, target, dirs)]


def find(candidate_id: str, sig: OpSignature, target: tvm.target.Target,
         external_dir: str | None = None, generated_dir: str | None = None) -> Candidate:
    """The candidate with this id (`source:name`)."""
    source = candidate_id.split(":", 1)[0]
    for candidate in SOURCES[source](sig, target, KernelDirs(external_dir, generated_dir)):
        if candidate.id == candidate_id:
            return candidate
    raise KeyError(candidate_id)
