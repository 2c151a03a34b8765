"""Kernel selection for a language model: `select_llm_kernels`.

The architecture's module (`compile.llm_module`, as `compile_llm` builds it) goes through
`select_kernels` like an imported model: its op groups with static shapes get every source's
candidates, verified and timed, and a kernel generator's where one is given. In a quantized
LLM on a CPU those are the decode GEMVs (`dequant_gemv`, one per linear layer shape: the
fused query/key/value, output, gate/up and down projections and the output head), rows-generic
so that one kernel serves any batch of sequences; prefill's matrix products have a symbolic
token count and are left to the default build. The selection is stored in the records
directory, which `compile_llm(records=DIR)` and `load(..., records=DIR)` apply.
"""

from __future__ import annotations

import os
from typing import Callable

from ..compiler import resolve_target
from ..schedules.kernel_selection.choices import KernelSelection
from ..selection.generator import Generator
from ..selection.select import select_kernels
from ..targets import DEFAULT_TARGET, TargetLike
from .compile import llm_module
from .weights import open_checkpoint


def select_llm_kernels(path: str | os.PathLike, target: TargetLike = DEFAULT_TARGET, quantization: str | None = "q8",
                       *, records: str | os.PathLike, generator: Generator | None = None, timeout: float = 120.0,
                       progress: Callable[[str], None] | None = None) -> KernelSelection:
    """Choose the kernels of the model at `path` (an HF folder or a GGUF file; only its
    architecture matters) compiled for `target` with `quantization`, with `generator`'s
    candidates where one is given, and store the choice in `records` (returned)."""
    config = open_checkpoint(path).config
    _, tvm_target = resolve_target(target)
    mod, _ = llm_module(config, tvm_target, quantization)
    selection = select_kernels(mod, tvm_target, records=os.fspath(records), timeout=timeout, progress=progress,
                               generator=generator)
    selection.save(records)
    return selection
