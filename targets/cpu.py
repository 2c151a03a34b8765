"""What CPU targets share: vector registers from LLVM's feature tables, cores, a roofline, the
hand-written CPU kernels (sized to the target's vector registers) and the rule that picks one
of them for untuned builds (`cpu_default_kernel`)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import tvm

from .kernels import HandwrittenKernel
from .kernels.cpu_gemm import cpu_gemm, cpu_gemv, packed_shape
from .spec import OpGroup, PerfFacts

# Main-memory bandwidth one socket's share of DDR4/DDR5 channels gives a few cores: an estimate.
HOST_MEMORY_GBPS = 20.0
DEFAULT_CLOCK_GHZ = 2.5

# Vector register width (bits) and count implied by the LLVM CPU features we recognise, widest
# first.
_VECTOR_REGISTERS = (("avx512f", 512, 32), ("avx2", 256, 16), ("avx", 256, 16), ("sse2", 128, 16),
                     ("neon", 128, 32))


def num_cores() -> int:
    """The cores this process may run on (`TVM_NUM_THREADS` when set)."""
    if "TVM_NUM_THREADS" in os.environ:
        return int(os.environ["TVM_NUM_THREADS"])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


CPU = tuple[tuple[str, str], ...]
"""The kind, CPU model and triple of an LLVM target, as hashable pairs (the cache's key)."""


@functools.lru_cache(maxsize=None)
def _vector_registers(cpu: CPU) -> tuple[int, int]:
    target = tvm.target.Target(dict(cpu))
    features = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target)}
    return next(((bits, count) for feature, bits, count in _VECTOR_REGISTERS if feature in features), (128, 16))


def cpu_features(target: tvm.target.Target) -> list[str]:
    """The LLVM features of a CPU target's CPU model (`avx2`, `fma`, `neon`, ...), sorted."""
    return sorted(str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target))


def _cpu(target: tvm.target.Target | dict) -> CPU:
    attrs = dict(target.export()) if isinstance(target, tvm.target.Target) else dict(target)
    return tuple((key, str(attrs[key])) for key in ("kind", "mcpu", "mtriple") if key in attrs)


def vector_bits(target: tvm.target.Target | dict) -> int:
    """Widest vector width (bits) the target's CPU model has (128 when none is recognised)."""
    return _vector_registers(_cpu(target))[0]


def vector_registers(target: tvm.target.Target | dict) -> int:
    """How many of those vector registers it has (AVX-512 and NEON 32, AVX2 16)."""
    return _vector_registers(_cpu(target))[1]


def _clock_ghz() -> float:
    """The CPU clock the kernel reports (first core), else a typical one."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = next(line for line in f if line.startswith("cpu MHz"))
        return float(mhz.split(":")[1]) / 1000
    except (OSError, StopIteration, ValueError):
        return DEFAULT_CLOCK_GHZ


def cpu_perf(target: dict) -> PerfFacts:
    """Roofline of a CPU: cores x fp32 lanes x 2 (FMA) x 2 FMA ports x clock."""
    lanes = vector_bits(target) // 32
    peak = num_cores() * lanes * 2 * 2 * _clock_ghz()
    return PerfFacts(peak_gflops=peak, memory_gbps=HOST_MEMORY_GBPS, launch_us=1, link_gbps=None,
                     copy_us=0)


def _cores(target: tvm.target.Target) -> int:
    return int(target.attrs.get("num-cores", 1))


def _two_vectors(target: tvm.target.Target) -> int:
    """Panel width of the CPU GEMMs: two of the target's float32 vectors."""
    return 2 * vector_bits(target) // 32


def _tallest_tile(target: tvm.target.Target) -> int:
    """Rows of the tallest mr x 2-vector tile the vector registers hold: 2 per row, plus 2 for
    B's vectors and 1 for the broadcast of A."""
    return (vector_registers(target) - 3) // 2


_CPU_GEMM_FILE = str(Path(__file__).resolve().parent / "kernels" / "cpu_gemm.py")


def _cpu_gemm(mr: int | None, packed: bool) -> HandwrittenKernel:
    """`cpu_gemm[_packed]_{mr}x2v`: tiles of at most mr x (2 vectors) (`cpu_gemm.cpu_gemm`);
    mr None: `_tallest_tile` (`cpu_gemm_packed_tallx2v`)."""
    return HandwrittenKernel(
        f"cpu_gemm{'_packed' if packed else ''}_{mr or 'tall'}x2v", "matmul",
        lambda target, *group: cpu_gemm(mr or _tallest_tile(target), _two_vectors(target), packed, *group),
        _CPU_GEMM_FILE, fuses_epilogue=True,
        packed_b=(lambda target, n, k: packed_shape(n, k, _two_vectors(target))) if packed else None,
    )


PACKED_TALL_GEMM = _cpu_gemm(None, packed=True)

CPU_KERNELS = (
    _cpu_gemm(6, packed=False),
    _cpu_gemm(4, packed=True),
    PACKED_TALL_GEMM,
    HandwrittenKernel("cpu_gemv_k4", "matmul", lambda target, *group: cpu_gemv(4, _cores(target), *group),
                      _CPU_GEMM_FILE, fuses_epilogue=True),
)


PACKED_GEMM_ROWS = (2, 512)
PACKED_GEMM_MIN_WEIGHT = 256 * 256
"""The linear layers the default build gives the packed GEMM: rows (M, batch axes folded in)
in `PACKED_GEMM_ROWS`, and a weight (K x N) of at least `PACKED_GEMM_MIN_WEIGHT` elements.
Every float32 matmul by a constant weight measured in that range ran faster on it than on
OpenBLAS, at 1 and 2 threads (the MLP at batch 8 and 32, BERT's and GPT-2's layers at 128
tokens, the suite's encoder at 64 and 512 rows, 4 and 16 rows by 4096x4096, 32 rows by
256x256: 0.2-0.9x the library's time). Outside it: at 1 row all ran at memory speed alike; on
small weights (64x96, 1024x10) the packed GEMM's tasks cost more than they save at 2 threads;
from 1024 rows by 1024 columns on, OpenBLAS, which blocks the rows, was faster
(benchmarks/gemm_defaults.py, results in benchmarks/README.md)."""


def cpu_default_kernel(target: tvm.target.Target, group: OpGroup) -> str | None:
    """The CPU's default kernel (`TargetSpec.default_kernel`): a float32 matmul by a constant
    weight of the size above runs on the packed GEMM with the tallest register tile (B packed
    once, at build time); anything else stays with the CPU library."""
    if group.op != "matmul" or group.dtype != "float32" or not group.weight:
        return None
    m, n, k = group.gemm
    low, high = PACKED_GEMM_ROWS
    return f"handwritten:{PACKED_TALL_GEMM.name}" if low <= m <= high and k * n >= PACKED_GEMM_MIN_WEIGHT else None
