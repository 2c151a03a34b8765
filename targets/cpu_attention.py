"""The paged KV cache's attention kernels for CPUs, in place of TVM's (`TargetSpec.
fix_library_kernels` of the llvm target: the pipeline's first step).

TVM's CPU kernels (`_attention_decode_cpu`, `_attention_prefill_cpu`,
`_attention_prefill_ragged_cpu` in `tvm.relax.frontend.nn.llm`) are scalar loops on one core,
and the paged prefill kernel walks every page slot of the whole cache (`max_num_pages *
page_size` rows, 8192 for an 8192-token cache) for each query row, whatever the sequence's
length: scoring 5 draft tokens against a 150-token sequence took 26 ms of attention in
SmolLM2-135M, more than its matrix products (benchmarks/README.md, Speculative decoding). It
also scales the output by `scale_O[d]`, a one-element buffer read past its end.

These kernels compute the same (the same online softmax in base 2, the same log-sum-exp output
for merging partial results, the same masks) with the (query row, query head) pairs split
across the cores, only the rows a query can see visited, and the head dimension in vectors.
The sliding-window variants are not replaced (no family here uses them).
"""

from __future__ import annotations

import math

import tvm
from tvm.script import tirx as T

# The names TVM's KV cache gives its CPU kernels in the module (their global symbols).
DECODE = "batch_decode_paged_kv_cpu"
PREFILL = "batch_prefill_paged_kv_cpu"
PREFILL_RAGGED = "batch_prefill_ragged_kv"
LOG2_E = math.log2(math.exp(1))
LANES = 8  # partial sums of a dot product
INLINE_ROPE = ("gimlet's CPU attention kernels take keys and queries with RoPE applied already "
               "(RopeMode.NORMAL or NONE), not RopeMode.INLINE")


def _kernels(head_dim: int, dtype: str, group_size: int, page_size: int = 0):
    """The macros the three kernels share, for one head size and element type."""
    d = head_dim

    @T.macro
    def start(o_acc, m_val, d_val):
        for i in T.vectorized(d):
            o_acc[i] = T.float32(0)
        m_val[0] = T.float32(-5e4)
        d_val[0] = T.float32(1)

    @T.macro
    def add_key(q_row, k_row, v_row, o_acc, m_val, d_val, part, sm_scale):
        # s = q . k, as LANES partial sums then a scalar tree
        for i in T.vectorized(LANES):
            part[i] = T.float32(0)
        for c in T.serial(d // LANES):
            for i in T.vectorized(LANES):
                part[i] = part[i] + q_row[c * LANES + i] * k_row[c * LANES + i]
        for i in T.serial(d % LANES):
            part[0] = part[0] + q_row[d - d % LANES + i] * k_row[d - d % LANES + i]
        s: T.let[T.float32] = ((part[0] + part[4]) + (part[2] + part[6])) + (
            (part[1] + part[5]) + (part[3] + part[7]))
        s_log2: T.let[T.float32] = s * sm_scale * T.float32(LOG2_E)
        m_new: T.let[T.float32] = T.max(m_val[0], s_log2)
        scale: T.let[T.float32] = T.exp2(m_val[0] - m_new)
        p: T.let[T.float32] = T.exp2(s_log2 - m_new)
        d_val[0] = d_val[0] * scale + p
        m_val[0] = m_new
        for i in T.vectorized(d):
            o_acc[i] = o_acc[i] * scale + v_row[i] * p

    @T.macro
    def finish(o_acc, m_val, d_val, output, lse, row, head):
        for i in T.vectorized(d):
            output[row, head, i] = T.Cast(dtype, o_acc[i] / d_val[0])
        lse[row, head] = m_val[0] + T.log2(d_val[0])

    @T.macro
    def load_query(q_row, q, row, head):
        for i in T.vectorized(d):
            q_row[i] = T.Cast("float32", q[row, head, i])

    @T.macro
    def load_paged(k_row, v_row, key, head, pages, page_values, first):
        # the sequence's key `key` from its pages, its page numbers from page_values[first]
        page: T.let[T.int32] = page_values[first + key // page_size]
        for i in T.vectorized(d):
            k_row[i] = T.Cast("float32", pages[page, 0, head // group_size, key % page_size, i])
        for i in T.vectorized(d):
            v_row[i] = T.Cast("float32", pages[page, 1, head // group_size, key % page_size, i])

    @T.macro
    def attend(q, row, head, visible, load_key_value, kv_source, output, lse, sm_scale):
        # query row `row`, head `head` against keys 0..visible-1, which `load_key_value` reads
        # from `kv_source` (the kernel's buffers and offset it needs)
        q_row = T.decl_buffer((d,), "float32")
        k_row = T.decl_buffer((d,), "float32")
        v_row = T.decl_buffer((d,), "float32")
        o_acc = T.decl_buffer((d,), "float32")
        part = T.decl_buffer((LANES,), "float32")
        m_val = T.decl_buffer((1,), "float32")
        d_val = T.decl_buffer((1,), "float32")
        start(o_acc, m_val, d_val)
        load_query(q_row, q, row, head)
        for key in T.serial(visible):
            load_key_value(k_row, v_row, key, head, kv_source[0], kv_source[1], kv_source[2])
            add_key(q_row, k_row, v_row, o_acc, m_val, d_val, part, sm_scale)
        finish(o_acc, m_val, d_val, output, lse, row, head)

    return attend, load_paged


def decode_kernel(h_kv: int, h_q: int, d: int, dtype: str, page_size: int) -> tvm.tirx.PrimFunc:
    """Attention of one new token per sequence over its pages (TVM's `batch_decode_paged_kv`
    arguments); one task per (sequence, query head)."""
    group_size = h_q // h_kv
    attend, load_paged = _kernels(d, dtype, group_size, page_size)

    @T.prim_func(s_tir=True)
    def batch_decode_paged_kv(
        Q_handle: T.handle, pages_handle: T.handle, page_indptr_handle: T.handle,
        page_values_handle: T.handle, var_length_info: T.handle,
        k_rope_pos_offset_handle: T.handle, q_rope_position_handle: T.handle,
        output_handle: T.handle, lse_handle: T.handle, rotary_mode: T.int32,
        rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True})
        B, nnz_pages, max_num_pages = T.int32(), T.int32(), T.int32()
        indptr_offset, values_offset, k_rope_offset, q_rope_offset, length_offset = (
            T.int32(), T.int32(), T.int32(), T.int32(), T.int32())
        Q = T.match_buffer(Q_handle, (B, h_q, d), dtype)
        pages = T.match_buffer(pages_handle, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(page_indptr_handle, (B + 1,), "int32", elem_offset=indptr_offset)
        page_values = T.match_buffer(page_values_handle, (nnz_pages,), "int32", elem_offset=values_offset)
        length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=length_offset)
        k_rope_pos_offset = T.match_buffer(k_rope_pos_offset_handle, (B,), "int32", elem_offset=k_rope_offset)
        q_rope_position = T.match_buffer(q_rope_position_handle, (B,), "int32", elem_offset=q_rope_offset)
        output = T.match_buffer(output_handle, (B, h_q, d), dtype)
        lse = T.match_buffer(lse_handle, (B, h_q), "float32")
        assert rotary_mode == 0, INLINE_ROPE
        for task in T.parallel(B * h_q):
            b: T.let[T.int32] = task // h_q
            h: T.let[T.int32] = task % h_q
            first: T.let[T.int32] = page_indptr[b]
            num_pages: T.let[T.int32] = page_indptr[b + 1] - first
            kv_len: T.let[T.int32] = T.if_then_else(num_pages > 0, (num_pages - 1) * page_size + length_info[b], 0)
            attend(Q, b, h, kv_len, load_paged, (pages, page_values, first), output, lse, sm_scale)

    return batch_decode_paged_kv


def prefill_kernel(h_kv: int, h_q: int, d: int, dtype: str, page_size: int) -> tvm.tirx.PrimFunc:
    """Attention of a chunk of new tokens per sequence over the sequence's pages (TVM's
    `batch_prefill_paged_kv_cpu` arguments); one task per (query row, query head)."""
    group_size = h_q // h_kv
    attend, load_paged = _kernels(d, dtype, group_size, page_size)

    @T.prim_func(s_tir=True)
    def batch_prefill_paged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
        var_page_values: T.handle, var_length_info: T.handle, var_k_rope_pos_offset: T.handle,
        var_q_rope_position: T.handle, var_output: T.handle, var_lse: T.handle,
        causal: T.int32, rotary_mode: T.int32, rope_scale: T.float32, rope_theta: T.float32,
        sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True})
        batch_size, total_len, nnz_pages, max_num_pages = T.int32(), T.int32(), T.int32(), T.int32()
        q_indptr_offset, indptr_offset, values_offset, k_rope_offset, q_rope_offset, length_offset = (
            T.int32(), T.int32(), T.int32(), T.int32(), T.int32(), T.int32())
        q = T.match_buffer(var_q, (total_len, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        pages = T.match_buffer(var_pages, (max_num_pages, 2, h_kv, page_size, d), dtype)
        page_indptr = T.match_buffer(var_page_indptr, (batch_size + 1,), "int32", elem_offset=indptr_offset)
        page_values = T.match_buffer(var_page_values, (nnz_pages,), "int32", elem_offset=values_offset)
        length_info = T.match_buffer(var_length_info, (batch_size,), "int32", elem_offset=length_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (total_len,), "int32", elem_offset=q_rope_offset)
        output = T.match_buffer(var_output, (total_len, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (total_len, h_q), "float32")
        assert rotary_mode == 0, INLINE_ROPE
        for b in T.serial(batch_size):
            first: T.let[T.int32] = page_indptr[b]
            num_pages: T.let[T.int32] = page_indptr[b + 1] - first
            kv_len: T.let[T.int32] = T.if_then_else(num_pages > 0, (num_pages - 1) * page_size + length_info[b], 0)
            qo_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
            for task in T.parallel(qo_len * h_q):
                row: T.let[T.int32] = q_indptr[b] + task // h_q
                h: T.let[T.int32] = task % h_q
                visible: T.let[T.int32] = T.if_then_else(
                    causal > 0, T.max(T.min(kv_len, kv_len - qo_len + task // h_q + 1), 0), kv_len)
                attend(q, row, h, visible, load_paged, (pages, page_values, first), output, lse, sm_scale)

    return batch_prefill_paged_kv


def prefill_ragged_kernel(h_kv: int, h_q: int, d: int, dtype: str) -> tvm.tirx.PrimFunc:
    """Attention of a chunk of new tokens over the same chunk's keys and values, not yet in
    pages (TVM's `batch_prefill_ragged_kv` arguments); one task per (query row, query head)."""
    group_size = h_q // h_kv
    attend, _ = _kernels(d, dtype, group_size)

    @T.macro
    def load_rows(k_row, v_row, key, head, k, v, kv_first):
        # the chunk's key `key`, the sequence's first at kv_first
        for i in T.vectorized(d):
            k_row[i] = T.Cast("float32", k[kv_first + key, head // group_size, i])
        for i in T.vectorized(d):
            v_row[i] = T.Cast("float32", v[kv_first + key, head // group_size, i])

    @T.prim_func(s_tir=True)
    def batch_prefill_ragged_kv(
        var_q: T.handle, var_q_indptr: T.handle, var_k: T.handle, var_v: T.handle,
        var_kv_indptr: T.handle, var_q_rope_position: T.handle, var_k_rope_pos_offset: T.handle,
        var_output: T.handle, var_lse: T.handle, causal: T.int32, rotary_mode: T.int32,
        rope_scale: T.float32, rope_theta: T.float32, sm_scale: T.float32,
    ):
        T.func_attr({"tirx.is_scheduled": True})
        batch_size, qo_total, kv_total = T.int32(), T.int32(), T.int32()
        q_indptr_offset, kv_indptr_offset, q_rope_offset, k_rope_offset = (
            T.int32(), T.int32(), T.int32(), T.int32())
        q = T.match_buffer(var_q, (qo_total, h_q, d), dtype)
        q_indptr = T.match_buffer(var_q_indptr, (batch_size + 1,), "int32", elem_offset=q_indptr_offset)
        k = T.match_buffer(var_k, (kv_total, h_kv, d), dtype)
        v = T.match_buffer(var_v, (kv_total, h_kv, d), dtype)
        kv_indptr = T.match_buffer(var_kv_indptr, (batch_size + 1,), "int32", elem_offset=kv_indptr_offset)
        q_rope_position = T.match_buffer(var_q_rope_position, (qo_total,), "int32", elem_offset=q_rope_offset)
        k_rope_pos_offset = T.match_buffer(var_k_rope_pos_offset, (batch_size,), "int32", elem_offset=k_rope_offset)
        output = T.match_buffer(var_output, (qo_total, h_q, d), dtype)
        lse = T.match_buffer(var_lse, (qo_total, h_q), "float32")
        assert rotary_mode == 0, INLINE_ROPE
        for b in T.serial(batch_size):
            kv_first: T.let[T.int32] = kv_indptr[b]
            kv_len: T.let[T.int32] = kv_indptr[b + 1] - kv_first
            qo_len: T.let[T.int32] = q_indptr[b + 1] - q_indptr[b]
            for task in T.parallel(qo_len * h_q):
                row: T.let[T.int32] = q_indptr[b] + task // h_q
                h: T.let[T.int32] = task % h_q
                visible: T.let[T.int32] = T.if_then_else(
                    causal > 0, T.max(T.min(kv_len, kv_len - qo_len + task // h_q + 1), 0), kv_len)
                attend(q, row, h, visible, load_rows, (k, v, kv_first), output, lse, sm_scale)

    return batch_prefill_ragged_kv


def _shape(func: tvm.tirx.PrimFunc, param: int) -> tuple[int | None, ...]:
    """The shape of a kernel's buffer parameter (None for symbolic dimensions)."""
    return tuple(int(x) if isinstance(x, tvm.tirx.IntImm) else None for x in func.params[param].ty.shape)


def _replacement(name: str, func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc | None:
    """Ours for TVM's kernel `name`, with the head counts, head size, element type and page
    size read from its buffers; None where we have none (MLA's unequal key and value sizes)."""
    dtype = str(func.params[0].ty.dtype)
    _, h_q, d = _shape(func, 0)
    if name == DECODE:
        _, _, h_kv, page_size, _ = _shape(func, 1)
        return decode_kernel(h_kv, h_q, d, dtype, page_size)
    if name == PREFILL:
        _, _, h_kv, page_size, _ = _shape(func, 2)
        return prefill_kernel(h_kv, h_q, d, dtype, page_size)
    _, h_kv, d_k = _shape(func, 2)
    if d_k != d or _shape(func, 3)[2] != d:
        return None
    return prefill_ragged_kernel(h_kv, h_q, d, dtype)


def replace_attention_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """`mod` with TVM's CPU attention kernels for the paged KV cache (found by the names the
    cache gives them) replaced by these; `mod` itself when it has none."""
    replaced = mod
    for gv, func in mod.functions.items():
        if gv.name_hint in (DECODE, PREFILL, PREFILL_RAGGED) and isinstance(func, tvm.tirx.PrimFunc):
            ours = _replacement(gv.name_hint, func)
            if ours is not None:
                replaced = replaced.clone() if replaced is mod else replaced
                replaced.update_func(gv, ours.with_attr("global_symbol", gv.name_hint))
    return replaced
