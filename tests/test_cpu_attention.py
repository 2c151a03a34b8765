"""Our CPU attention kernels for the paged KV cache (targets/cpu_attention.py) against TVM's,
which they replace: same outputs and log-sum-exps on random caches (sequences of several pages,
one token, none), with and without the causal mask."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.relax.frontend.nn.llm import kv_cache

from gimlet_tvm.targets import cpu_attention
from gimlet_tvm.targets.llvm import LLVM_CPU

H_KV, H_Q, D, PAGE = 2, 6, 40, 16  # a head size that is not a multiple of the vector width
SM_SCALE = 0.15


def build(func: tvm.tirx.PrimFunc):
    target = LLVM_CPU.make_target()
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]


def tensor(array, dtype: str | None = None) -> tvm.runtime.Tensor:
    return tvm.runtime.tensor(np.asarray(array, dtype=dtype) if dtype else array)


class Cache:
    """Random pages and the page table of sequences of the given lengths (pages shuffled)."""

    def __init__(self, lengths: list[int], seed: int = 0):
        rng = np.random.default_rng(seed)
        self.rng, self.lengths = rng, lengths
        total_pages = sum(-(-n // PAGE) for n in lengths) + 3
        self.pages = rng.standard_normal((total_pages, 2, H_KV, PAGE, D), dtype=np.float32)
        order = rng.permutation(total_pages)
        self.indptr, self.values, self.last = [0], [], []
        for n in lengths:
            count = -(-n // PAGE)
            self.values += [int(p) for p in order[len(self.values):len(self.values) + count]]
            self.indptr.append(len(self.values))
            self.last.append(n - (count - 1) * PAGE if count else 0)

    def table(self) -> list[tvm.runtime.Tensor]:
        return [tensor(self.pages), tensor(self.indptr, "int32"), tensor(self.values, "int32"),
                tensor(self.last, "int32")]


def outputs(kernel, args: list, rows: int) -> tuple[np.ndarray, np.ndarray]:
    out, lse = tensor(np.zeros((rows, H_Q, D), np.float32)), tensor(np.zeros((rows, H_Q), np.float32))
    kernel(*args[:-1], out, lse, *args[-1])
    return out.numpy(), lse.numpy()


def assert_same(ours, theirs, rows_with_keys: np.ndarray) -> None:
    np.testing.assert_allclose(ours[0][rows_with_keys], theirs[0][rows_with_keys], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours[1][rows_with_keys], theirs[1][rows_with_keys], rtol=1e-5, atol=1e-5)


def test_decode_matches_tvm() -> None:
    cache = Cache([150, 1, 17, 0, 33])
    batch = len(cache.lengths)
    q = cache.rng.standard_normal((batch, H_Q, D), dtype=np.float32)
    zeros = tensor(np.zeros(batch), "int32")
    args = [tensor(q), *cache.table(), zeros, tensor(cache.lengths, "int32"), (0, 1.0, 1e4, SM_SCALE)]
    ours = outputs(build(cpu_attention.decode_kernel(H_KV, H_Q, D, "float32", PAGE)), args, batch)
    theirs = outputs(build(kv_cache._attention_decode_cpu(H_KV, H_Q, D, "float32", False, {})), args, batch)
    assert_same(ours, theirs, np.array(cache.lengths) > 0)
    assert np.all(ours[0][3] == 0) and np.all(ours[1][3] == -5e4)  # no keys: merged away


@pytest.mark.parametrize("causal", [0, 1])
def test_paged_prefill_matches_tvm(causal: int) -> None:
    cache = Cache([150, 5, 20])
    q_lengths = [5, 5, 3]
    q_indptr = np.concatenate([[0], np.cumsum(q_lengths)]).astype("int32")
    q = cache.rng.standard_normal((int(q_indptr[-1]), H_Q, D), dtype=np.float32)
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(cache.lengths, q_lengths)])
    pages, indptr, values, last = cache.table()
    args = [tensor(q), tensor(q_indptr), pages, indptr, values, last, tensor(np.zeros(3), "int32"),
            tensor(positions, "int32"), (causal, 0, 1.0, 1e4, SM_SCALE)]
    rows = int(q_indptr[-1])
    ours = outputs(build(cpu_attention.prefill_kernel(H_KV, H_Q, D, "float32", PAGE)), args, rows)
    theirs = outputs(build(kv_cache._attention_prefill_cpu(H_KV, H_Q, D, "float32", False, {})), args, rows)
    assert_same(ours, theirs, np.ones(rows, bool))


@pytest.mark.parametrize("causal", [0, 1])
def test_ragged_prefill_matches_tvm(causal: int) -> None:
    rng = np.random.default_rng(1)
    lengths = [7, 1, 12]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype("int32")
    rows = int(indptr[-1])
    q, k, v = (rng.standard_normal((rows, heads, D), dtype=np.float32) for heads in (H_Q, H_KV, H_KV))
    positions = np.concatenate([np.arange(n) for n in lengths])
    args = [tensor(q), tensor(indptr), tensor(k), tensor(v), tensor(indptr), tensor(positions, "int32"),
            tensor(np.zeros(3), "int32"), (causal, 0, 1.0, 1e4, SM_SCALE)]
    ours = outputs(build(cpu_attention.prefill_ragged_kernel(H_KV, H_Q, D, "float32")), args, rows)
    theirs = outputs(build(kv_cache._attention_prefill_ragged_cpu(H_KV, H_Q, D, D, "float32", {})), args, rows)
    assert_same(ours, theirs, np.ones(rows, bool))


def test_inline_rope_is_refused() -> None:
    """Keys and queries must come with RoPE applied (what every family here asks the cache for)."""
    cache = Cache([3])
    args = [tensor(np.zeros((1, H_Q, D), np.float32)), *cache.table(), tensor([0], "int32"),
            tensor([3], "int32"), (1, 1.0, 1e4, SM_SCALE)]
    with pytest.raises(Exception, match="RopeMode.INLINE"):
        outputs(build(cpu_attention.decode_kernel(H_KV, H_Q, D, "float32", PAGE)), args, 1)


def test_the_llvm_target_replaces_tvms_kernels() -> None:
    """The llvm spec swaps the kernels TVM's KV cache adds to a module (found by name), sized
    from the replaced kernels' buffers."""
    mod = tvm.IRModule({
        cpu_attention.DECODE: kv_cache._attention_decode_cpu(H_KV, H_Q, D, "float32", False, {}),
        cpu_attention.PREFILL: kv_cache._attention_prefill_cpu(H_KV, H_Q, D, "float32", False, {}),
        cpu_attention.PREFILL_RAGGED: kv_cache._attention_prefill_ragged_cpu(H_KV, H_Q, D, D, "float32", {}),
    })
    replaced = LLVM_CPU.fix_library_kernels(mod)
    for name in (cpu_attention.DECODE, cpu_attention.PREFILL, cpu_attention.PREFILL_RAGGED):
        script = replaced[name].script()
        assert "T.parallel" in script and "RopeMode.INLINE" in script, name
        assert replaced[name].attrs["global_symbol"] == name
    assert "T.parallel" not in mod[cpu_attention.DECODE].script()  # the input is left as it was
