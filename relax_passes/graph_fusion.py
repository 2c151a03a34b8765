"""Graph-level fusion rewrites run on the imported Relax graph, before placement and
legalization (see `gimlet_tvm.compiler.fusion_passes`).

`graph_fusion_disabled()` builds without them and without the epilogue fusion of the CPU
library dispatch (the "before" side of benchmarks/fusion.py).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import tvm

from .fuse_attention import FuseAttention
from .fuse_gelu import FuseGELU
from .fuse_normalization import FuseNormalization
from .fuse_silu import FuseSiLU

_state = threading.local()


@contextlib.contextmanager
def graph_fusion_disabled() -> Iterator[None]:
    """Within this block (on this thread), `graph_fusion_passes()` is empty and library calls
    get no epilogues."""
    previous = getattr(_state, "disabled", False)
    _state.disabled = True
    try:
        yield
    finally:
        _state.disabled = previous


def graph_fusion_enabled() -> bool:
    """False within `graph_fusion_disabled()`."""
    return not getattr(_state, "disabled", False)


def graph_fusion_passes() -> list[tvm.transform.Pass]:
    """The rewrites, in order: each recognises a written-out pattern and replaces it with one
    fused op (see each pass's docstring)."""
    if not graph_fusion_enabled():
        return []
    return [FuseNormalization(), FuseGELU(), FuseSiLU(), FuseAttention()]


def count_kernel_launches(mod: tvm.IRModule) -> int:
    """Kernels `main` launches per run: its `call_tir` and `call_dps_packed` calls (after
    `gimlet_tvm.compiler.fusion_passes`, each TIR function is one kernel)."""
    ops = {tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.call_dps_packed")}
    calls = []
    tvm.relax.analysis.post_order_visit(
        mod["main"], lambda e: calls.append(e) if isinstance(e, tvm.relax.Call) and e.op in ops else None
    )
    return len(calls)
