"""The passes that hand a target's ops to its kernel libraries: `layout_passes(spec)` and
`library_passes(spec)`.

Where they go: after graph fusion, before LegalizeOps, which would otherwise turn the ops into
TIR; kernel selection's rewrites (`ApplyKernelSelection`) run between the two. This machine's
CPU, with the CPU library, first gets `BlockedLayout` (`layout_passes`: regions of a CNN in
channel-blocked NCHW{B}c, for the library's blocked conv kernels); it runs before kernel
selection, so a blocked conv keeps its blocked kernel (it is no op group: selection, which sees
the module the same way, `selection.select.op_signatures`, offers nothing for it), and the
convs selection can choose for are the ones left in NCHW. Each library a target's spec lists
(`TargetSpec.libraries`) that has a dispatch pass gets it, in the spec's order; on this machine's
CPU then `ConcatInPlace` (blocked direct convs writing into their channel concat); then, where the
spec asks for fast math, `FastMathTransform` and `fast_activations` (GELU ops); where it asks for transposed-matmul kernels,
`transposed_matmul_kernels` (after the dispatch, so a library still gets the pairs it takes). A
library without a dispatch pass (cuBLAS) is reached only through kernel selection, which calls
it where it won.
"""

from __future__ import annotations

from typing import Callable

import tvm
from tvm import relax

from ..targets import TargetSpec
from ..targets.libraries import CPU_LIBRARY
from .blocked_layout import BlockedLayout
from .concat_in_place import ConcatInPlace
from .dispatch_cpu_library import DispatchCPULibrary
from .fast_activations import fast_activations
from .transposed_matmul import transposed_matmul_kernels

LIBRARY_DISPATCH: dict[str, Callable[[bool, bool], tvm.transform.Pass]] = {CPU_LIBRARY.name: DispatchCPULibrary}
"""Each library's dispatch pass, made with `grouping` (True where it forms kernel selection's
op groups: each op one generic library call, whichever of the library's kernels would run it;
False where it also picks those kernels) and `host` (the target is this machine's: kernels
chosen by this machine's instruction sets may run)."""


def dispatch_passes(spec: TargetSpec, grouping: bool = False) -> list[tvm.transform.Pass]:
    """The dispatch passes of the spec's libraries; with `grouping`, as they form kernel
    selection's op groups (an op with the epilogue its library call absorbs)."""
    return [LIBRARY_DISPATCH[lib.name](grouping, spec.runs_here())
            for lib in spec.libraries if lib.name in LIBRARY_DISPATCH]


def layout_passes(spec: TargetSpec) -> list[tvm.transform.Pass]:
    """For this machine's CPU with the CPU library, `BlockedLayout` (CNN regions in NCHW{B}c
    for its blocked kernels, B this CPU's vector width; not for a cross-compiled CPU, whose
    vector width this machine does not know); nothing for other targets."""
    return [BlockedLayout()] if CPU_LIBRARY in spec.libraries and spec.runs_here() else []


def library_passes(spec: TargetSpec) -> list[tvm.transform.Pass]:
    """`dispatch_passes`, `ConcatInPlace` on this machine's CPU with the CPU library, then fast
    math and transposed-matmul kernels where the spec asks (after `layout_passes` and kernel
    selection)."""
    return [
        *dispatch_passes(spec),
        *([ConcatInPlace()] if CPU_LIBRARY in spec.libraries and spec.runs_here() else []),
        *([relax.transform.FastMathTransform(), fast_activations] if spec.fast_math else []),
        *([transposed_matmul_kernels] if spec.transposed_matmul_kernels else []),
    ]
