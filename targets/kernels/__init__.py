"""Hand-written kernels kept in the repository: `HandwrittenKernel` describes one; the kernels
themselves are one module each (`cpu_gemm`, `cuda_gemm`), listed by the targets that have them
(`TargetSpec.handwritten_kernels`)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Callable

import tvm

from ...runtime.extensions import cache_dir

Shape = tuple[int, ...]
Step = tuple[str, Shape]
"""An epilogue step: `("add", addend shape)`, `("relu", ())` or `("gelu", ())`."""
STEP_ACTIVATIONS = ("relu", "gelu")
"""The activations a step may be: what the candidates, references and kernel generators
implement. A library call with another one in its epilogue (the CPU library's SiLU, sigmoid)
is no op group."""

MAX_ADDENDS = 2  # epilogue adds a kernel takes (bias and residual of a transformer layer)


@dataclasses.dataclass(frozen=True)
class HandwrittenKernel:
    """`make(target, M, N, K, epilogue, addends)`: the PrimFunc `(a[M, K], b[K, N], addends...,
    c[M, N])` for one GEMM shape and epilogue (`OpSignature.epilogue`, `.addends_2d()`) on
    `target`; a kernel that does not `fuses_epilogue` is only asked for groups without one.
    `packed_b(target, N, K)`: for a kernel that takes B packed (only offered where B is a
    constant weight, so the packing is folded at build time), the packed shape; B[K, N] is
    padded to it along N and laid out as [panels, K, panel width]."""

    name: str
    op: str
    make: Callable[..., tvm.tirx.PrimFunc]
    file: str
    fuses_epilogue: bool
    packed_b: Callable[[tvm.target.Target, int, int], tuple[int, int, int]] | None = None

    def prim_func(self, target: tvm.target.Target, m: int, n: int, k: int,
                  epilogue: tuple[Step, ...], addends: list[tuple[int, int]]) -> tvm.tirx.PrimFunc:
        """`make`'s PrimFunc, made once per target, shape and epilogue in a process and kept
        on disk (`_made`): parsing the TVMScript takes about a second, a default build makes
        one per distinct layer, and a cold timing builds 64 copies of one group."""
        return _made(self, str(target), m, n, k, tuple(epilogue), tuple(addends))


@functools.lru_cache(maxsize=256)
def _made(kernel: HandwrittenKernel, target_json: str, m: int, n: int, k: int,
          epilogue: tuple[Step, ...], addends: tuple[tuple[int, int], ...]) -> tvm.tirx.PrimFunc:
    """`kernel.make` on hashable arguments (the target as its JSON text), read from the cache
    directory where an earlier process made it: keyed by the arguments, the TVM version and
    the source of the kernel's file and of the module defining `make`."""
    sources = sorted({kernel.file, inspect.getsourcefile(kernel.make) or ""})
    key = hashlib.sha256(json.dumps([kernel.name, target_json, m, n, k, epilogue, addends, tvm.__version__,
                                     *(Path(path).read_text() for path in sources if path)]).encode())
    path = cache_dir() / "handwritten" / f"{kernel.name}-{key.hexdigest()[:32]}.json"
    if path.is_file():
        try:
            return tvm.ir.load_json(path.read_text())
        except (OSError, ValueError):  # unreadable or damaged: made again and rewritten
            pass
    func = kernel.make(tvm.target.Target(json.loads(target_json)), m, n, k, epilogue, list(addends))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(tvm.ir.save_json(func))
    os.replace(tmp, path)  # whole or not at all, for processes building at once
    return func
