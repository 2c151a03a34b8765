"""TVM library kernels that are wrong on Vulkan devices, replaced in a module before its
pipeline (`TargetSpec.fix_library_kernels`).

`tir_attention_merge_state` (TVM's paged KV cache, `_merge_state_inplace`: merges two partial
attention results and their log-sum-exps, `V, S <- merge(V, S, V_other, S_other)`, in place)
races: the `head_dim / 4` threads of a head all read `S[n, h]`, then all write it, with no
barrier between. The result is right only where those threads run in lockstep, as a CUDA warp
does for `head_dim <= 128`. A Vulkan workgroup runs in subgroups that need not be in step
(lavapipe's are 8 invocations): from `head_dim = 64` on, a later subgroup reads the merged `S`
and merges again. The KV cache merges whenever attention is split: a prefill onto cached
tokens (the cached pages, then the new tokens) and a decode of a forked or imported sequence
(the shared prefix, then its own tokens). `merge_state_inplace` computes the same with a
barrier between the reads of `S` and its write.
"""

from __future__ import annotations

import tvm
from tvm.script import tirx as T

MERGE_STATE = "tir_attention_merge_state"
THREADS = 32  # per (position, head): each thread merges every THREADS-th element of the head


def merge_state_inplace(dtype: str) -> tvm.tirx.PrimFunc:
    """TVM's `_merge_state_inplace` without its race: one workgroup per (position, head),
    `S` and `S_other` read into registers, a workgroup barrier, then `V` and `S` written."""

    @T.prim_func(s_tir=True)
    def merge_state(v: T.handle, s: T.handle, v_other: T.handle, s_other: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        N, H, D = T.int32(), T.int32(), T.int32()
        V = T.match_buffer(v, (N, H, D), dtype)
        S = T.match_buffer(s, (N, H), "float32")
        V_other = T.match_buffer(v_other, (N, H, D), dtype)
        S_other = T.match_buffer(s_other, (N, H), "float32")
        for n in T.thread_binding(N, thread="blockIdx.x"):
            for h in T.thread_binding(H, thread="blockIdx.y"):
                for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                    with T.sblock("merge"):
                        T.reads(S[n, h], S_other[n, h], V[n, h, 0:D], V_other[n, h, 0:D])
                        T.writes(V[n, h, 0:D], S[n, h])
                        s_max = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        s_sum = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        scale = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        scale_other = T.sblock_alloc_buffer((1,), "float32", scope="local")
                        s_max[0] = T.max(S[n, h], S_other[n, h])
                        s_sum[0] = T.exp2(S[n, h] - s_max[0]) + T.exp2(S_other[n, h] - s_max[0])
                        scale[0] = T.exp2(S[n, h] - s_max[0]) / s_sum[0]
                        scale_other[0] = T.exp2(S_other[n, h] - s_max[0]) / s_sum[0]
                        # Every thread has read S[n, h] before any writes it ("global": the
                        # printer's workgroup barrier that orders storage buffer accesses).
                        T.tvm_storage_sync("global")
                        for i in T.serial(T.ceildiv(D, THREADS)):
                            if i * THREADS + tx < D:
                                V[n, h, i * THREADS + tx] = T.Cast(
                                    dtype,
                                    T.Cast("float32", V[n, h, i * THREADS + tx]) * scale[0]
                                    + T.Cast("float32", V_other[n, h, i * THREADS + tx]) * scale_other[0])
                        if tx == 0:
                            S[n, h] = T.log2(s_sum[0]) + s_max[0]

    return merge_state


def fix_library_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with TVM's racing merge kernel (see the module docstring) replaced by ours, for
    the element type it was built for; `mod` itself as it is when it has none."""
    for gv, func in mod.functions.items():
        if gv.name_hint == MERGE_STATE and isinstance(func, tvm.tirx.PrimFunc):
            fixed = mod.clone()
            fixed.update_func(gv, merge_state_inplace(str(func.params[0].ty.dtype))
                              .with_attr("global_symbol", MERGE_STATE))
            return fixed
    return mod
