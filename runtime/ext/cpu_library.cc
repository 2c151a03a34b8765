/*!
 * \file cpu_library.cc
 * \brief fp32 matmul, NCHW conv2d (both with fused elementwise epilogues) and BSNH attention on
 * OpenBLAS (scipy-openblas32), direct NCHW conv2d kernels (on blocks of output channels, on
 * vectors of a row's output pixels, depthwise; AVX2 or AVX-512, chosen at run time), direct and
 * depthwise kernels on channel-blocked NCHW{B}c data, and a Winograd conv2d, as TVM packed
 * functions.
 *
 * All functions use destination-passing style: inputs first, the output tensor last.
 * Tensors must be compact row-major float32 on the CPU.
 *
 * Threading: OpenBLAS always runs single-threaded, and the work is split across TVM's own
 * thread pool here (GEMM columns or rows, batches, conv2d output rows or pixels), so library
 * calls and generated kernels share one pool and never compete for cores. Measured on 2 Zen 4
 * cores, default build vs onnxruntime (2 threads), MLP / small ResNet / transformer layer:
 *   - OpenBLAS's own pthreads next to TVM's pool: 1.4x / 226x / 58x (the pools' spinning
 *     workers preempt each other, and changing OpenBLAS's thread count per call is slow);
 *   - OpenBLAS jobs on TVM's pool via scipy_openblas_set_threads_callback_function:
 *     7.8x / 90x / 3.3x (its jobs spin-wait for each other while TVM pins its threads);
 *   - single-threaded OpenBLAS, split here: 1.3-1.5x / 1.8-2.0x / 0.7-0.9x.
 */
#include <cblas.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/c_backend_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace gimlet {
namespace cpu {

namespace {

using tvm::ffi::PackedArgs;

void CheckCompactFloat32(const DLTensor* t, const char* name) {
  TVM_FFI_ICHECK(t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1)
      << "gimlet.cpu: " << name << " must be float32";
  TVM_FFI_ICHECK(t->device.device_type == kDLCPU) << "gimlet.cpu: " << name << " must be on CPU";
  if (t->strides == nullptr) return;
  int64_t expected = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    TVM_FFI_ICHECK(t->shape[i] == 1 || t->strides[i] == expected)
        << "gimlet.cpu: " << name << " must be compact";
    expected *= t->shape[i];
  }
}

float* Data(const DLTensor* t) {
  return reinterpret_cast<float*>(static_cast<char*>(t->data) + t->byte_offset);
}

int64_t Product(const int64_t* begin, const int64_t* end) {
  int64_t p = 1;
  for (const int64_t* it = begin; it != end; ++it) p *= *it;
  return p;
}

// ---------------------------------------------------------------------------------------------
// Vector math: exp and erf on 8 lanes with GCC's vector types (libm's expf and erff are scalar,
// and GCC does not vectorize a clamp followed by a float-to-int conversion on its own)

using Floats = float __attribute__((vector_size(32)));
using Ints = int32_t __attribute__((vector_size(32)));
constexpr int64_t kLanes = sizeof(Floats) / sizeof(float);
// 16 lanes: AVX-512's vectors (two halves on CPUs without it), the blocked kernels' L = 16.
using Floats16 = float __attribute__((vector_size(64)));
using Ints16 = int32_t __attribute__((vector_size(64)));

/*! \brief The int32 vector of a float vector's lanes (GCC drops a vector_size that depends on
 * a template argument, so each width is spelled out). */
template <typename V>
struct IntsOf;
template <>
struct IntsOf<Floats> {
  using Type = Ints;
};
template <>
struct IntsOf<Floats16> {
  using Type = Ints16;
};

/*! \brief max(v, lo) and min(v, hi) lane by lane, a NaN in v kept: one max / min instruction
 * each on x86 (`lo > v ? lo : v` is maxps's own definition). Written `v < lo ? lo : v`, GCC
 * emitted a compare and a masked move, two instructions on the FMA ports, for each bound of
 * every clip, ReLU and exp argument (a 3-channel stem's 27 taps a pixel take 27 multiply-adds
 * a vector, its bias, ReLU and clip then 5 more). In whole models no faster beyond the noise
 * (resnet_cnn 0.985-0.999 of its time, one process, alternating). */
template <typename V>
__attribute__((always_inline)) inline V AtLeast(V v, V lo) {
  return lo > v ? lo : v;
}
template <typename V>
__attribute__((always_inline)) inline V AtMost(V v, V hi) {
  return hi < v ? hi : v;
}

/*! \brief exp(x - n ln2) for the whole n nearest x log2 e (|x - n ln2| <= ln2 / 2): ln2 in
 * two parts (Cody and Waite), then Cephes' degree-7 polynomial. */
template <typename V>
inline V ExpOfRemainder(V x, V n) {
  const V f = x - n * 0.693359375f + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  return p * f * f + f + 1.0f;
}

/*!
 * \brief exp(x) for x <= 0 (softmax after the row's maximum is subtracted): x = n ln2 + f with
 * |f| <= ln2 / 2, exp(f) by ExpOfRemainder, 2^n put into the exponent bits. Relative error
 * below 3e-7; 0 below -87. On 8 or 16 lanes (Floats, Floats16).
 */
template <typename V>
inline V ExpNonPositive(V x) {
  using I = typename IntsOf<V>::Type;
  const V floor_value = V{} - 87.0f;
  const auto underflow = x < floor_value;
  x = underflow ? floor_value : x;
  // n = round(x log2 e); for x <= 0 that is trunc(x log2 e - 0.5), a plain conversion.
  const I whole = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I);
  const V two_n = reinterpret_cast<V>((whole + 127) << 23);
  return underflow ? V{} : ExpOfRemainder(x, __builtin_convertvector(whole, V)) * two_n;
}

/*!
 * \brief exp(x) for any x, clamped to [-87, 88] (finite, normal): ExpOfRemainder with n =
 * round(x log2 e) from adding 1.5 * 2^23, whose low bits then hold n (no conversions, no
 * underflow select). Relative error below 3e-7 inside the clamp.
 */
template <typename V>
inline V Exp(V x) {
  using I = typename IntsOf<V>::Type;
  constexpr float kRoundingShift = 12582912.0f;  // 1.5 * 2^23, bits 0x4B400000
  x = AtMost(AtLeast(x, V{} - 87.0f), V{} + 88.0f);
  const V shifted = x * 1.44269504088896341f + kRoundingShift;
  const V two_n = reinterpret_cast<V>((reinterpret_cast<I>(shifted) - (0x4B400000 - 127)) << 23);
  return ExpOfRemainder(x, shifted - kRoundingShift) * two_n;
}

/*! \brief sigmoid(x) = 1 / (1 + exp(-x)); exp's clamp keeps it finite (about 6e-39 below
 * -88). Relative error below 1e-6. */
template <typename V>
inline V Sigmoid(V x) {
  return 1.0f / (1.0f + Exp(-x));
}

/*! \brief SiLU (swish), x * sigmoid(x), as x / (1 + exp(-x)): the division is the step
 * that bounds its speed (this form, without the sign selects of exp(-|x|), ran in 0.83 of the
 * time on AVX-512, one thread). */
template <typename V>
inline V Silu(V x) {
  return x / (1.0f + Exp(-x));
}

/*! \brief Hard-swish, x * clip(x + 3, 0, 6) / 6 (ONNX HardSwish; MobileNetV3's activation). */
template <typename V>
inline V HardSwish(V x) {
  V gate = x + 3.0f;
  gate = AtMost(AtLeast(gate, V{}), V{} + 6.0f);
  return x * gate * (1.0f / 6.0f);
}

/*! \brief erf(x): Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7) on |x|. */
inline Floats Erf(Floats x) {
  const auto negative = x < Floats{};
  const Floats a = negative ? -x : x;
  const Floats t = 1.0f / (1.0f + 0.3275911f * a);
  Floats p = Floats{} + 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  const Floats y = 1.0f - p * t * ExpNonPositive(-a * a);
  return negative ? -y : y;
}

/*! \brief data[j] = f(data[j]) for j < n, `kLanes` at a time (the tail through a padded block). */
template <typename F>
void MapInPlace(float* data, int64_t n, F f) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    Floats v;
    std::memcpy(&v, data + j, sizeof(v));
    v = f(v);
    std::memcpy(data + j, &v, sizeof(v));
  }
  if (j < n) {
    Floats v{};
    std::memcpy(&v, data + j, (n - j) * sizeof(float));
    v = f(v);
    std::memcpy(data + j, &v, (n - j) * sizeof(float));
  }
}

// ---------------------------------------------------------------------------------------------
// Epilogues: elementwise steps applied to a GEMM's output block while it is in cache

/*! \brief One epilogue step (the codes are the packed arguments' step kinds). */
struct EpilogueStep {
  enum Kind : int64_t {
    kAddVector = 0, kAddTensor = 1, kRelu = 2, kClip = 3, kGelu = 4, kAddBlockedVector = 5,
    kSilu = 6, kSigmoid = 7, kHardSwish = 8
  };
  Kind kind;
  const float* data = nullptr;  // kAddVector / kAddBlockedVector: the vector; kAddTensor: an
                                // output-shaped tensor
  int64_t divisor = 1, length = 1;  // kAddVector: element at output offset o is (o / divisor) % length
  // kAddBlockedVector (a per-channel vector of a channel-blocked output [N, C / B, H, W, B]):
  // element at output offset o is ((o / divisor) % (length / block)) * block + o % block, with
  // divisor H * W * B.
  int64_t block = 1;
  float lo = 0.0f, hi = 0.0f;       // kClip
};

using Epilogue = std::vector<EpilogueStep>;

/*!
 * \brief Apply `epilogue` to `rows` x `cols` output elements at `c` (row stride ldc), the first
 * at element offset `offset` of the output tensor.
 */
void ApplyEpilogue(const Epilogue& epilogue, float* c, int64_t offset, int64_t rows, int64_t cols,
                   int64_t ldc) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = c + r * ldc;
    const int64_t o = offset + r * ldc;
    for (const EpilogueStep& step : epilogue) {
      switch (step.kind) {
        case EpilogueStep::kAddVector:
          if (step.divisor == 1 && o % step.length + cols <= step.length) {
            const float* v = step.data + o % step.length;
            for (int64_t j = 0; j < cols; ++j) row[j] += v[j];
          } else {
            // Runs of `divisor` elements share one vector element (a channel's bias).
            for (int64_t j = 0; j < cols;) {
              const int64_t index = (o + j) / step.divisor;
              const int64_t run_end = std::min(cols, (index + 1) * step.divisor - o);
              const float value = step.data[index % step.length];
              for (; j < run_end; ++j) row[j] += value;
            }
          }
          break;
        case EpilogueStep::kAddTensor:
          for (int64_t j = 0; j < cols; ++j) row[j] += step.data[o + j];
          break;
        case EpilogueStep::kAddBlockedVector:
          // Runs of up to `block` elements read consecutive vector elements (one channel block).
          for (int64_t j = 0; j < cols;) {
            const int64_t lane = (o + j) % step.block;
            const int64_t run = std::min(cols - j, step.block - lane);
            const float* v = step.data +
                             (o + j) / step.divisor % (step.length / step.block) * step.block + lane;
            for (int64_t k = 0; k < run; ++k) row[j + k] += v[k];
            j += run;
          }
          break;
        case EpilogueStep::kRelu:
          for (int64_t j = 0; j < cols; ++j) row[j] = std::max(row[j], 0.0f);
          break;
        case EpilogueStep::kClip:
          for (int64_t j = 0; j < cols; ++j) row[j] = std::min(std::max(row[j], step.lo), step.hi);
          break;
        case EpilogueStep::kGelu:
          MapInPlace(row, cols, [](Floats v) {
            return 0.5f * v * (1.0f + Erf(v * 0.70710678118654752f));
          });
          break;
        case EpilogueStep::kSilu:
          MapInPlace(row, cols, [](Floats v) { return Silu(v); });
          break;
        case EpilogueStep::kSigmoid:
          MapInPlace(row, cols, [](Floats v) { return Sigmoid(v); });
          break;
        case EpilogueStep::kHardSwish:
          MapInPlace(row, cols, [](Floats v) { return HardSwish(v); });
          break;
      }
    }
  }
}

/*!
 * \brief The epilogue in packed arguments [begin, end): each step is its kind, then for
 * kAddVector the vector and its divisor, for kAddTensor the tensor, for kClip one float32
 * tensor [lo, hi] (a constant: scalar arguments cost the VM a call each to compute).
 */
Epilogue ParseEpilogue(const PackedArgs& args, int begin, int end, const DLTensor* out) {
  Epilogue epilogue;
  const int64_t out_size = Product(out->shape, out->shape + out->ndim);
  for (int i = begin; i < end;) {
    EpilogueStep step{static_cast<EpilogueStep::Kind>(args[i++].cast<int64_t>())};
    if (step.kind == EpilogueStep::kAddVector || step.kind == EpilogueStep::kAddTensor ||
        step.kind == EpilogueStep::kAddBlockedVector) {
      DLTensor* t = args[i++].cast<DLTensor*>();
      CheckCompactFloat32(t, "epilogue operand");
      step.data = Data(t);
      step.length = Product(t->shape, t->shape + t->ndim);
      if (step.kind == EpilogueStep::kAddVector) {
        step.divisor = args[i++].cast<int64_t>();
      } else if (step.kind == EpilogueStep::kAddBlockedVector) {
        step.divisor = args[i++].cast<int64_t>();
        step.block = args[i++].cast<int64_t>();
        TVM_FFI_ICHECK(step.divisor > 0 && step.block > 0 && step.length % step.block == 0)
            << "gimlet.cpu: blocked vector of " << step.length << " elements in blocks of "
            << step.block;
      } else {
        TVM_FFI_ICHECK_EQ(step.length, out_size) << "gimlet.cpu: residual size differs from output";
      }
    } else if (step.kind == EpilogueStep::kClip) {
      DLTensor* bounds = args[i++].cast<DLTensor*>();
      CheckCompactFloat32(bounds, "clip bounds");
      TVM_FFI_ICHECK_EQ(Product(bounds->shape, bounds->shape + bounds->ndim), 2)
          << "gimlet.cpu: clip bounds must be [lo, hi]";
      step.lo = Data(bounds)[0];
      step.hi = Data(bounds)[1];
    } else {
      TVM_FFI_ICHECK(step.kind == EpilogueStep::kRelu || step.kind == EpilogueStep::kGelu ||
                     step.kind == EpilogueStep::kSilu || step.kind == EpilogueStep::kSigmoid ||
                     step.kind == EpilogueStep::kHardSwish)
          << "gimlet.cpu: unknown epilogue step " << step.kind;
    }
    epilogue.push_back(step);
  }
  return epilogue;
}

// ---------------------------------------------------------------------------------------------
// GEMM on TVM's thread pool

/*! \brief The [begin, end) share of `num_items` (in whole `granule`s) for one parallel task. */
std::pair<int64_t, int64_t> TaskRange(int task_id, const TVMParallelGroupEnv* penv,
                                      int64_t num_items, int64_t granule = 1) {
  const int64_t granules = (num_items + granule - 1) / granule;
  const int64_t per_task = (granules + penv->num_task - 1) / penv->num_task * granule;
  return {std::min(num_items, task_id * per_task),
          std::min(num_items, (task_id + 1) * per_task)};
}

/*! \brief The first n elements of a thread's scratch `buffer`, grown (never shrunk) as
 * needed. Resizing it to each call's size value-initialized, on every call that needed more
 * than the call before, everything past that call's size: ResNet-50, whose convs alternate
 * between small and large padded copies, spent 1.3% of its samples in memset. Callers write
 * what they read (a tile reading past the data, into the slack, drops what it computes). */
template <typename T>
T* Scratch(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

/*! \brief Run `task` as a parallel launch, or inline as a single task when `parallel` is false. */
void Launch(FTVMParallelLambda task, void* cdata, bool parallel) {
  if (parallel) {
    TVMBackendParallelLaunch(task, cdata, 0);
  } else {
    TVMParallelGroupEnv serial{nullptr, 1};
    task(0, &serial, cdata);
  }
}

// A GEMM this skinny with B transposed (LLM decode: a few token rows against a weight matrix
// [n, k]; speculative decoding's check: up to 8) is memory-bound on B: read each B row once, in
// order, and never pack B (OpenBLAS's sgemv, and sgemm's packing, read B well below the
// memory's bandwidth here: benchmarks/README.md, Language models). Each B row is dotted with all
// m A rows at once, one accumulator per A row, so m rows cost m independent multiply-add chains
// over one pass of B instead of m dependent ones. Streaming several B rows at once (fewer
// loads per multiply-add) was tried and halved the one-row speed: the hardware prefetcher
// follows one sequential stream best.
constexpr int64_t kSkinnyRows = 8;
// From 5 rows on, the multiply-adds outlast the hardware prefetcher's lead: a software prefetch
// 1 KiB ahead made SmolLM2's layer GEMMs 12-18% faster at 5-8 rows and slowed 1-4 rows
// (single thread, weights out of cache; benchmarks/README.md, Speculative decoding).
constexpr int64_t kPrefetchFromRows = 5;
constexpr int64_t kPrefetchAhead = 256;  // floats

#ifdef __AVX512F__
using WideFloats = float __attribute__((vector_size(64)));
#else
using WideFloats = float __attribute__((vector_size(32)));
#endif
using QuarterFloats = float __attribute__((vector_size(16)));
constexpr int64_t kWideLanes = sizeof(WideFloats) / sizeof(float);

inline WideFloats LoadWide(const float* p) {
  WideFloats v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

/*! \brief The sum of v's lanes, as a tree of vector halvings. */
inline float SumLanes(WideFloats v) {
#ifdef __AVX512F__
  const Floats h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const Floats h = v;
#endif
  const QuarterFloats q = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                          __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

/*! \brief c[i, j] = a[i, :] . b[j, :] for kRows A rows (row stride k), B rows j in [0, n). */
template <int64_t kRows>
void SkinnyRows(int64_t n, int64_t k, const float* a, const float* b, int64_t ldb, float* c,
                int64_t ldc) {
  const int64_t k_vec = k - k % kWideLanes;
  for (int64_t j = 0; j < n; ++j) {
    const float* row = b + j * ldb;
    WideFloats acc[kRows] = {};
    for (int64_t p = 0; p < k_vec; p += kWideLanes) {
      const WideFloats bv = LoadWide(row + p);
      if (kRows >= kPrefetchFromRows) __builtin_prefetch(row + p + kPrefetchAhead);
      for (int64_t i = 0; i < kRows; ++i) acc[i] += LoadWide(a + i * k + p) * bv;
    }
    for (int64_t i = 0; i < kRows; ++i) {
      float s = SumLanes(acc[i]);
      for (int64_t p = k_vec; p < k; ++p) s += a[i * k + p] * row[p];
      c[i * ldc + j] = s;
    }
  }
}

void SkinnyGemmTransposedB(int64_t m, int64_t n, int64_t k, const float* a, const float* b,
                           int64_t ldb, float* c, int64_t ldc) {
  static_assert(kSkinnyRows == 8, "one SkinnyRows instance per row count");
  switch (m) {
    case 1: return SkinnyRows<1>(n, k, a, b, ldb, c, ldc);
    case 2: return SkinnyRows<2>(n, k, a, b, ldb, c, ldc);
    case 3: return SkinnyRows<3>(n, k, a, b, ldb, c, ldc);
    case 4: return SkinnyRows<4>(n, k, a, b, ldb, c, ldc);
    case 5: return SkinnyRows<5>(n, k, a, b, ldb, c, ldc);
    case 6: return SkinnyRows<6>(n, k, a, b, ldb, c, ldc);
    case 7: return SkinnyRows<7>(n, k, a, b, ldb, c, ldc);
    default: return SkinnyRows<8>(n, k, a, b, ldb, c, ldc);
  }
}

/*! \brief Row-major C[m, n] (row stride ldc) = A[m, k] @ (B[k, n] or B[n, k]^T); serial. */
void Sgemm(bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
           const float* b, int64_t ldb, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m; ++i) std::fill(c + i * ldc, c + i * ldc + n, 0.0f);
    return;
  }
  if (transpose_b && m <= kSkinnyRows) {
    SkinnyGemmTransposedB(m, n, k, a, b, ldb, c, ldc);
    return;
  }
  if (m == 1) {  // a GEMV: sgemm packs all of B first, 3.7x slower at 1 x 4096 @ 4096 x 2048
    if (transpose_b) {
      scipy_cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, b, ldb, a, 1, 0.0f, c, 1);
    } else {
      scipy_cblas_sgemv(CblasRowMajor, CblasTrans, k, n, 1.0f, b, ldb, a, 1, 0.0f, c, 1);
    }
    return;
  }
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, transpose_b ? CblasTrans : CblasNoTrans, m, n,
                    k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
}

// GEMMs with fewer multiply-adds than this run on the calling thread.
constexpr int64_t kMinParallelGemm = int64_t{1} << 18;
// Copies of fewer floats than this (128 KiB) run on the calling thread: a larger one outlasts
// a parallel launch's few microseconds, and the other threads would wait for it idle.
constexpr int64_t kMinParallelCopy = int64_t{1} << 15;
// A direct conv with fewer multiply-adds than kMinParallelGemm runs on the pool all the same
// where its packed weight holds this many bytes: a 1x1 conv on one pixel (a squeeze-and-
// excitation gate's) reads its weight once, and two cores read it faster than one. MobileNetV3
// ran in 0.96 of its time (the convs of its 960 -> 240 -> 960 gates 36-38 -> 19-23 us each),
// EfficientNet-B0 in 0.99; 16 and 32 KiB were no better.
constexpr int64_t kMinParallelConvWeightBytes = 64 << 10;
// Column slices handed to threads are multiples of this (whole vectors and cache lines).
constexpr int64_t kColumnGranule = 64;

/*! \brief out[m, n] = a[m, k] @ (b[k, n] or b[n, k]^T); a is compact, b and out have row
 * strides ldb and ldc. */
struct Gemm {
  bool transpose_b;
  int64_t m, n, k;
  const float* a;
  const float* b;
  int64_t ldb;
  float* out;
  int64_t ldc;
  const Epilogue* epilogue = nullptr;  // applied to each block of out once it is computed
  const float* out_base = nullptr;     // the output tensor's first element (epilogue offsets)

  /*! \brief c[m, n] (row stride ldc) = a @ b for a block of this GEMM, then the epilogue. */
  void Run(int64_t m_, int64_t n_, const float* a_, const float* b_, float* c) const {
    Sgemm(transpose_b, m_, n_, k, a_, k, b_, ldb, c, ldc);
    if (epilogue != nullptr && !epilogue->empty()) {
      ApplyEpilogue(*epilogue, c, c - out_base, m_, n_, ldc);
    }
  }

  /*! \brief Whether threads take column slices (each reads all of a) rather than row slices
   * (each reads all of b): the one whose shared operand is the smaller. */
  bool SplitColumns(int num_tasks) const { return n >= kColumnGranule * num_tasks && n >= m; }
  int64_t Work() const { return m * n * k; }
};

int RunGemmSlice(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& g = *static_cast<const Gemm*>(cdata);
  if (g.SplitColumns(penv->num_task)) {
    const auto [n0, n1] = TaskRange(task_id, penv, g.n, kColumnGranule);
    g.Run(g.m, n1 - n0, g.a, g.b + (g.transpose_b ? n0 * g.ldb : n0), g.out + n0);
  } else {
    const auto [m0, m1] = TaskRange(task_id, penv, g.m);
    g.Run(m1 - m0, g.n, g.a + m0 * g.k, g.b, g.out + m0 * g.ldc);
  }
  return 0;
}

/*! \brief One GEMM, its columns (or rows, when there are few columns) split across the pool. */
void ParallelGemm(const Gemm& gemm) {
  Launch(RunGemmSlice, const_cast<Gemm*>(&gemm), gemm.Work() >= kMinParallelGemm);
}

// ---------------------------------------------------------------------------------------------
// matmul

/*! \brief Equal-shaped GEMMs at per-batch offsets; each thread runs whole GEMMs. */
struct BatchedGemm {
  Gemm shape;  // a, b, out: bases the offsets apply to
  std::vector<int64_t> a_offsets, b_offsets;

  int64_t Size() const { return static_cast<int64_t>(a_offsets.size()); }
};

int RunBatchedGemms(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& batch = *static_cast<const BatchedGemm*>(cdata);
  const Gemm& g = batch.shape;
  const auto [begin, end] = TaskRange(task_id, penv, batch.Size());
  for (int64_t i = begin; i < end; ++i) {
    g.Run(g.m, g.n, g.a + batch.a_offsets[i], g.b + batch.b_offsets[i], g.out + i * g.m * g.n);
  }
  return 0;
}

/*!
 * \brief out = a @ b (or a @ b^T over the last two axes), batch axes broadcast numpy-style.
 * a: [..., M, K], b: [..., K, N] or [..., N, K], out: [..., M, N]; then the epilogue.
 */
void Matmul(DLTensor* a, DLTensor* b, int64_t transpose_b, const Epilogue& epilogue,
            DLTensor* out) {
  CheckCompactFloat32(a, "a");
  CheckCompactFloat32(b, "b");
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK(a->ndim >= 2 && b->ndim >= 2 && out->ndim >= 2);
  const int64_t m = a->shape[a->ndim - 2], k = a->shape[a->ndim - 1];
  const int64_t n = transpose_b ? b->shape[b->ndim - 2] : b->shape[b->ndim - 1];
  TVM_FFI_ICHECK_EQ(k, transpose_b ? b->shape[b->ndim - 1] : b->shape[b->ndim - 2])
      << "gimlet.cpu.matmul: reduction lengths differ";
  TVM_FFI_ICHECK(out->shape[out->ndim - 2] == m && out->shape[out->ndim - 1] == n);
  Gemm gemm{transpose_b != 0, m, n, k, Data(a), Data(b), transpose_b ? k : n, Data(out), n,
            &epilogue, Data(out)};

  if (Product(b->shape, b->shape + b->ndim - 2) == 1) {
    // One weight matrix: fold every batch axis of a into M (a is compact).
    gemm.m = Product(a->shape, a->shape + a->ndim - 1);
    TVM_FFI_ICHECK_EQ(gemm.m * n, Product(out->shape, out->shape + out->ndim));
    ParallelGemm(gemm);
    return;
  }
  // General broadcast: walk the output batch index, keeping offsets into a and b.
  const int batch_ndim = out->ndim - 2;
  std::vector<int64_t> a_stride(batch_ndim, 0), b_stride(batch_ndim, 0);
  int64_t a_size = m * k, b_size = k * n;
  for (int d = batch_ndim - 1; d >= 0; --d) {
    const int ad = d - (batch_ndim - (a->ndim - 2));
    const int bd = d - (batch_ndim - (b->ndim - 2));
    const int64_t a_extent = ad >= 0 ? a->shape[ad] : 1;
    const int64_t b_extent = bd >= 0 ? b->shape[bd] : 1;
    TVM_FFI_ICHECK((a_extent == 1 || a_extent == out->shape[d]) &&
                   (b_extent == 1 || b_extent == out->shape[d]))
        << "gimlet.cpu.matmul: batch axes do not broadcast";
    a_stride[d] = a_extent == 1 ? 0 : a_size;
    b_stride[d] = b_extent == 1 ? 0 : b_size;
    a_size *= a_extent;
    b_size *= b_extent;
  }
  const int64_t num_batches = Product(out->shape, out->shape + batch_ndim);
  BatchedGemm batch{gemm};
  batch.a_offsets.reserve(num_batches);
  batch.b_offsets.reserve(num_batches);
  std::vector<int64_t> index(batch_ndim, 0);
  int64_t a_offset = 0, b_offset = 0;
  for (int64_t i = 0; i < num_batches; ++i) {
    batch.a_offsets.push_back(a_offset);
    batch.b_offsets.push_back(b_offset);
    for (int d = batch_ndim - 1; d >= 0; --d) {
      a_offset += a_stride[d];
      b_offset += b_stride[d];
      if (++index[d] < out->shape[d]) break;
      a_offset -= a_stride[d] * index[d];
      b_offset -= b_stride[d] * index[d];
      index[d] = 0;
    }
  }
  if (num_batches == 1) {
    ParallelGemm(gemm);
  } else {
    Launch(RunBatchedGemms, &batch, num_batches * gemm.Work() >= kMinParallelGemm);
  }
}

// ---------------------------------------------------------------------------------------------
// conv2d

struct Conv2DParams {
  int64_t stride_h, stride_w, pad_top, pad_left, dilation_h, dilation_w;
};

/*! \brief The parameters a conv2d packed function takes after its two tensors (args 2-7). */
Conv2DParams Conv2DParamsOf(const PackedArgs& args, int first = 2) {
  return {args[first].cast<int64_t>(),     args[first + 1].cast<int64_t>(),
          args[first + 2].cast<int64_t>(), args[first + 3].cast<int64_t>(),
          args[first + 4].cast<int64_t>(), args[first + 5].cast<int64_t>()};
}

/*! \brief One NCHW / OIHW conv2d call, cut into work units of a few output rows each. */
struct Conv2DWork {
  const float* x;
  const float* w;
  float* y;
  const Epilogue* epilogue;
  int64_t in_c, height, width;
  int64_t group_in_c, group_out_c, groups, kernel_h, kernel_w;
  int64_t out_h, out_w;
  Conv2DParams p;
  bool pointwise;          // 1x1, stride 1, no padding: the input is already the column matrix
  int64_t rows_per_unit;   // output rows per unit
  int64_t units_per_plane; // ceil(out_h / rows_per_unit)
  int64_t num_units;       // batch * groups * units_per_plane
};

/*!
 * \brief Unfold output rows [oy0, oy1) of one image-group: column matrix row (c * kh + i) * kw + j
 * holds x[c, oy*sh - pt + i*dh, ox*sw - pl + j*dw] at column (oy - oy0) * out_w + ox.
 */
void Im2Col(const Conv2DWork& t, const float* x, int64_t oy0, int64_t oy1, float* col) {
  const Conv2DParams& p = t.p;
  const int64_t num_cols = (oy1 - oy0) * t.out_w;
  for (int64_t c = 0; c < t.group_in_c; ++c) {
    const float* x_c = x + c * t.height * t.width;
    for (int64_t i = 0; i < t.kernel_h; ++i) {
      for (int64_t j = 0; j < t.kernel_w; ++j) {
        float* dst = col + ((c * t.kernel_h + i) * t.kernel_w + j) * num_cols;
        const int64_t x0 = j * p.dilation_w - p.pad_left;
        for (int64_t oy = oy0; oy < oy1; ++oy, dst += t.out_w) {
          const int64_t y = oy * p.stride_h - p.pad_top + i * p.dilation_h;
          if (y < 0 || y >= t.height) {
            std::fill(dst, dst + t.out_w, 0.0f);
            continue;
          }
          const float* x_row = x_c + y * t.width;
          if (p.stride_w == 1) {
            // Contiguous source: zero the padded edges, copy the middle.
            const int64_t lo = std::clamp<int64_t>(-x0, 0, t.out_w);
            const int64_t hi = std::clamp<int64_t>(t.width - x0, lo, t.out_w);
            std::fill(dst, dst + lo, 0.0f);
            std::memcpy(dst + lo, x_row + x0 + lo, (hi - lo) * sizeof(float));
            std::fill(dst + hi, dst + t.out_w, 0.0f);
          } else {
            for (int64_t ox = 0; ox < t.out_w; ++ox) {
              const int64_t xx = x0 + ox * p.stride_w;
              dst[ox] = (xx >= 0 && xx < t.width) ? x_row[xx] : 0.0f;
            }
          }
        }
      }
    }
  }
}

/*!
 * \brief One work unit: out rows [oy0, oy1) of one image-group = weight @ unfolded input,
 * with serial sgemm or, for a unit that is a whole deep-layer plane, the pool's.
 */
void RunConv2DUnit(const Conv2DWork& t, int64_t unit, bool parallel_gemm,
                   std::vector<float>* col) {
  const int64_t plane = unit / t.units_per_plane;  // image * groups + group
  const int64_t g = plane % t.groups, img = plane / t.groups;
  const int64_t oy0 = unit % t.units_per_plane * t.rows_per_unit;
  const int64_t oy1 = std::min(t.out_h, oy0 + t.rows_per_unit);
  const int64_t num_cols = (oy1 - oy0) * t.out_w, spatial = t.out_h * t.out_w;
  const int64_t reduction = t.group_in_c * t.kernel_h * t.kernel_w;
  const float* x = t.x + (img * t.in_c + g * t.group_in_c) * t.height * t.width;
  Gemm gemm{false, t.group_out_c, num_cols, reduction, t.w + g * t.group_out_c * reduction,
            x + oy0 * t.out_w, spatial,
            t.y + (img * t.groups + g) * t.group_out_c * spatial + oy0 * t.out_w, spatial,
            t.epilogue, t.y};
  if (!t.pointwise) {
    float* columns = Scratch(*col, reduction * num_cols);
    Im2Col(t, x, oy0, oy1, columns);
    gemm.b = columns;
    gemm.ldb = num_cols;
  }
  if (parallel_gemm) {
    ParallelGemm(gemm);
  } else {
    gemm.Run(gemm.m, gemm.n, gemm.a, gemm.b, gemm.out);
  }
}

int RunConv2DUnits(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& work = *static_cast<const Conv2DWork*>(cdata);
  thread_local std::vector<float> col;
  const auto [begin, end] = TaskRange(task_id, penv, work.num_units);
  for (int64_t unit = begin; unit < end; ++unit) RunConv2DUnit(work, unit, false, &col);
  return 0;
}

// A unit's column matrix is kept under this many floats (256 KiB: it stays in L2).
constexpr int64_t kColumnBudget = 1 << 16;

/*!
 * \brief NCHW / OIHW conv2d: out = weight @ im2col(data) per image and group.
 * data: [N, C, H, W], weight: [O, C / groups, KH, KW], out: [N, O, OH, OW].
 *
 * When there are many output pixels per channel, the output rows of every image-group are
 * cut into units whose column matrix fits in L2; TVM's thread pool runs the units, each
 * unfolding its own columns and calling single-threaded sgemm, so unfolding is parallel and
 * cache-resident too. Otherwise whole planes are unfolded and each GEMM is split across the pool.
 */
void Conv2D(DLTensor* data, DLTensor* weight, const Conv2DParams& p, int64_t groups,
            const Epilogue& epilogue, DLTensor* out) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(weight, "weight");
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK(data->ndim == 4 && weight->ndim == 4 && out->ndim == 4);
  const int64_t batch = data->shape[0], in_c = data->shape[1];
  const int64_t out_c = weight->shape[0], group_in_c = weight->shape[1];
  TVM_FFI_ICHECK(groups >= 1 && in_c == group_in_c * groups && out_c % groups == 0);
  TVM_FFI_ICHECK(out->shape[0] == batch && out->shape[1] == out_c);
  Conv2DWork work{Data(data), Data(weight), Data(out), &epilogue, in_c, data->shape[2],
                  data->shape[3],
                  group_in_c, out_c / groups, groups, weight->shape[2], weight->shape[3],
                  out->shape[2], out->shape[3], p};
  if (batch == 0 || out_c == 0 || work.out_h == 0 || work.out_w == 0) return;
  work.pointwise = work.kernel_h == 1 && work.kernel_w == 1 && p.stride_h == 1 &&
                   p.stride_w == 1 && p.pad_top == 0 && p.pad_left == 0 &&
                   work.out_h == work.height && work.out_w == work.width;
  const int64_t reduction = group_in_c * work.kernel_h * work.kernel_w;
  if (reduction == 0) {
    const int64_t size = batch * out_c * work.out_h * work.out_w;
    std::fill(work.y, work.y + size, 0.0f);
    ApplyEpilogue(epilogue, work.y, 0, 1, size, size);
    return;
  }
  const int64_t planes = batch * groups;
  if (work.out_h * work.out_w < 4 * work.group_out_c) {
    // Few output pixels per channel (deep layers): units would repack the large weight
    // matrix for a handful of columns each, so unfold whole planes and split their GEMMs.
    work.rows_per_unit = work.out_h;
    work.units_per_plane = 1;
    work.num_units = planes;
    thread_local std::vector<float> col;
    for (int64_t unit = 0; unit < work.num_units; ++unit) RunConv2DUnit(work, unit, true, &col);
    return;
  }
  const int64_t budget_rows = std::max<int64_t>(1, kColumnBudget / reduction / work.out_w);
  // At least 4 units in all, so two threads get balanced work on a single image.
  const int64_t balance_rows = std::max<int64_t>(1, work.out_h * planes / 4);
  work.rows_per_unit = std::min({budget_rows, balance_rows, work.out_h});
  work.units_per_plane = (work.out_h + work.rows_per_unit - 1) / work.rows_per_unit;
  work.num_units = planes * work.units_per_plane;
  Launch(RunConv2DUnits, &work, true);
}

// ---------------------------------------------------------------------------------------------
// Stride-phase planes: the data copied so that consecutive outputs read consecutive inputs
// at every tap, whatever the stride and dilation (the direct, row and depthwise kernels).

/*! \brief dst[j] = src[j] for j < n, `kLanes` at a time, the last `kLanes` overlapping the
 * ones before (short rows: memcpy's call costs more than the copy). */
inline void CopyFloats(const float* src, int64_t n, float* dst) {
  if (n < kLanes) {
    for (int64_t j = 0; j < n; ++j) dst[j] = src[j];
    return;
  }
  Floats v;
  for (int64_t j = 0; j + kLanes < n; j += kLanes) {
    std::memcpy(&v, src + j, sizeof(v));
    std::memcpy(dst + j, &v, sizeof(v));
  }
  std::memcpy(&v, src + n - kLanes, sizeof(v));
  std::memcpy(dst + n - kLanes, &v, sizeof(v));
}

/*! \brief dst[j][i] = src[i][j] for an 8x8 block of floats, rows `src_stride` and
 * `dst_stride` floats apart: three rounds of shuffles, as a vectorized transpose does (the
 * element-by-element loop ran about 1 float a cycle; ResNet-50 spent 0.5 ms in layout
 * conversions). */
inline void Transpose8x8(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  static_assert(kLanes == 8);
  Floats r[8], u[8];
  for (int i = 0; i < 8; ++i) std::memcpy(&r[i], src + i * src_stride, sizeof(Floats));
  for (int i = 0; i < 8; i += 4) {  // u[i + k]: columns k and k + 4 of rows i..i+3
    const Floats a = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    const Floats b = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    const Floats c = __builtin_shufflevector(r[i + 2], r[i + 3], 0, 8, 1, 9, 4, 12, 5, 13);
    const Floats d = __builtin_shufflevector(r[i + 2], r[i + 3], 2, 10, 3, 11, 6, 14, 7, 15);
    u[i] = __builtin_shufflevector(a, c, 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 1] = __builtin_shufflevector(a, c, 2, 3, 10, 11, 6, 7, 14, 15);
    u[i + 2] = __builtin_shufflevector(b, d, 0, 1, 8, 9, 4, 5, 12, 13);
    u[i + 3] = __builtin_shufflevector(b, d, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int k = 0; k < 4; ++k) {
    const Floats low = __builtin_shufflevector(u[k], u[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    const Floats high = __builtin_shufflevector(u[k], u[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    std::memcpy(dst + k * dst_stride, &low, sizeof(Floats));
    std::memcpy(dst + (k + 4) * dst_stride, &high, sizeof(Floats));
  }
}

/*! \brief dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols: 8 x 8
 * blocks by Transpose8x8 (where rows are not whole 8s, the last block of rows overlaps the one
 * before it and writes its values again), the channels past whole 8s and rows of fewer than 8
 * one value at a time. A direct conv's tile ([pixels][B channels]) goes this way into an NCHW
 * output. */
inline void TransposeFloats(const float* src, int64_t src_stride, int64_t rows, int64_t cols,
                            float* dst, int64_t dst_stride) {
  const int64_t whole = rows >= 8 ? cols / 8 * 8 : 0;
  for (int64_t c = 0; c < whole; c += 8) {
    for (int64_t r = 0; r < rows; r += 8) {
      const int64_t r0 = std::min(r, rows - 8);
      Transpose8x8(src + r0 * src_stride + c, src_stride, dst + c * dst_stride + r0, dst_stride);
    }
  }
  for (int64_t c = whole; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r) dst[c * dst_stride + r] = src[r * src_stride + c];
  }
}

/*! \brief a / b rounded up, for b > 0 (toward zero for a < 0); strides 1 and 2 without a
 * division (a 64-bit division costs more than copying a depthwise conv's short row). */
inline int64_t CeilDiv(int64_t a, int64_t b) {
  return b == 1 ? a : b == 2 ? (a + 1) >> 1 : (a + b - 1) / b;
}

/*! \brief The taps [k0, k1) of a window starting at `start` (`kernel` taps `dilation` apart)
 * that fall inside [0, extent); no division where the window lies inside. */
inline std::pair<int64_t, int64_t> TapsInside(int64_t start, int64_t kernel, int64_t dilation,
                                              int64_t extent) {
  if (start >= 0 && start + (kernel - 1) * dilation < extent) return {0, kernel};
  const int64_t k0 = start >= 0 ? 0 : std::min(kernel, CeilDiv(-start, dilation));
  return {k0, std::clamp(CeilDiv(extent - start, dilation), k0, kernel)};
}

/*! \brief The outputs [o0, o1) of `outputs` whose windows, starting at o * stride - pad and
 * reaching `reach` past their start, lie inside [0, extent): those that read no padding. */
inline std::pair<int64_t, int64_t> OutputsInside(int64_t pad, int64_t stride, int64_t reach,
                                                 int64_t extent, int64_t outputs) {
  const int64_t o0 = std::min(outputs, CeilDiv(pad, stride));
  const int64_t last = extent - 1 - reach + pad;  // the last o * stride inside
  return {o0, last < 0 ? o0 : std::clamp(last / stride + 1, o0, outputs)};
}

/*! \brief even[k] = src[2 * k] for k < n_even and, unless `odd` is null, odd[k] = src[2 * k + 1]
 * for k < n_odd, reading no further than src[available - 1]: a row's stride-2 column phases,
 * both in one pass over it where both are wanted, `kLanes` of each at a time from two
 * vectors while those stay inside, then one by one. */
inline void CopyEvenOddFloats(const float* src, int64_t n_even, int64_t n_odd, int64_t available,
                              float* even, float* odd) {
  const int64_t vectors = odd == nullptr ? n_even : std::min(n_even, n_odd);
  int64_t k = 0;
  for (; k + kLanes <= vectors && 2 * (k + kLanes) <= available; k += kLanes) {
    Floats lo, hi;
    std::memcpy(&lo, src + 2 * k, sizeof(lo));
    std::memcpy(&hi, src + 2 * k + kLanes, sizeof(hi));
    const Floats e = __builtin_shufflevector(lo, hi, 0, 2, 4, 6, 8, 10, 12, 14);
    std::memcpy(even + k, &e, sizeof(e));
    if (odd != nullptr) {
      const Floats o = __builtin_shufflevector(lo, hi, 1, 3, 5, 7, 9, 11, 13, 15);
      std::memcpy(odd + k, &o, sizeof(o));
    }
  }
  for (int64_t j = k; j < n_even; ++j) even[j] = src[2 * j];
  if (odd != nullptr) {
    for (int64_t j = k; j < n_odd; ++j) odd[j] = src[2 * j + 1];
  }
}

/*! \brief out[j] = in[j * stride] for j < n, a pixel being E floats (a constant size: a
 * copy of a runtime size is a call). */
template <int E>
inline void CopyStridedPixels(const float* in, int64_t n, int64_t stride, float* out) {
  for (int64_t j = 0; j < n; ++j) std::memcpy(out + j * E, in + j * stride * E, E * sizeof(float));
}

/*! \brief Phase planes of N * C data planes (see RowConvWork), zero where the padding is; a
 * pixel is `element` floats (channel-blocked data: one block's channels), widths and columns
 * count pixels. */
struct PhasePlanes {
  const float* x;
  float* phases;
  int64_t planes, height, width, stride_h, stride_w, phase_h, phase_w, top, left;
  int64_t element = 1;
  // Only phases (a, b) with a < copied_h and b < copied_w are written: the others are never
  // read (a 1x1 stride-2 conv reads phase (0, 0) only).
  int64_t copied_h = std::numeric_limits<int64_t>::max();
  int64_t copied_w = std::numeric_limits<int64_t>::max();

  /*! \brief Phase rows [row0, row0 + rows) of data plane `plane` into `dst`, as stride_h *
   * stride_w phases of `rows` x phase_w pixels, `dst_phase_rows` rows apart (0: `rows`, the
   * phases back to back); the padding columns are left as they are unless `zero_columns` (a
   * buffer reused for the same layout keeps them zero). */
  void Copy(int64_t plane, int64_t row0, int64_t rows, float* dst, bool zero_columns = true,
            int64_t dst_phase_rows = 0) const {
    const int64_t e = element, row_floats = phase_w * e;
    const int64_t phase_floats = (dst_phase_rows ? dst_phase_rows : rows) * row_floats;
    const float* src = x + plane * height * width * e;
    for (int64_t a = 0; a < stride_h; ++a) {
      if (stride_w == 2 && e == 1 && copied_w >= 2 && a < copied_h) {
        CopyColumnPhases(src, a, row0, rows, dst, phase_floats, zero_columns);
        dst += 2 * phase_floats;
        continue;
      }
      for (int64_t b = 0; b < stride_w; ++b, dst += phase_floats) {
        if (a >= copied_h || b >= copied_w) continue;
        // Columns j with 0 <= j * stride_w + b - left < width come from the data.
        const int64_t j0 = std::min(phase_w, CeilDiv(std::max<int64_t>(left - b, 0), stride_w));
        const int64_t j1 = std::clamp<int64_t>(CeilDiv(width + left - b, stride_w), j0, phase_w);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t row = (row0 + i) * stride_h + a - top;
          float* out = dst + i * row_floats;
          if (row < 0 || row >= height) {
            std::fill(out, out + row_floats, 0.0f);
            continue;
          }
          const float* in = src + (row * width + j0 * stride_w + b - left) * e;
          // (A strided loop compiles to one lane insert per float.)
          if (stride_w == 1) {
            CopyFloats(in, (j1 - j0) * e, out + j0 * e);
          } else if (stride_w == 2 && e == 1) {
            CopyEvenOddFloats(in, j1 - j0, 0, src + (row + 1) * width - in, out + j0, nullptr);
          } else if (e == 1) {
            CopyStridedPixels<1>(in, j1 - j0, stride_w, out + j0);
          } else if (e == 8) {
            CopyStridedPixels<8>(in, j1 - j0, stride_w, out + j0 * e);
          } else {
            CopyStridedPixels<16>(in, j1 - j0, stride_w, out + j0 * e);
          }
          if (zero_columns) {
            std::fill(out, out + j0 * e, 0.0f);
            std::fill(out + j1 * e, out + row_floats, 0.0f);
          }
        }
      }
    }
  }

  /*! \brief Copy's rows of row phase `a` of one unblocked data plane (`src`) at column stride
   * 2: both column phases (at `dst` and `phase_floats` after it) from one pass over each data
   * row (CopyEvenOddFloats), where a pass per phase read every row twice: the copy had taken
   * 30% of mobilenet_cnn's stem (8 images, 3 -> 16 channels, 3x3 / 2 at 64x64), which ran 107-110
   * -> 94-97 us on one thread. */
  void CopyColumnPhases(const float* src, int64_t a, int64_t row0, int64_t rows, float* dst,
                        int64_t phase_floats, bool zero_columns) const {
    const int64_t row_floats = phase_w;
    // Phase b's columns [j0[b], j1[b]) come from the data: even data columns from phase left
    // % 2, odd ones from the other, each from its first column on.
    int64_t j0[2], j1[2];
    for (int64_t b = 0; b < 2; ++b) {
      j0[b] = std::min(phase_w, CeilDiv(std::max<int64_t>(left - b, 0), 2));
      j1[b] = std::clamp<int64_t>(CeilDiv(width + left - b, 2), j0[b], phase_w);
    }
    const int64_t even = left % 2, odd = 1 - even;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t row = (row0 + i) * stride_h + a - top;
      float* out[2] = {dst + i * row_floats, dst + phase_floats + i * row_floats};
      if (row < 0 || row >= height) {
        for (float* o : out) std::fill(o, o + row_floats, 0.0f);
        continue;
      }
      CopyEvenOddFloats(src + row * width, j1[even] - j0[even], j1[odd] - j0[odd], width,
                        out[even] + j0[even], out[odd] + j0[odd]);
      if (zero_columns) {
        for (int64_t b = 0; b < 2; ++b) {
          std::fill(out[b], out[b] + j0[b], 0.0f);
          std::fill(out[b] + j1[b], out[b] + row_floats, 0.0f);
        }
      }
    }
  }

  /*! \brief Into `offsets`, where each tap (c, kh, kw) of a `channels`-channel conv reads for
   * output (0, 0), in floats from an image's phase planes: phase (kh * DH % SH, kw * DW % SW)
   * of channel c at row kh * DH / SH, column kw * DW / SW. The kernel's KH * KW offsets in a
   * channel's phase planes are worked out once, then added to each channel's start: divisions
   * per tap had cost 2-4% of MobileNetV2's time (960-tap 1x1 convs, every call). */
  void TapOffsets(int64_t channels, int64_t kernel_h, int64_t kernel_w, int64_t dilation_h,
                  int64_t dilation_w, std::vector<int64_t>* offsets) const {
    const int64_t plane = phase_h * phase_w, kernel = kernel_h * kernel_w;
    offsets->resize(channels * kernel);
    if (channels == 0) return;
    int64_t* tap = offsets->data();
    for (int64_t kh = 0; kh < kernel_h; ++kh) {  // channel 0's taps
      for (int64_t kw = 0; kw < kernel_w; ++kw) {
        const int64_t a = kh * dilation_h % stride_h, b = kw * dilation_w % stride_w;
        const int64_t pixel = kh * dilation_h / stride_h * phase_w + kw * dilation_w / stride_w;
        *tap++ = ((a * stride_w + b) * plane + pixel) * element;
      }
    }
    // Channel c: block c / element's phase planes, lane c % element.
    const int64_t block_floats = stride_h * stride_w * plane * element;
    for (int64_t c = 1, lane = 1, start = 1; c < channels; ++c, ++lane, ++start) {
      if (lane == element) {
        lane = 0;
        start += block_floats - element;
      }
      for (int64_t k = 0; k < kernel; ++k) *tap++ = (*offsets)[k] + start;
    }
  }
};

int RunPhasePlanes(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const PhasePlanes*>(cdata);
  const auto [begin, end] = TaskRange(task_id, penv, t.planes);
  const int64_t per_plane = t.stride_h * t.stride_w * t.phase_h * t.phase_w * t.element;
  for (int64_t plane = begin; plane < end; ++plane) {
    t.Copy(plane, 0, t.phase_h, t.phases + plane * per_plane);
  }
  return 0;
}

// An x86 instruction set a function is compiled for (whatever -march says); elsewhere nothing
// (DirectConvBlock is 0 there: the kernels never run).
#if defined(__x86_64__) || defined(__i386__)
#define GIMLET_TARGET(isa) __attribute__((target(isa)))
#else
#define GIMLET_TARGET(isa)
#endif

/*! \brief L floats in one vector (GCC drops a vector_size that depends on a template argument,
 * so each width is spelled out); `Unaligned`, the same at any float's address, for loads and
 * stores of one instruction each (a std::memcpy into an element of an array of vectors is a
 * copy through memory, done in halves, and reading the vector back stalls on the halves'
 * store forwarding). */
template <int L>
struct VectorOf;
template <>
struct VectorOf<8> {
  using Type = float __attribute__((vector_size(32)));
  using Unaligned = float __attribute__((vector_size(32), aligned(4), may_alias));
};
template <>
struct VectorOf<16> {
  using Type = Floats16;
  using Unaligned = float __attribute__((vector_size(64), aligned(4), may_alias));
};

/*! \brief Whether `epilogue` has only steps `BlockedEpilogueVector` applies on vectors of a
 * channel-blocked output with blocks of `block` (bias of blocks of `block`, residual, ReLU, clip,
 * SiLU, sigmoid, hard-swish). */
constexpr size_t kMaxVectorEpilogue = 8;  // steps

bool IsBlockedVectorEpilogue(const Epilogue& epilogue, int64_t block) {
  if (epilogue.size() > kMaxVectorEpilogue) return false;
  for (const EpilogueStep& step : epilogue) {
    const bool fits = step.kind == EpilogueStep::kAddTensor || step.kind == EpilogueStep::kRelu ||
                      step.kind == EpilogueStep::kClip || step.kind == EpilogueStep::kSilu ||
                      step.kind == EpilogueStep::kSigmoid || step.kind == EpilogueStep::kHardSwish ||
                      (step.kind == EpilogueStep::kAddBlockedVector && step.block == block);
    if (!fits) return false;
  }
  return true;
}

/*! \brief Whether `epilogue` has a step the register tiles leave to the stored tile (or row):
 * through exp (SiLU, sigmoid: a few dozen instructions a vector) or hard-swish (three constants
 * more). Such steps run over the stored tile, one step at a time, not on a register tile's
 * accumulators, where their temporaries beside 24 live accumulators spilled: EfficientNet-B0's
 * 112->672 1x1 conv with SiLU at 14x14 took 190 us, 130 us this way (its depthwise convs, 8
 * accumulators, ran in 0.986 of the time in the whole model); with hard-swish's code in the
 * register tiles MobileNetV2 (which has none) took 1.045x as long. */
bool HasStoredTileStep(const Epilogue& epilogue) {
  return std::any_of(epilogue.begin(), epilogue.end(), [](const EpilogueStep& step) {
    return step.kind == EpilogueStep::kSilu || step.kind == EpilogueStep::kSigmoid ||
           step.kind == EpilogueStep::kHardSwish;
  });
}

/*! \brief The per-channel vectors' L elements each kAddBlockedVector step of `epilogue` adds to
 * the pixels of one channel block (`row`: the block's output plane, from element offset
 * `o`), by step position. */
struct BlockedRowVectors {
  const float* at[kMaxVectorEpilogue];

  BlockedRowVectors() = default;
  BlockedRowVectors(const Epilogue& epilogue, int64_t o) {
    for (size_t i = 0; i < epilogue.size(); ++i) {
      const EpilogueStep& step = epilogue[i];
      at[i] = step.kind != EpilogueStep::kAddBlockedVector
                  ? nullptr
                  : step.data + o / step.divisor % (step.length / step.block) * step.block;
    }
  }
};

/*! \brief Step `i` of `epilogue` (IsBlockedVectorEpilogue) on the vector `v` of L channels of
 * one pixel of a channel-blocked output, at element offset `o` in the output, `vectors` its
 * channel block's; not the stored tiles' steps (HasStoredTileStep: BlockedEpilogueVectors runs
 * those), whose mere presence in the register tiles' epilogues beside 24 accumulators made GCC
 * spill accumulators in the taps loop (MobileNetV2's expansion convs with a ReLU6 ran 2x
 * slower). */
template <int L>
__attribute__((always_inline)) inline typename VectorOf<L>::Type BlockedEpilogueStep(
    const Epilogue& epilogue, size_t i, const BlockedRowVectors& vectors,
    typename VectorOf<L>::Type v, int64_t o) {
  using V = typename VectorOf<L>::Type;
  const EpilogueStep& step = epilogue[i];
  V operand;
  switch (step.kind) {
    case EpilogueStep::kAddBlockedVector:
      std::memcpy(&operand, vectors.at[i], sizeof(V));
      return v + operand;
    case EpilogueStep::kAddTensor:
      std::memcpy(&operand, step.data + o, sizeof(V));
      return v + operand;
    case EpilogueStep::kRelu:
      return AtLeast(v, V{});
    case EpilogueStep::kClip:
      return AtMost(AtLeast(v, V{} + step.lo), V{} + step.hi);
    default:
      break;
  }
  __builtin_trap();  // a step IsBlockedVectorEpilogue rejects, or a stored tile's
}

/*! \brief `epilogue` (IsBlockedVectorEpilogue, no stored tile's step) on the vector `v` in
 * registers (see BlockedEpilogueStep): each step while it is in a register. */
template <int L>
__attribute__((always_inline)) inline typename VectorOf<L>::Type BlockedEpilogueVector(
    const Epilogue& epilogue, const BlockedRowVectors& vectors, typename VectorOf<L>::Type v,
    int64_t o) {
  for (size_t i = 0; i < epilogue.size(); ++i) v = BlockedEpilogueStep<L>(epilogue, i, vectors, v, o);
  return v;
}

/*! \brief v[r] = f(v[r], r) for the `count` vectors of L floats at `v`. */
template <int L, typename F>
__attribute__((always_inline)) inline void MapVectors(float* v, int64_t count, F f) {
  using V = typename VectorOf<L>::Type;
  for (int64_t r = 0; r < count; ++r) {
    V x;
    std::memcpy(&x, v + r * L, sizeof(V));
    x = f(x, r);
    std::memcpy(v + r * L, &x, sizeof(V));
  }
}

/*! \brief `epilogue` (IsBlockedVectorEpilogue) on `count` consecutive pixels' vectors at `v`,
 * in place, the first at element offset `o` of the output: one step over all of them at a
 * time. The stored tile's steps (through exp, hard-swish) each get a loop of their own, its
 * constants in registers across the vectors; in one loop through BlockedEpilogueStep's switch
 * GCC dispatched every vector and loaded the constants again, and SiLU cost about 1 ns an
 * element, 2.3x its cost over an array (AMD Zen 3, AVX2). */
template <int L>
__attribute__((always_inline)) inline void BlockedEpilogueVectors(const Epilogue& epilogue,
                                                                  const BlockedRowVectors& vectors,
                                                                  float* v, int64_t count,
                                                                  int64_t o) {
  using V = typename VectorOf<L>::Type;
  for (size_t i = 0; i < epilogue.size(); ++i) {
    switch (epilogue[i].kind) {
      case EpilogueStep::kSilu:
        MapVectors<L>(v, count, [](V x, int64_t) { return Silu(x); });
        break;
      case EpilogueStep::kSigmoid:
        MapVectors<L>(v, count, [](V x, int64_t) { return Sigmoid(x); });
        break;
      case EpilogueStep::kHardSwish:
        MapVectors<L>(v, count, [](V x, int64_t) { return HardSwish(x); });
        break;
      default:
        MapVectors<L>(v, count, [&](V x, int64_t r) {
          return BlockedEpilogueStep<L>(epilogue, i, vectors, x, o + r * L);
        });
    }
  }
}

/*!
 * \brief A vector epilogue (IsBlockedVectorEpilogue, no stored tile's step) of the form
 * clip(v + bias + residual, lo, hi), each part optional: a per-channel bias, an output-shaped
 * tensor, then a ReLU or a clip (the common CNN epilogues), applied to a vector in a few
 * instructions instead of step by step. The blocked depthwise conv (9 or 25 multiply-adds a
 * vector) took 1.3-1.4x as long with a bias and a ReLU or ReLU6 through the steps as with the
 * bias alone (112x112x32 and 56x56x144, 3x3). The direct conv's register tiles take it too: a
 * 1x1 conv 64 -> 256 on 13x13 with a bias and a ReLU ran 35.5 -> 33 us (one thread, Intel
 * Xeon), a 3x3 32 -> 128 on 27x27 1.5% faster.
 */
struct AffineClip {
  bool applies = false;
  int bias = -1;                    // the kAddBlockedVector step's position, or -1
  const float* residual = nullptr;  // a kAddTensor step's tensor
  float lo = -std::numeric_limits<float>::infinity(), hi = std::numeric_limits<float>::infinity();

  AffineClip() = default;
  // An empty epilogue leaves `applies` false: a plain store beats adding nothing and clipping
  // to +-infinity.
  explicit AffineClip(const Epilogue& epilogue) {
    if (epilogue.empty()) return;
    bool clipped = false;
    for (size_t i = 0; i < epilogue.size(); ++i) {
      const EpilogueStep& step = epilogue[i];
      if (clipped) {
        return;  // a step after the clip
      } else if (step.kind == EpilogueStep::kAddBlockedVector && bias < 0) {
        bias = static_cast<int>(i);
      } else if (step.kind == EpilogueStep::kAddTensor && residual == nullptr) {
        residual = step.data;
      } else if (step.kind == EpilogueStep::kRelu || step.kind == EpilogueStep::kClip) {
        lo = step.kind == EpilogueStep::kRelu ? 0.0f : step.lo;
        hi = step.kind == EpilogueStep::kRelu ? hi : step.hi;
        clipped = true;
      } else {
        return;
      }
    }
    applies = true;
  }

  /*! \brief The bias vector of a channel block whose epilogue vectors are `vectors` (zero
   * where there is no bias). */
  template <typename V>
  __attribute__((always_inline)) V Bias(const BlockedRowVectors& vectors) const {
    V b{};
    if (bias >= 0) std::memcpy(&b, vectors.at[bias], sizeof(V));
    return b;
  }

  /*! \brief clip(v + bias + residual, lo, hi) for the vector at element offset `o` of the
   * output, `b` its block's Bias. */
  template <typename V>
  __attribute__((always_inline)) V operator()(V v, V b, int64_t o) const {
    v += b;
    if (residual != nullptr) {
      V r;
      std::memcpy(&r, residual + o, sizeof(V));
      v += r;
    }
    return AtMost(AtLeast(v, V{} + lo), V{} + hi);
  }
};

// ---------------------------------------------------------------------------------------------
// conv2d, direct: output channels in blocks of one vector's lanes (onnxruntime's MLAS NCHWc
// convolutions work the same way). Data and output are NCHW, or channel-blocked NCHW{B}c
// ([N, C / B, H, W, B], what relax_passes/blocked_layout.py converts regions of a network to:
// then a tile's stores are contiguous and a 1x1 conv is a GEMM without a column matrix); the
// weights come packed once, at build time, as [ceil(O / B), C, KH, KW, B] (B output channels
// per block, zero past O), the same for either layout. A register tile is P pixels x NB
// channel blocks: each weight vector is loaded once per tap and multiplied with P broadcast
// input values, so no column matrix is written or read.
//
// The data is copied into zero-padded stride-phase planes (PhasePlanes; each thread copies
// the rows its own tiles read: TaskInput), and the output is computed on a grid as wide as a
// phase row: output (oy, ox) is grid pixel oy * GW + ox, and the grid columns past OW (the
// taps' reach, 2 for a 3x3 stride-1 conv) are computed and dropped. Then every tap of grid
// pixel g reads at g * XB from that tap's own offset, so a tile's P pixels read at distances
// the compiler knows (immediate displacements): no per-pixel offsets held in registers (with
// 12 pixels they spilled and were reloaded for every tap), and tiles run across rows, so small
// deep-layer planes fill whole tiles. A pointwise conv (1x1, stride 1, no padding) reads the
// data as it is (its grid is the output plane).
//
// Where the grid tiles would compute over 5% more pixels than there are outputs and a narrower
// tile width W divides the output width (`RowTileWidth`: 8 where it divides it, else 7, as on
// ResNets' 14x14 and 7x7 planes), tiles are instead W-pixel pieces of output rows ("row
// tiles"): no dropped grid columns and no short last tile. On a 7x7 plane the grid's
// 12-pixel tiles computed 72 pixels for 49 outputs; a W-pixel tile multiplies as fast per
// multiply-add as a 12-pixel one (14-16 accumulators still hide the FMA latency). On planes
// up to 28 wide whose width 14 divides, tiles are 14-pixel row pieces (two blocks: 28
// accumulators, each tap's two weight vectors serving 14 broadcasts) even where grid tiles
// would waste nothing: ResNet-50's 3x3 convs at 14x14 ran 1.28 -> 1.13x onnxruntime's time,
// its 1x1 convs at 28x28 and 14x14 2-5% faster than on four-block grid tiles. Not at 56x56,
// where they lost (3% on 64->256, 50% on 256->64: each two-block group reads the 3 MiB of
// input again), nor for an output of exactly four blocks (one four-block group).
//
// A tile holds two channel blocks, or on AVX-512 four (6 pixels) where the blocks come in whole
// fours and grid tiles are used: each data value loaded then serves 64 output channels, and a
// chunk reads its pixels' data once for 64 channels, not twice (as MLAS's AVX-512 kernels
// run four filter blocks). On ResNet-50's 56x56 1x1 convs with 64 or 128 output channels
// this was 10-30% faster; on row tiles the four-block tile would need 28-32 accumulators.

/*! \brief One direct conv2d call (groups 1): the slots (tile positions) of every image and
 * group of `group_blocks` channel blocks, split evenly between the threads, each thread's
 * share run in chunks of up to `chunk_slots` slots of one image and group. (Fixed chunks as
 * the threads' units left MobileNetV2's 14x14 projections 5 units for 2 threads, 24 slots
 * against 9.) */
struct DirectConvWork {
  const float* x;        // a pointwise conv's data (its taps read it as it is), else null
  const PhasePlanes* source;  // else the data's phase planes, each task copying its own rows
  int64_t reach;         // grid pixels past a pixel that its last tap reads
  const float* w;        // [ceil(O / B), C, KH, KW, B]
  const int64_t* taps;   // [C * KH * KW]: where each tap of grid pixel 0 reads in an image's x
  int64_t num_taps;
  int64_t image_floats;  // floats per image of the planes the taps read
  int64_t plane_floats;  // ... per plane (of one data channel, or channel block)
  int64_t x_block;       // XB, the data's channel block: 1 (NCHW data) or B
  float* y;              // [N, O, OH, OW] or [N, O / B, OH, OW, B]
  const Epilogue* epilogue;
  bool y_blocked;        // the output is [N, O / B, OH, OW, B]
  bool vector_epilogue;  // y_blocked and IsBlockedVectorEpilogue
  bool register_epilogue;  // vector_epilogue without a step of many instructions (SiLU, sigmoid)
  int64_t out_c, out_h, out_w;
  int64_t grid_w;        // GW: grid pixels per row
  int64_t grid;          // grid pixels up to the last output: (OH - 1) * GW + OW
  bool slack;            // x may be read a tile past its last grid pixel (a copy with room)
  int64_t block;         // B, the weights' last extent
  int64_t blocks;        // ceil(out_c / B)
  int64_t group_blocks;  // G, channel blocks per tile: kBlocks, or kWideBlocks (blocks % 4 == 0)
  int64_t block_groups;  // ceil(blocks / G)
  int64_t row_w;         // W of row tiles (see above), 0 for tiles across the grid
  int64_t slot_w;        // pixels of a slot: a G-block tile's (row_w, or the grid tiles' P)
  int64_t slots;         // row tiles OH * OW / W, or grid slots ceil(grid / P)
  int64_t chunk_slots;   // the most slots of a chunk
  bool groups_inner;     // an image's chunks run each through all groups (see ChunkAt)
  int64_t work_slots;    // images * block_groups * slots
  int64_t conv_groups;   // a grouped conv's groups, each run as an image of its own (else 1)
  Conv2DParams p;        // for TapsOfGrid, with:
  int64_t kernel_h, kernel_w, in_h;
  int64_t inner_g0, inner_g1;  // the grid pixels of the output rows that read no padding row
  AffineClip affine;     // the register epilogue's form, where it has it

  /*! \brief A chunk: slots [s0, s1) of group `group` of image `img`. */
  struct Chunk {
    int64_t img, group, s0, s1;
  };

  /*! \brief The chunk at work position `pos`, ending at `end` at the latest. Positions run
   * image by image; in an image, group by group (a group's weights stay in cache over all its
   * slots), or where `groups_inner`, chunk by chunk, each chunk's slots through every group
   * in turn (the chunk's data stays in cache over the groups). */
  Chunk ChunkAt(int64_t pos, int64_t end) const {
    const int64_t img = pos / (block_groups * slots), r = pos % (block_groups * slots);
    if (!groups_inner) {
      const int64_t s0 = r % slots;
      return {img, r / slots, s0, std::min({slots, s0 + chunk_slots, s0 + end - pos})};
    }
    // The chunk's first slot and length (every chunk before it is whole), the position in it.
    const int64_t first = r / (block_groups * chunk_slots) * chunk_slots;
    const int64_t length = std::min(chunk_slots, slots - first), k = r - first * block_groups;
    const int64_t s0 = first + k % length;
    return {img, k / length, s0, std::min(first + length, s0 + end - pos)};
  }

  /*! \brief The taps [lo, hi) of each input channel's KH * KW (kernel rows first) that grid
   * pixels [g0, g1) read inside the input: a tile of rows at the top or bottom skips the
   * kernel rows that read only padding (onnxruntime's MLAS skips them). A 3x3 conv on 7x7 or
   * 8x8 ran 5% faster than on the same plane unpadded; resnet_cnn and ResNet-18 in 0.989 and
   * 0.986 of their time (AMD Zen 4, one process, alternating). */
  std::pair<int64_t, int64_t> TapsOfGrid(int64_t g0, int64_t g1) const {
    if (g0 >= inner_g0 && g1 <= inner_g1) return {0, kernel_h * kernel_w};  // (no division)
    const int64_t oy0 = g0 / grid_w, oy1 = (g1 - 1) / grid_w;
    const auto [lo0, hi0] = TapsInside(oy0 * p.stride_h - p.pad_top, kernel_h, p.dilation_h, in_h);
    const auto [lo1, hi1] = TapsInside(oy1 * p.stride_h - p.pad_top, kernel_h, p.dilation_h, in_h);
    return {std::min(lo0, lo1) * kernel_w, std::max(hi0, hi1) * kernel_w};
  }

  /*! \brief How many outputs come before grid pixel g (the output index of g when it is one). */
  int64_t OutputsBefore(int64_t g) const {
    if (grid_w == out_w) return g;  // (no division: 1x1 convs and unpadded rows)
    return g / grid_w * out_w + std::min(g % grid_w, out_w);
  }
};

constexpr int64_t kBlocks = 2;      // channel blocks per register tile
constexpr int64_t kWideBlocks = 4;  // ... on AVX-512, where the blocks come in whole fours

/*! \brief Where a tile's last taps store its P pixels straight from the registers: P
 * consecutive outputs of a channel-blocked output with a vector epilogue, from `y`; block j's
 * at y + j * OH * OW * L, its per-channel epilogue vectors `vectors[j]`. */
struct TileOutput {
  float* y;
  const BlockedRowVectors* vectors;
};

/*!
 * \brief Taps [tap0, tap1) of grid pixels [0, P) (from `x`: an image's planes advanced to the
 * first one) of NB channel blocks (their weights from `w`, `w_stride` floats apart), added to
 * `tile` ([NB][tile_pixels][L]) or, for the first taps (`tap0` 0), written to it; the
 * XB-blocked data's pixels are XB floats apart; of each input channel's taps only [lo, hi)
 * (TapsOfGrid). With an `output` (the last taps), the sums
 * instead take the epilogue in registers and are stored there: shallow convs (a stem, 1x1
 * convs of few channels) spent a large share of their time writing tiles out and reading
 * them back for the epilogue and the copy.
 */
template <int L, int P, int NB, int XB>
__attribute__((always_inline)) inline void DirectTile(const DirectConvWork& t, const float* x,
                                                      const float* w, int64_t w_stride,
                                                      int64_t tap0, int64_t tap1, int64_t lo,
                                                      int64_t hi, float* tile, int64_t tile_pixels,
                                                      const TileOutput* output = nullptr) {
  using V = typename VectorOf<L>::Type;
  static_assert(sizeof(V) == L * sizeof(float));
  V acc[NB][P];
  // (Unrolled whole: GCC leaves a loop of 24 pixels rolled, its accumulators in memory.)
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 32
    for (int q = 0; q < P; ++q) {
      acc[j][q] = V{};
      if (tap0 > 0) std::memcpy(&acc[j][q], tile + (j * tile_pixels + q) * L, sizeof(V));
    }
  // One tap: its NB weight vectors (at wt) times each pixel's value (at src).
  auto take = [&](const float* src, const float* wt) __attribute__((always_inline)) {
    V wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) std::memcpy(&wv[j], wt + j * w_stride, sizeof(V));
#pragma GCC unroll 32
    for (int q = 0; q < P; ++q) {
      const float v = src[q * XB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[j][q] += v * wv[j];
    }
  };
  // Runs of taps: one, [tap0, tap1), where every tap is taken; else [lo, hi) of each channel.
  const int64_t per_channel = t.kernel_h * t.kernel_w;
  const bool all = lo == 0 && hi == per_channel;
  const int64_t period = all ? tap1 - tap0 : per_channel;
  for (int64_t c0 = all ? tap0 : tap0 - tap0 % per_channel; c0 < tap1; c0 += period) {
    const int64_t run0 = all ? tap0 : std::max(tap0, c0 + lo);
    const int64_t run1 = all ? tap1 : std::min(tap1, c0 + hi);
    const float* wt = w + run0 * L;
    int64_t tap = run0;
    if constexpr (XB > 1) {
      // A 1x1 kernel on blocked data: the taps of one data block's XB channels read XB
      // consecutive floats, so they run unrolled from the block's first tap's offset, with
      // no offset loaded and no loop step a tap (MLAS's pointwise kernel runs a block's
      // channels the same way).
      if (per_channel == 1 && run0 % XB == 0) {
        for (; tap + XB <= run1; tap += XB, wt += XB * L) {
          const float* src = x + t.taps[tap];
          asm("" : "+r"(src));
          // With AVX2's 16 registers (8-lane blocks) the block's lanes unroll by two: unrolled
          // whole, GCC hoisted loads across them and spilled accumulators and weights to the
          // stack (MobileNetV2's 16 -> 96 1x1 conv at 112x112 ran 0.95 of its time this way,
          // one thread, AMD Zen 3).
          if constexpr (L == 8) {
#pragma GCC unroll 2
            for (int lane = 0; lane < XB; ++lane) take(src + lane, wt + lane * L);
          } else {
#pragma GCC unroll 16
            for (int lane = 0; lane < XB; ++lane) take(src + lane, wt + lane * L);
          }
        }
      }
    }
    for (; tap < run1; ++tap, wt += L) {
      const float* src = x + t.taps[tap];
      // Opaque to the optimizer, so that each pixel's load is src plus a constant (GCC
      // otherwise keeps every pixel's index in a register of its own, spilled past a dozen
      // pixels).
      asm("" : "+r"(src));
      take(src, wt);
    }
  }
  if (output != nullptr) {
    const int64_t plane = t.out_h * t.out_w * L, o = output->y - t.y;
    if (t.affine.applies) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const V bias = t.affine.Bias<V>(output->vectors[j]);
#pragma GCC unroll 32
        for (int q = 0; q < P; ++q) acc[j][q] = t.affine(acc[j][q], bias, o + j * plane + q * L);
      }
    } else {
      for (size_t i = 0; i < t.epilogue->size(); ++i) {
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j)
#pragma GCC unroll 32
          for (int q = 0; q < P; ++q) {
            acc[j][q] = BlockedEpilogueStep<L>(*t.epilogue, i, output->vectors[j], acc[j][q],
                                               o + j * plane + q * L);
          }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j)
#pragma GCC unroll 32
      for (int q = 0; q < P; ++q) std::memcpy(output->y + j * plane + q * L, &acc[j][q], sizeof(V));
    return;
  }
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 32
    for (int q = 0; q < P; ++q) std::memcpy(tile + (j * tile_pixels + q) * L, &acc[j][q], sizeof(V));
}

// Taps per slice: a chunk's tiles run the taps a slice at a time, so that the slice's weights
// (NB * L floats a tap: 16 KiB) stay in L1 across the tiles, as MLAS runs one input-channel
// block at a time over an output row. (A tile over all taps streamed the weights of a deep
// layer, 74 KiB for 64 channels, from L2 once per 12 pixels.)
constexpr int64_t kSliceBytes = 16 << 10;
// Tiles per chunk (of its widest tiles), so a slice's weights serve a dozen tiles.
constexpr int64_t kTilesPerChunk = 8;
// Up to this many bytes of weights, an image's chunks each run through all groups of channel
// blocks (DirectConvWork::ChunkAt), so the chunk's data stays in cache over the groups and the
// weights, all of them, in L2; above it (deep layers), group by group. ResNet's 1x1 convs that
// shrink the channels at 56x56 and 28x28 had streamed their 1.6-3 MiB input once per group:
// ResNet-50 ran in 0.963 of its time, ResNet-18 0.988, MobileNetV2 0.986 (one process,
// alternating; 2 MiB gave the same). A conv that copies padded rows (TaskInput) does so up to
// twice as many bytes: group by group, each thread ran every group's slots of all rows, so
// each copied the whole input, half of it written by the other core. ResNet-50's 3x3 stride-2
// 128->128 conv at 56x56 (590 KiB of weights) ran 9% faster split by rows.
constexpr int64_t kGroupsInnerWeightBytes = 512 << 10;
constexpr int64_t kGroupsInnerCopiedWeightBytes = 1 << 20;

/*! \brief Prefetch taps [tap0, tap1) of NB channel blocks' weights (`w`, blocks `w_stride`
 * floats apart) into L2. While a slice runs, DirectChunk prefetches the next slice's weights
 * this way, a share before each tile: deep layers at batch 1 stream their weights from memory
 * (ResNet-50's 2048->512 1x1 conv: 4 MiB for 49 pixels), and the hardware prefetcher stops at
 * each 4 KiB page (64 taps of a 16-lane block). ResNet-18 ran in 0.932 of its time, ResNet-50
 * 0.951 (both in one process, alternating); into L1 instead, ResNet-50 0.963. */
template <int L, int NB>
__attribute__((always_inline)) inline void PrefetchWeights(const float* w, int64_t w_stride,
                                                           int64_t tap0, int64_t tap1) {
  for (int64_t tap = tap0; tap < tap1; ++tap) {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) __builtin_prefetch(w + j * w_stride + tap * L, 0, 2);
  }
}

/*! \brief Slots [s0, s1) (a chunk) of channel blocks [b0, b0 + NB) of one image (`x`: its
 * planes), in tiles of P pixels: one row tile per slot (kRows), or the grid pixels the slots
 * cover, P at a time; one slice of taps after another; then the outputs among them stored,
 * and the epilogue on those (tiles the last slice stored from registers excepted). Weights and
 * per-channel epilogue vectors are those of block `group_block0 + b0` (a grouped conv's
 * image is one group of one image: group_block0 is the group's first output block). */
template <int L, int P, int NB, int XB, bool kRows>
__attribute__((always_inline)) inline void DirectChunk(const DirectConvWork& t, const float* x,
                                                       int64_t b0, int64_t s0, int64_t s1,
                                                       float* y_img, int64_t group_block0) {
  // One-block grid tiles (a pair's odd block) are twice as wide, so half as many.
  constexpr int64_t kTiles = kRows || NB > 1 ? kTilesPerChunk : kTilesPerChunk / kBlocks;
  alignas(64) float tiles[kTiles][NB * P * L];
  const int64_t spatial = t.out_h * t.out_w;
  // The epilogue's per-channel vectors of blocks [b0, b0 + NB) (the same for all pixels).
  std::array<BlockedRowVectors, NB> vectors;
  for (int j = 0; j < NB; ++j) {
    vectors[j] = BlockedRowVectors(*t.epilogue, (group_block0 + b0 + j) * spatial * L);
  }
  const int64_t g0 = s0 * t.slot_w, g1 = std::min(t.grid, s1 * t.slot_w);  // grid tiles' pixels
  const int64_t num_tiles = kRows ? s1 - s0 : (g1 - g0 + P - 1) / P;
  // Tile i's first grid pixel and its pixels (only a last grid tile has fewer than P).
  auto tile_start = [&](int64_t i) {
    const int64_t s = s0 + i, row_tiles = t.out_w / P;
    return kRows ? s / row_tiles * t.grid_w + s % row_tiles * P : g0 + i * P;
  };
  auto tile_size = [&](int64_t g) { return kRows ? P : std::min<int64_t>(P, g1 - g); };
  // Whether the tile at grid pixel g stores from registers (DirectTile's `output`): P
  // consecutive outputs (a row tile, a full grid tile inside one row's outputs, or any full
  // tile where the grid is the output plane) of a blocked output with a vector epilogue of
  // few instructions a step (`register_epilogue`).
  auto stored_from_registers = [&](int64_t g) {
    return t.register_epilogue &&
           (kRows || (tile_size(g) == P && (t.grid_w == t.out_w || g % t.grid_w + P <= t.out_w)));
  };
  const int64_t w_stride = t.num_taps * L;
  const float* w = t.w + (group_block0 + b0) * w_stride;
  const int64_t ch0 = b0 * L, channels = std::min<int64_t>(t.out_c - ch0, NB * L);
  float* y = y_img + ch0 * spatial;  // block b0's plane when blocked, channel ch0's when not
  const int64_t slice = std::max<int64_t>(1, kSliceBytes / (NB * L * sizeof(float)));
  for (int64_t tap0 = 0; tap0 < t.num_taps; tap0 += slice) {
    const int64_t tap1 = std::min(t.num_taps, tap0 + slice);
    // The next slice's weights, a share before each tile (see PrefetchWeights).
    const int64_t next1 = std::min(t.num_taps, tap1 + slice), share = CeilDiv(next1 - tap1, num_tiles);
    for (int64_t i = 0; i < num_tiles; ++i) {
      const int64_t g = tile_start(i), n = tile_size(g);
      const auto [lo, hi] = t.TapsOfGrid(g, g + n);
      PrefetchWeights<L, NB>(w, w_stride, tap1 + i * share, std::min(next1, tap1 + (i + 1) * share));
      if (tap1 == t.num_taps && stored_from_registers(g)) {
        const TileOutput output{y + t.OutputsBefore(g) * L, vectors.data()};
        DirectTile<L, P, NB, XB>(t, x + g * XB, w, w_stride, tap0, tap1, lo, hi, tiles[i], P, &output);
      } else if (n == P || t.slack) {
        DirectTile<L, P, NB, XB>(t, x + g * XB, w, w_stride, tap0, tap1, lo, hi, tiles[i], P);
      } else {  // a last short tile that must not read past the data: pixel by pixel
        for (int64_t q = 0; q < n; ++q) {
          DirectTile<L, 1, NB, XB>(t, x + (g + q) * XB, w, w_stride, tap0, tap1, lo, hi,
                                   tiles[i] + q * L, P);
        }
      }
    }
  }
  for (int64_t i = 0; i < num_tiles; ++i) {
    const int64_t g = tile_start(i), n = tile_size(g);
    if (stored_from_registers(g)) continue;
    float* tile = tiles[i];
    // Runs of the tile's pixels that are outputs (one row's, up to its grid columns past OW).
    for (int64_t q = 0; q < n;) {
      const int64_t oy = (g + q) / t.grid_w, ox = (g + q) % t.grid_w;
      if (ox >= t.out_w) {
        q += t.grid_w - ox;
        continue;
      }
      const int64_t run = std::min(n - q, t.out_w - ox), pixel = oy * t.out_w + ox;
      if (t.y_blocked) {  // the epilogue on the tile's vectors (in L1), on their way out
        for (int j = 0; j < NB; ++j) {
          float* out = y + (j * spatial + pixel) * L;
          float* in = tile + (j * P + q) * L;
          if (t.vector_epilogue) BlockedEpilogueVectors<L>(*t.epilogue, vectors[j], in, run, out - t.y);
          std::memcpy(out, in, run * L * sizeof(float));
        }
      } else {
        for (int j = 0; j < NB; ++j) {
          TransposeFloats(tile + (j * P + q) * L, L, run, std::min<int64_t>(L, channels - j * L),
                          y + j * L * spatial + pixel, spatial);
        }
      }
      q += run;
    }
  }
  // Row tiles partition each output row, so slot s's outputs start at s * P.
  const int64_t pixel0 = kRows ? s0 * P : t.OutputsBefore(g0);
  const int64_t pixel1 = kRows ? s1 * P : t.OutputsBefore(g1);
  if (pixel0 == pixel1 || t.epilogue->empty() || t.vector_epilogue) return;
  if (!t.y_blocked) {
    ApplyEpilogue(*t.epilogue, y + pixel0, y + pixel0 - t.y, channels, pixel1 - pixel0, spatial);
  } else {
    float* first = y + pixel0 * L;
    ApplyEpilogue(*t.epilogue, first, first - t.y, NB, (pixel1 - pixel0) * L, spatial * L);
  }
}

/*! \brief DirectChunk on NCHW (XB 1) or L-blocked data. */
template <int L, int P, int NB, bool kRows>
__attribute__((always_inline)) inline void DirectChunkOf(const DirectConvWork& t, const float* x,
                                                         int64_t b0, int64_t s0, int64_t s1,
                                                         float* y_img, int64_t group_block0) {
  if (t.x_block == 1) {
    DirectChunk<L, P, NB, 1, kRows>(t, x, b0, s0, s1, y_img, group_block0);
  } else {
    DirectChunk<L, P, NB, L, kRows>(t, x, b0, s0, s1, y_img, group_block0);
  }
}

// Pixels per tile of each instruction set's instance, two blocks / one block: 8-lane blocks
// with AVX2 (16 vector registers: 12 accumulators), 16-lane blocks with AVX-512 (32 registers:
// 24) and, for 16-lane weights on a CPU without AVX-512, with AVX2 (each vector two halves);
// AVX-512's four-block tiles hold the same 24 accumulators.
constexpr int kPixelsAvx2 = 6, kPixelsAvx512 = 12, kPixelsAvx2Wide = 3;
constexpr int kWidePixelsAvx512 = kPixelsAvx512 * kBlocks / kWideBlocks;
constexpr int kMaxTilePixels = kPixelsAvx512 * kBlocks;  // the most pixels of any tile

/*!
 * \brief The planes one task's taps read: a pointwise conv's data as it is; otherwise the
 * task's own copy of one image's zero-padded phase planes, into which the rows each chunk
 * reads are copied just before it runs. Every thread copies what its own tiles read, at the
 * start of its share, where a copy by all threads before the conv took a launch and a barrier
 * of its own and, for an image of one channel block, ran on one thread (a third of a
 * 16-channel 3x3 conv's time at 32x32); the rows a thread copies are mostly those of the
 * previous layer's output that the same thread wrote, still in its cache.
 */
class TaskInput {
 public:
  explicit TaskInput(const DirectConvWork& t) : t_(t) {
    if (t.source != nullptr) Scratch(Buffer(), t.image_floats + kMaxTilePixels * t.x_block);
  }

  /*! \brief Image `img`'s planes, their phase rows [row0, row1) (clipped to the planes) in
   * place: the rows the task has not copied since it started on this image are copied. */
  const float* Rows(int64_t img, int64_t row0, int64_t row1) {
    if (t_.source == nullptr) return t_.x + img * t_.image_floats;
    row1 = std::min(row1, t_.source->phase_h);
    if (img != image_) {
      image_ = img;
      copied0_ = copied1_ = row0;
    }
    if (row0 < copied0_) Copy(row0, copied0_);
    if (row1 > copied1_) Copy(copied1_, row1);
    copied0_ = std::min(copied0_, row0);
    copied1_ = std::max(copied1_, row1);
    return Buffer().data();
  }

 private:
  /*! \brief Phase rows [row0, row1) of every plane of the current image into the buffer. */
  void Copy(int64_t row0, int64_t row1) {
    const PhasePlanes& s = *t_.source;
    const int64_t planes = t_.image_floats / t_.plane_floats, row_floats = s.phase_w * s.element;
    float* dst = Buffer().data() + row0 * row_floats;
    for (int64_t p = 0; p < planes; ++p, dst += t_.plane_floats) {
      s.Copy(image_ * planes + p, row0, row1 - row0, dst, true, s.phase_h);
    }
  }

  static std::vector<float>& Buffer() {
    thread_local std::vector<float> buffer;
    return buffer;
  }

  const DirectConvWork& t_;
  int64_t image_ = -1, copied0_ = 0, copied1_ = 0;  // the image and rows in the buffer
};

/*! \brief Work slots [begin, end) (in DirectConvWork::ChunkAt's order) in chunks, groups of G
 * blocks. A grid tile (kRowPixels 0) is kPixels pixels of G blocks, or (G = kBlocks) twice as
 * many of a last odd block (one-block convs: all of them), the same number of accumulators; a
 * row tile is kRowPixels pixels of two blocks or of the last odd block. */
template <int L, int kPixels, int G = kBlocks, int kRowPixels = 0>
__attribute__((always_inline)) inline void DirectSlots(const DirectConvWork& t, int64_t begin,
                                                       int64_t end) {
  constexpr bool kRows = kRowPixels > 0;
  constexpr int kGroupPixels = kRows ? kRowPixels : kPixels;
  constexpr int kSinglePixels = kRows ? kRowPixels : kPixels * kBlocks;
  TaskInput input(t);
  for (int64_t pos = begin; pos < end;) {
    const auto [img, group, s0, s1] = t.ChunkAt(pos, end);
    pos += s1 - s0;
    // The grid pixels of the chunk's tiles, from its first to its last (a row tile's rows
    // whole), and the rows their taps read.
    const int64_t row_tiles = t.out_w / kGroupPixels;
    const int64_t g0 = kRows ? s0 / row_tiles * t.grid_w : s0 * t.slot_w;
    const int64_t g1 = kRows ? (s1 - 1) / row_tiles * t.grid_w + t.out_w : s1 * t.slot_w;
    const float* x = input.Rows(img, g0 / t.grid_w, (g1 - 1 + t.reach) / t.grid_w + 1);
    float* y_img = t.y + img * t.out_c * t.out_h * t.out_w;
    const int64_t b0 = group * G, group_block0 = img % t.conv_groups * t.blocks;
    if (b0 + G <= t.blocks) {
      DirectChunkOf<L, kGroupPixels, G, kRows>(t, x, b0, s0, s1, y_img, group_block0);
    } else if constexpr (G == kBlocks) {  // wide groups are whole
      DirectChunkOf<L, kSinglePixels, 1, kRows>(t, x, b0, s0, s1, y_img, group_block0);
    }
  }
}

// Row tile widths, in order of preference (AVX-512 only: with AVX2's 16 registers a
// two-block tile holds 6 pixels, no divisor of common widths), and the widest plane whose
// rows are cut into the first even where grid tiles would waste nothing.
constexpr int kRowPixelsAvx512[] = {14, 8, 7};
constexpr int64_t kMaxAlwaysRowWidth = 28;
// A conv of one block (16 output channels) takes row tiles of 16 pixels where they divide the
// output width: stored from registers with their epilogue, where its 24-pixel grid tiles
// spanned rows and went through a tile buffer (few taps make that round trip weigh):
// resnet_cnn's 3-channel stem 0.177 -> 0.145 ms, its 16->16 3x3 convs 0.393 -> 0.341,
// MobileNetV2's 32->16 1x1 at 112x112 0.090 -> 0.076.
constexpr int kOneBlockRowPixels = 16;

GIMLET_TARGET("avx2,fma")
void DirectSlotsAvx2x8(const DirectConvWork& t, int64_t begin, int64_t end) {
  DirectSlots<8, kPixelsAvx2>(t, begin, end);
}
GIMLET_TARGET("avx2,fma")
void DirectSlotsAvx2x16(const DirectConvWork& t, int64_t begin, int64_t end) {
  DirectSlots<16, kPixelsAvx2Wide>(t, begin, end);
}
GIMLET_TARGET("avx512f,avx2,fma")
void DirectSlotsAvx512(const DirectConvWork& t, int64_t begin, int64_t end) {
  static_assert(kRowPixelsAvx512[0] == 14 && kRowPixelsAvx512[1] == 8 && kRowPixelsAvx512[2] == 7);
  if (t.group_blocks == 1) {  // one block, row tiles
    DirectSlots<16, kPixelsAvx512, 1, kOneBlockRowPixels>(t, begin, end);
  } else if (t.row_w == 14) {
    DirectSlots<16, kPixelsAvx512, kBlocks, 14>(t, begin, end);
  } else if (t.row_w == 8) {
    DirectSlots<16, kPixelsAvx512, kBlocks, 8>(t, begin, end);
  } else if (t.row_w == 7) {
    DirectSlots<16, kPixelsAvx512, kBlocks, 7>(t, begin, end);
  } else if (t.group_blocks == kWideBlocks) {
    DirectSlots<16, kWidePixelsAvx512, kWideBlocks>(t, begin, end);
  } else {
    DirectSlots<16, kPixelsAvx512>(t, begin, end);
  }
}

bool CpuHasAvx512() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

bool CpuHasAvx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

/*! \brief The widest channel block the direct conv2d runs with vector instructions on this
 * CPU: 16 with AVX-512, 8 with AVX2 and FMA, else 0 (no direct kernel). */
int64_t DirectConvBlock() {
  static const int64_t block = CpuHasAvx512() ? 16 : CpuHasAvx2() ? 8 : 0;
  return block;
}

/*! \brief Runs the variant of a blocked kernel for its work's channel block on this CPU:
 * `avx2x8` for blocks of 8, `avx512` for blocks of 16 with AVX-512, else `avx2x16` (16 channels
 * as two AVX2 vectors). */
template <typename Kernel, typename Work, typename... Args>
void RunForBlock(Kernel avx2x8, Kernel avx512, Kernel avx2x16, const Work& t, Args... args) {
  (t.block == 8 ? avx2x8 : DirectConvBlock() == 16 ? avx512 : avx2x16)(t, args...);
}

/*! \brief Whether the direct conv's tiles are two-block ones, in rows wherever a row tile
 * width divides the output width: on AMD's cores, where these beat the grid tiles and the
 * four-block ones (AMD Zen 4, direct calls, two threads: ResNet's 1x1 convs at 56x56 0.94-0.98
 * of their time, its 3x3 64 -> 64 0.92, the 3x3 and 7x7 stems at 224x224 0.89 and 0.91, 1x1
 * convs at 14x14 to 32x32 0.92-0.96; on planes no row width divides, SqueezeNet's 13x13 to
 * 55x55, two-block grid tiles 0.93-1.00; MobileNetV2's few-channel 1x1 convs at 112x112
 * 1.01-1.02). Intel's (a Xeon with AVX-512) ran four-block tiles and grid tiles on planes over
 * kMaxAlwaysRowWidth wide faster. `$GIMLET_CPU_CONV_TILES` ("rows" or "grid", read per call)
 * overrides the choice, so that either runs on any AVX-512 CPU (the tests run both). */
bool TwoBlockRowTiles() {
  if (const char* tiles = std::getenv("GIMLET_CPU_CONV_TILES")) {
    if (std::strcmp(tiles, "rows") == 0) return true;
    if (std::strcmp(tiles, "grid") == 0) return false;
  }
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd = (__builtin_cpu_init(), __builtin_cpu_is("amd"));
  return amd;
#else
  return false;
#endif
}

/*! \brief The row tile width of `t`'s output on AVX-512 (`tile`: the grid tiles' width), 0 for
 * grid tiles. A conv of one block: kOneBlockRowPixels where it divides the output width.
 * Others (kRowPixelsAvx512): with `two_block_rows` (TwoBlockRowTiles), the first that divides
 * the output width. Else 14 on planes up to kMaxAlwaysRowWidth wide that it divides, unless
 * the output is one four-block group (there grid tiles read the input once, not twice:
 * MobileNetV2's 384->64 1x1 at 14x14 ran 16% faster on them); else the first that divides the
 * output width where the grid tiles would compute over 5% more pixels than there are outputs
 * (7x7 planes; not 56x56 ones, where row tiles were measured slower). */
int64_t RowTileWidth(const DirectConvWork& t, int64_t tile, bool two_block_rows) {
  if (t.blocks == 1) return t.out_w % kOneBlockRowPixels == 0 ? kOneBlockRowPixels : 0;
  if (!two_block_rows) {
    if (t.blocks != kWideBlocks && t.out_w <= kMaxAlwaysRowWidth && t.out_w % kRowPixelsAvx512[0] == 0) {
      return kRowPixelsAvx512[0];
    }
    const int64_t grid_pixels = (t.grid + tile - 1) / tile * tile;
    if (grid_pixels * 20 <= t.out_h * t.out_w * 21) return 0;
  }
  for (int w : kRowPixelsAvx512) {
    if (t.out_w % w == 0) return w;
  }
  return 0;
}

int RunDirectConvSlots(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const DirectConvWork*>(cdata);
  const auto [begin, end] = TaskRange(task_id, penv, t.work_slots);
  RunForBlock(DirectSlotsAvx2x8, DirectSlotsAvx512, DirectSlotsAvx2x16, t, begin, end);
  return 0;
}
/*!
 * \brief conv2d with weights packed as [ceil(O / B), C / G, KH, KW, B], B 8 or 16 (see
 * DirectConvBlock); data: [N, C, H, W] or channel-blocked [N, C / B, H, W, B], out:
 * [N, O, OH, OW] or [N, O / B, OH, OW, B]; G groups (the weight's input channels a G-th of the
 * data's) only with blocked data and output, each group whole blocks (ResNeXt's 32 groups of
 * 16 and 32 channels). Chunks of tiles of a group of channel blocks
 * run on TVM's pool, consecutive chunks of the same blocks on one thread (their weights stay
 * in cache).
 */
void DirectConv2D(DLTensor* data, DLTensor* weight, const Conv2DParams& p,
                  const Epilogue& epilogue, DLTensor* out) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(weight, "weight");
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK((data->ndim == 4 || data->ndim == 5) && weight->ndim == 5 &&
                 (out->ndim == 4 || out->ndim == 5))
      << "gimlet.cpu.conv2d_nchw_direct: data and out must be 4-D (NCHW) or 5-D (NCHW{B}c), the "
         "packed weight 5-D";
  const int64_t x_block = data->ndim == 5 ? data->shape[4] : 1;
  // A grouped conv (weight of C / G input channels) on blocked data and output whose groups
  // fill whole blocks runs each group of each image as an image of its own: [N, C / B, H, W, B]
  // is [N * G, C / G / B, H, W, B] in memory, and so is the output.
  const int64_t group_in_c = weight->shape[1], all_in_c = data->shape[1] * x_block;
  const int64_t conv_groups =
      group_in_c > 0 && all_in_c > group_in_c && all_in_c % group_in_c == 0 ? all_in_c / group_in_c : 1;
  const int64_t out_blocks = out->ndim == 5 ? out->shape[1] : 0;
  TVM_FFI_ICHECK(conv_groups == 1 || (x_block == weight->shape[4] && out->ndim == 5 &&
                                      group_in_c % x_block == 0 && out_blocks % conv_groups == 0))
      << "gimlet.cpu.conv2d_nchw_direct: " << conv_groups
      << " groups need blocked data and output whose groups fill whole channel blocks";
  const int64_t batch = data->shape[0] * conv_groups, in_c = all_in_c / conv_groups;
  const int64_t height = data->shape[2], width = data->shape[3];
  const int64_t kernel_h = weight->shape[2], kernel_w = weight->shape[3];
  DirectConvWork t{};
  t.conv_groups = conv_groups;
  t.w = Data(weight);
  t.x_block = x_block;
  t.y = Data(out);
  t.epilogue = &epilogue;
  t.block = weight->shape[4];
  t.y_blocked = out->ndim == 5;
  t.vector_epilogue = t.y_blocked && IsBlockedVectorEpilogue(epilogue, t.block);
  t.register_epilogue = t.vector_epilogue && !HasStoredTileStep(epilogue);
  if (t.register_epilogue) t.affine = AffineClip(epilogue);
  t.out_c = out->shape[1] * (t.y_blocked ? out->shape[4] : 1) / conv_groups;
  t.out_h = out->shape[2];
  t.out_w = out->shape[3];
  TVM_FFI_ICHECK(t.block == 8 || t.block == 16)
      << "gimlet.cpu.conv2d_nchw_direct: channel block " << t.block << " is neither 8 nor 16";
  TVM_FFI_ICHECK(DirectConvBlock() != 0)
      << "gimlet.cpu.conv2d_nchw_direct needs a CPU with AVX2 and FMA";
  t.blocks = (t.out_c + t.block - 1) / t.block;
  TVM_FFI_ICHECK(weight->shape[0] == t.blocks * conv_groups && weight->shape[1] == in_c &&
                 out->shape[0] * conv_groups == batch && (!t.y_blocked || out->shape[4] == t.block) &&
                 (x_block == 1 || x_block == t.block))
      << "gimlet.cpu.conv2d_nchw_direct: shapes differ (a blocked data's or output's block must "
         "be the packed weight's)";
  TVM_FFI_ICHECK(p.stride_h > 0 && p.stride_w > 0 && p.dilation_h > 0 && p.dilation_w > 0 &&
                 p.pad_top >= 0 && p.pad_left >= 0);
  if (batch == 0 || t.out_c == 0 || t.out_h * t.out_w == 0) return;
  const bool pointwise = kernel_h == 1 && kernel_w == 1 && p.stride_h == 1 && p.stride_w == 1 &&
                         p.pad_top == 0 && p.pad_left == 0 && t.out_h == height && t.out_w == width;
  // Stride phases and their extent: rows reach the last output's last tap (a pointwise conv's
  // data is its one phase, read as it is).
  const int64_t sh = pointwise ? 1 : p.stride_h, sw = pointwise ? 1 : p.stride_w;
  const int64_t phase_h = pointwise ? height : t.out_h + (kernel_h - 1) * p.dilation_h / sh;
  const int64_t phase_w = pointwise ? width : t.out_w + (kernel_w - 1) * p.dilation_w / sw;
  t.image_floats = in_c * sh * sw * phase_h * phase_w;
  PhasePlanes phases{Data(data), nullptr, batch * in_c / x_block, height, width, sh, sw,
                     phase_h, phase_w, p.pad_top, p.pad_left, x_block};
  t.plane_floats = sh * sw * phase_h * phase_w * x_block;
  if (pointwise) {
    t.x = Data(data);
  } else {
    if (p.dilation_h == 1) phases.copied_h = kernel_h;  // taps read phases a < KH (of SH)
    if (p.dilation_w == 1) phases.copied_w = kernel_w;
    t.source = &phases;
    t.reach = (kernel_h - 1) * p.dilation_h / sh * phase_w + (kernel_w - 1) * p.dilation_w / sw;
    t.slack = true;
  }
  t.num_taps = in_c * kernel_h * kernel_w;
  t.p = p;
  t.kernel_h = kernel_h;
  t.kernel_w = kernel_w;
  t.in_h = height;
  const auto [first, last] =
      OutputsInside(p.pad_top, p.stride_h, (kernel_h - 1) * p.dilation_h, height, t.out_h);
  t.inner_g0 = first * phase_w;
  t.inner_g1 = last * phase_w;
  thread_local std::vector<int64_t> taps;
  phases.TapOffsets(in_c, kernel_h, kernel_w, p.dilation_h, p.dilation_w, &taps);
  t.taps = taps.data();
  t.grid_w = phase_w;
  t.grid = (t.out_h - 1) * t.grid_w + t.out_w;
  const bool avx512 = t.block == 16 && DirectConvBlock() == 16;
  int64_t tile = t.block == 8 ? kPixelsAvx2 : avx512 ? kPixelsAvx512 : kPixelsAvx2Wide;
  const bool two_block_rows = TwoBlockRowTiles();
  t.row_w = avx512 ? RowTileWidth(t, tile, two_block_rows) : 0;
  const bool wide = avx512 && !two_block_rows && t.row_w == 0 && t.blocks % kWideBlocks == 0;
  t.group_blocks = t.blocks == 1 && t.row_w != 0 ? 1 : wide ? kWideBlocks : kBlocks;
  t.block_groups = (t.blocks + t.group_blocks - 1) / t.group_blocks;
  if (wide) tile = kWidePixelsAvx512;
  t.slot_w = t.row_w ? t.row_w : tile;
  t.slots = t.row_w ? t.out_h * t.out_w / t.row_w : (t.grid + tile - 1) / tile;
  t.chunk_slots = kTilesPerChunk;
  t.groups_inner = t.block_groups > 1 &&
                   t.blocks * t.block * t.num_taps * int64_t{sizeof(float)} <=
                       (pointwise ? kGroupsInnerWeightBytes : kGroupsInnerCopiedWeightBytes);
  t.work_slots = batch * t.block_groups * t.slots;
  const int64_t work = batch * t.grid * t.blocks * t.block * t.num_taps;
  const int64_t weight_bytes = t.blocks * t.block * t.num_taps * int64_t{sizeof(float)};
  Launch(RunDirectConvSlots, &t,
         work >= kMinParallelGemm || (weight_bytes >= kMinParallelConvWeightBytes && t.work_slots > 1));
}

/*!
 * \brief DirectConv2D of data * scale, `scale` one factor per input channel shared by every
 * image (a squeeze-and-excitation gate: [1, C, 1, 1] or [1, C / B, 1, 1, B]), groups 1: the
 * conv of the weight whose input channel c is scaled by scale[c]. That weight is written here,
 * on the calling thread, into its scratch buffer, so a gate costs O * C * KH * KW products
 * instead of an elementwise pass over the data (N * C * H * W, read and written).
 */
void ScaledDirectConv2D(DLTensor* data, DLTensor* scale, DLTensor* weight, const Conv2DParams& p,
                        const Epilogue& epilogue, DLTensor* out) {
  CheckCompactFloat32(scale, "scale");
  CheckCompactFloat32(weight, "weight");
  const int64_t in_c = data->shape[1] * (data->ndim == 5 ? data->shape[4] : 1);
  TVM_FFI_ICHECK(weight->ndim == 5 && weight->shape[1] == in_c &&
                 Product(scale->shape, scale->shape + scale->ndim) == in_c)
      << "gimlet.cpu.conv2d_nchw_direct_scaled: the scale must hold one factor per input "
         "channel of a groups-1 conv";
  const int64_t taps = weight->shape[2] * weight->shape[3], block = weight->shape[4];
  const int64_t per_channel = taps * block, blocks = weight->shape[0];
  thread_local std::vector<float> buffer;
  float* scaled = Scratch(buffer, static_cast<size_t>(blocks * in_c * per_channel));
  const float* w = Data(weight);
  const float* factor = Data(scale);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t c = 0; c < in_c; ++c) {
      const int64_t at = (b * in_c + c) * per_channel;
      for (int64_t i = 0; i < per_channel; ++i) scaled[at + i] = w[at + i] * factor[c];
    }
  }
  DLTensor scaled_weight = *weight;
  scaled_weight.data = scaled;
  scaled_weight.byte_offset = 0;
  DirectConv2D(data, &scaled_weight, p, epilogue, out);
}

// ---------------------------------------------------------------------------------------------
// conv2d, row-vectorized: for convs with a short reduction (a network's 3-channel stem), where a
// channel-block tile spends more time scattering its lanes into NCHW rows than multiplying.
// Here a vector holds L consecutive output pixels of one row, multiplied per tap with T
// broadcast weights (T output channels), and stored straight into the NCHW output. The data is
// first copied into zero-padded phase planes, one per (row, column) phase of the stride, so that
// consecutive outputs read consecutive inputs at every tap, whatever the stride and dilation.

/*! \brief One row-vectorized conv2d call (groups 1): units of one output row of T channels. */
struct RowConvWork {
  const float* phases;  // [N, C, SH, SW, PH, PW]: phase (a, b) at [i, j] = padded x[i*SH + a, j*SW + b]
  const float* w;       // [ceil(O / T), C, KH, KW, T], zero past O
  const int64_t* taps;  // [C * KH * KW]: where each tap reads in an image's planes, for output (0, 0)
  int64_t num_taps;
  float* y;             // [N, O, OH, OW]
  const Epilogue* epilogue;
  int64_t in_c, out_c, kernel_h, kernel_w, out_h, out_w;
  Conv2DParams p;
  int64_t height, width;     // of the unpadded data
  int64_t phase_h, phase_w;  // PH, PW
  int64_t lanes;             // L: 16 (AVX-512) or 8 (AVX2)
  int64_t channel_groups;    // ceil(O / T)
  int64_t num_units;         // N * channel_groups * OH
};

/*! \brief NV vectors of output pixels [ox, ox + NV * L) (the last one cut at `n` pixels) of T
 * channels, their first at `y`, the row's input at `x`. */
template <int L, int T, int NV>
__attribute__((always_inline)) inline void RowVectors(const RowConvWork& t, const float* x,
                                                      const float* w, int64_t channels, int64_t n,
                                                      float* y) {
  using V = typename VectorOf<L>::Type;
  const int64_t spatial = t.out_h * t.out_w;
  V acc[T][NV];
  for (int j = 0; j < T; ++j)
    for (int k = 0; k < NV; ++k) acc[j][k] = V{};
  for (int64_t tap = 0; tap < t.num_taps; ++tap, w += T) {
    V v[NV];
    for (int k = 0; k < NV; ++k) std::memcpy(&v[k], x + t.taps[tap] + k * L, sizeof(V));
    for (int j = 0; j < T; ++j)
      for (int k = 0; k < NV; ++k) acc[j][k] += v[k] * w[j];
  }
  for (int j = 0; j < channels; ++j) {
    for (int k = 0; k + 1 < NV; ++k) std::memcpy(y + j * spatial + k * L, &acc[j][k], sizeof(V));
    std::memcpy(y + j * spatial + (NV - 1) * L, &acc[j][NV - 1], n * sizeof(float));
  }
}

/*! \brief Output channels [group * T, group * T + T) of row `oy` of one image (`phases`: its
 * planes, `y_img`: its output), kVectors vectors of L pixels at a time, then one at a time,
 * then the epilogue; channels past O are computed (zero weights) but not stored. */
template <int L, int T>
__attribute__((always_inline)) inline void RowTile(const RowConvWork& t, const float* phases,
                                                   int64_t group, int64_t oy, float* y_img) {
  constexpr int kVectors = 2;  // each broadcast weight multiplies two input vectors
  const int64_t spatial = t.out_h * t.out_w;
  const int64_t o0 = group * T, channels = std::min<int64_t>(T, t.out_c - o0);
  const float* w = t.w + group * t.num_taps * T;
  const float* x = phases + oy * t.phase_w;
  float* y = y_img + o0 * spatial + oy * t.out_w;
  int64_t ox = 0;
  for (; ox + kVectors * L <= t.out_w; ox += kVectors * L) {
    RowVectors<L, T, kVectors>(t, x + ox, w, channels, L, y + ox);
  }
  for (; ox < t.out_w; ox += L) {
    RowVectors<L, T, 1>(t, x + ox, w, channels, std::min<int64_t>(L, t.out_w - ox), y + ox);
  }
  if (!t.epilogue->empty()) ApplyEpilogue(*t.epilogue, y, y - t.y, channels, t.out_w, spatial);
}

/*! \brief Units [begin, end): unit = (image * channel_groups + group) * OH + row. */
template <int L, int T>
__attribute__((always_inline)) inline void RowUnits(const RowConvWork& t, int64_t begin, int64_t end) {
  const int64_t phases_per_image = t.in_c * t.p.stride_h * t.p.stride_w * t.phase_h * t.phase_w;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t oy = unit % t.out_h, group = unit / t.out_h % t.channel_groups;
    const int64_t img = unit / t.out_h / t.channel_groups;
    RowTile<L, T>(t, t.phases + img * phases_per_image, group, oy,
                  t.y + img * t.out_c * t.out_h * t.out_w);
  }
}

// Output channels per tile: 2 x T accumulators of L lanes (AVX-512: 16 of its 32 registers;
// AVX2: 12 of 16), each tap two input vectors and T broadcast weights.
constexpr int kRowChannelsAvx512 = 8, kRowChannelsAvx2 = 6;

GIMLET_TARGET("avx2,fma")
void RowUnitsAvx2(const RowConvWork& t, int64_t begin, int64_t end) {
  RowUnits<8, kRowChannelsAvx2>(t, begin, end);
}
GIMLET_TARGET("avx512f,avx2,fma")
void RowUnitsAvx512(const RowConvWork& t, int64_t begin, int64_t end) {
  RowUnits<16, kRowChannelsAvx512>(t, begin, end);
}

int RunRowConvUnits(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const RowConvWork*>(cdata);
  const auto [begin, end] = TaskRange(task_id, penv, t.num_units);
  if (t.lanes == 16) {
    RowUnitsAvx512(t, begin, end);
  } else {
    RowUnitsAvx2(t, begin, end);
  }
  return 0;
}

/*!
 * \brief NCHW conv2d (groups 1), OIHW weights as they are, output vectorized along its rows
 * (see RowConvWork), `lanes` (16 or 8) at a time: 16 on a CPU with AVX-512, else 8 (AVX2).
 */
void RowConv2D(DLTensor* data, DLTensor* weight, const Conv2DParams& p, int64_t lanes,
               const Epilogue& epilogue, DLTensor* out) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(weight, "weight");
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK(data->ndim == 4 && weight->ndim == 4 && out->ndim == 4)
      << "gimlet.cpu.conv2d_nchw_rows: data, weight and out must be 4-D";
  TVM_FFI_ICHECK(lanes == 8 || lanes == 16) << "gimlet.cpu.conv2d_nchw_rows: " << lanes << " lanes";
  TVM_FFI_ICHECK(DirectConvBlock() != 0) << "gimlet.cpu.conv2d_nchw_rows needs a CPU with AVX2 and FMA";
  lanes = std::min(lanes, DirectConvBlock());
  const int64_t batch = data->shape[0];
  RowConvWork t{nullptr, Data(weight), nullptr, 0, Data(out), &epilogue, data->shape[1], out->shape[1],
                weight->shape[2], weight->shape[3], out->shape[2], out->shape[3], p,
                data->shape[2], data->shape[3]};
  TVM_FFI_ICHECK(weight->shape[0] == t.out_c && weight->shape[1] == t.in_c && out->shape[0] == batch)
      << "gimlet.cpu.conv2d_nchw_rows: shapes differ";
  TVM_FFI_ICHECK(p.stride_h > 0 && p.stride_w > 0 && p.dilation_h > 0 && p.dilation_w > 0 &&
                 p.pad_top >= 0 && p.pad_left >= 0);
  if (batch == 0 || t.out_c == 0 || t.out_h * t.out_w == 0) return;
  t.lanes = lanes;
  // Rows reach the last output's last tap; columns also the last vector's last lane.
  t.phase_h = t.out_h + (t.kernel_h - 1) * p.dilation_h / p.stride_h;
  t.phase_w = (t.out_w + lanes - 1) / lanes * lanes + (t.kernel_w - 1) * p.dilation_w / p.stride_w;
  thread_local std::vector<float> phases;
  PhasePlanes copy{Data(data), nullptr, batch * t.in_c, t.height, t.width, p.stride_h, p.stride_w,
                   t.phase_h, t.phase_w, p.pad_top, p.pad_left};
  const int64_t phase_floats = copy.planes * p.stride_h * p.stride_w * t.phase_h * t.phase_w;
  copy.phases = Scratch(phases, phase_floats);
  Launch(RunPhasePlanes, &copy, phase_floats >= kMinParallelCopy);
  t.phases = copy.phases;
  const int64_t channels = lanes == 16 ? kRowChannelsAvx512 : kRowChannelsAvx2;
  t.channel_groups = (t.out_c + channels - 1) / channels;
  // The weights as [ceil(O / T), C * KH * KW, T]: a tap's T weights are adjacent (small: these
  // convs have fewer than 32 taps per output channel).
  const int64_t taps = t.in_c * t.kernel_h * t.kernel_w;
  thread_local std::vector<float> packed;
  packed.assign(t.channel_groups * taps * channels, 0.0f);
  const float* w = Data(weight);
  for (int64_t o = 0; o < t.out_c; ++o) {
    for (int64_t tap = 0; tap < taps; ++tap) {
      packed[(o / channels * taps + tap) * channels + o % channels] = w[o * taps + tap];
    }
  }
  t.w = packed.data();
  thread_local std::vector<int64_t> offsets;
  copy.TapOffsets(t.in_c, t.kernel_h, t.kernel_w, p.dilation_h, p.dilation_w, &offsets);
  t.taps = offsets.data();
  t.num_taps = taps;
  t.num_units = batch * t.channel_groups * t.out_h;
  const int64_t work = batch * t.out_c * t.out_h * t.out_w * t.in_c * t.kernel_h * t.kernel_w;
  Launch(RunRowConvUnits, &t, work >= kMinParallelGemm);
}

// ---------------------------------------------------------------------------------------------
// conv2d, depthwise: each output channel reads one input channel (MobileNet's 3x3 and 5x5
// layers: 9 or 25 multiply-adds per output, so the kernel is bound by loads, not by FMAs).
// As in the row kernel, a vector holds L consecutive output pixels of a row and every tap reads
// stride-phase planes; here each unit copies only the phase rows it reads, of one channel, into
// a per-thread buffer that stays in L1, and each tap's weight is one broadcast.

/*! \brief One depthwise conv2d call: units of a few output rows of one (image, channel). */
struct DepthwiseWork {
  PhasePlanes source;   // the data planes [N * C], each unit's phase rows copied from them
  const float* w;       // [O, 1, KH, KW]: output channel o reads input channel o / multiplier
  const int64_t* taps;  // [KH * KW]: where each tap reads in a unit's buffer, for its output (0, 0)
  int64_t num_taps;
  float* y;             // [N, O, OH, OW]
  const Epilogue* epilogue;
  int64_t in_c, out_c, multiplier, out_h, out_w;
  int64_t lanes;          // L: 16 (AVX-512) or 8 (AVX2)
  int64_t buffer_rows;    // phase rows per phase in a unit's buffer: rows_per_unit + the taps' reach
  int64_t rows_per_unit, units_per_plane, num_units;  // num_units: N * O * units_per_plane
  int64_t square_kernel = 0, square_stride = 0;  // K and S of a K x K kernel, stride S, dilation 1
};

/*! \brief L output pixels at `y` and at the same column of the NR - 1 rows after it (`pitch`
 * floats apart in y, `x_pitch` in the buffer, whose phases are `phase_size` floats apart), their
 * input at `x`; the weights, broadcast, in `wv`. A K x K kernel with stride S (dilation 1) has
 * its taps' offsets computed here: the rows' taps that read the same input vector then share
 * one load (3x3, stride 1, 4 rows: 18 loads instead of 36); K = 0 reads `num_taps` offsets
 * from `taps`. The NR rows' accumulators are independent multiply-add chains. A vector is
 * stored whole where that stays before `y_end` (into the next row, at a row shorter than a
 * vector: the rows are stored in order, so the next one overwrites it), else cut there. */
template <int L, int NR, int K, int S>
__attribute__((always_inline)) inline void DepthwiseColumn(
    const int64_t* taps, const typename VectorOf<L>::Type* wv, int64_t num_taps, const float* x,
    int64_t x_pitch, int64_t phase_size, float* y, int64_t pitch, const float* y_end) {
  using V = typename VectorOf<L>::Type;
  V acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = V{};
  if constexpr (K > 0) {
    for (int kh = 0; kh < K; ++kh) {
      for (int kw = 0; kw < K; ++kw) {
        const float* tap = x + (kh / S) * x_pitch + (kh % S * S + kw % S) * phase_size + kw / S;
        for (int r = 0; r < NR; ++r) {
          V v;
          std::memcpy(&v, tap + r * x_pitch, sizeof(V));
          acc[r] += v * wv[kh * K + kw];
        }
      }
    }
  } else {
    for (int64_t tap = 0; tap < num_taps; ++tap) {
      for (int r = 0; r < NR; ++r) {
        V v;
        std::memcpy(&v, x + r * x_pitch + taps[tap], sizeof(V));
        acc[r] += v * wv[tap];
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    float* out = y + r * pitch;
    if (out + L <= y_end) {
      std::memcpy(out, &acc[r], sizeof(V));
    } else {  // a memcpy of fewer floats is a call or a byte loop
      for (int64_t q = 0; q < y_end - out; ++q) out[q] = acc[r][q];
    }
  }
}

/*! \brief Output rows [oy, oy + NR) of a unit, vector by vector along the rows; a row at least
 * a vector long ends with a vector that overlaps the one before it (recomputing a few pixels
 * instead of storing part of a vector). */
template <int L, int NR, int K, int S>
__attribute__((always_inline)) inline void DepthwiseRows(
    const DepthwiseWork& t, const int64_t* taps, const typename VectorOf<L>::Type* wv,
    const float* x, float* y, const float* y_end) {
  const int64_t last = std::max<int64_t>(t.out_w - L, 0);
  for (int64_t ox = 0; ox < t.out_w; ox += L) {
    const int64_t column = std::min(ox, last);
    DepthwiseColumn<L, NR, K, S>(taps, wv, t.num_taps, x + column, t.source.phase_w,
                                 t.buffer_rows * t.source.phase_w, y + column, t.out_w, y_end);
  }
}

/*! \brief Units [begin, end): unit = (image * O + channel) * units_per_plane + row block; each
 * copies its phase rows, runs kRows rows at a time (then the rest), then applies the epilogue
 * to its rows. */
template <int L, int K, int S>
__attribute__((always_inline)) inline void DepthwiseUnits(const DepthwiseWork& t, int64_t begin,
                                                          int64_t end) {
  using V = typename VectorOf<L>::Type;
  constexpr int KT = K * K;
  constexpr int kRows = 4;  // independent accumulators
  const PhasePlanes& s = t.source;
  thread_local std::vector<float> buffer;
  buffer.assign(s.stride_h * s.stride_w * t.buffer_rows * s.phase_w, 0.0f);  // padding columns
  // The channel's weights, each broadcast to a vector: in registers for an unrolled kernel.
  V unrolled[KT ? KT : 1];
  thread_local std::vector<V> generic;
  generic.resize(KT ? 0 : t.num_taps);
  V* wv = KT ? unrolled : generic.data();
  const int64_t* taps = t.taps;
  const int64_t spatial = t.out_h * t.out_w;
  // unit = plane * units_per_plane + block, plane = image * O + o, counted up without divisions
  // (they cost as much as a small plane's multiply-adds).
  int64_t block = begin % t.units_per_plane, plane = begin / t.units_per_plane;
  int64_t o = plane % t.out_c;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t oy0 = block * t.rows_per_unit, oy1 = std::min(t.out_h, oy0 + t.rows_per_unit);
    // The data plane: image * C + o / multiplier, as O = C * multiplier.
    s.Copy(t.multiplier == 1 ? plane : plane / t.multiplier, oy0, t.buffer_rows, buffer.data(), false);
    const float* w = t.w + o * t.num_taps;
    for (int64_t tap = 0; tap < (KT ? KT : t.num_taps); ++tap) wv[tap] = V{} + w[tap];
    float* y = t.y + plane * spatial + oy0 * t.out_w;
    const float* y_end = y + (oy1 - oy0) * t.out_w;
    int64_t oy = oy0;
    for (; oy + kRows <= oy1; oy += kRows) {
      DepthwiseRows<L, kRows, K, S>(t, taps, wv, buffer.data() + (oy - oy0) * s.phase_w,
                                  y + (oy - oy0) * t.out_w, y_end);
    }
    const float* x = buffer.data() + (oy - oy0) * s.phase_w;
    float* y_rows = y + (oy - oy0) * t.out_w;
    switch (oy1 - oy) {
      case 3: DepthwiseRows<L, 3, K, S>(t, taps, wv, x, y_rows, y_end); break;
      case 2: DepthwiseRows<L, 2, K, S>(t, taps, wv, x, y_rows, y_end); break;
      case 1: DepthwiseRows<L, 1, K, S>(t, taps, wv, x, y_rows, y_end); break;
      default: break;
    }
    if (!t.epilogue->empty()) {
      ApplyEpilogue(*t.epilogue, y, y - t.y, 1, (oy1 - oy0) * t.out_w, spatial);
    }
    if (++block == t.units_per_plane) {
      block = 0;
      ++plane;
      if (++o == t.out_c) o = 0;
    }
  }
}

/*! \brief The units with MobileNet's kernels (3x3 and 5x5, stride 1 or 2 both ways, no
 * dilation) unrolled, others generic. */
template <int L>
__attribute__((always_inline)) inline void DepthwiseUnitsOf(const DepthwiseWork& t, int64_t begin,
                                                            int64_t end) {
  switch (t.square_kernel * 10 + t.square_stride) {
    case 31: return DepthwiseUnits<L, 3, 1>(t, begin, end);
    case 32: return DepthwiseUnits<L, 3, 2>(t, begin, end);
    case 51: return DepthwiseUnits<L, 5, 1>(t, begin, end);
    case 52: return DepthwiseUnits<L, 5, 2>(t, begin, end);
    default: return DepthwiseUnits<L, 0, 1>(t, begin, end);
  }
}

GIMLET_TARGET("avx2,fma")
void DepthwiseUnitsAvx2(const DepthwiseWork& t, int64_t begin, int64_t end) {
  DepthwiseUnitsOf<8>(t, begin, end);
}
GIMLET_TARGET("avx512f,avx2,fma")
void DepthwiseUnitsAvx512(const DepthwiseWork& t, int64_t begin, int64_t end) {
  DepthwiseUnitsOf<16>(t, begin, end);
}

int RunDepthwiseUnits(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const DepthwiseWork*>(cdata);
  const auto [begin, end] = TaskRange(task_id, penv, t.num_units);
  if (t.lanes == 16) {
    DepthwiseUnitsAvx512(t, begin, end);
  } else {
    DepthwiseUnitsAvx2(t, begin, end);
  }
  return 0;
}

// Output pixels per unit (at most; whole rows): its buffer and output rows stay in L1.
constexpr int64_t kDepthwisePixels = 1024;

/*!
 * \brief Depthwise NCHW conv2d: data [N, C, H, W], weight [O, 1, KH, KW] with O a multiple of
 * C (output channel o reads input channel o / (O / C)), out [N, O, OH, OW]; vectors of `lanes`
 * (16 or 8) output pixels along a row: 16 on a CPU with AVX-512, else 8 (AVX2).
 */
void DepthwiseConv2D(DLTensor* data, DLTensor* weight, const Conv2DParams& p, int64_t lanes,
                     const Epilogue& epilogue, DLTensor* out) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(weight, "weight");
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK(data->ndim == 4 && weight->ndim == 4 && out->ndim == 4)
      << "gimlet.cpu.conv2d_nchw_depthwise: data, weight and out must be 4-D";
  TVM_FFI_ICHECK(lanes == 8 || lanes == 16)
      << "gimlet.cpu.conv2d_nchw_depthwise: " << lanes << " lanes";
  TVM_FFI_ICHECK(DirectConvBlock() != 0)
      << "gimlet.cpu.conv2d_nchw_depthwise needs a CPU with AVX2 and FMA";
  const int64_t batch = data->shape[0], in_c = data->shape[1], out_c = out->shape[1];
  TVM_FFI_ICHECK(weight->shape[0] == out_c && weight->shape[1] == 1 && out->shape[0] == batch &&
                 in_c > 0 && out_c % in_c == 0)
      << "gimlet.cpu.conv2d_nchw_depthwise: shapes differ (weight must be [O, 1, KH, KW], O a "
         "multiple of the data's channels)";
  TVM_FFI_ICHECK(p.stride_h > 0 && p.stride_w > 0 && p.dilation_h > 0 && p.dilation_w > 0 &&
                 p.pad_top >= 0 && p.pad_left >= 0)
      << "gimlet.cpu.conv2d_nchw_depthwise: strides and dilations must be positive, pads not negative";
  const int64_t kernel_h = weight->shape[2], kernel_w = weight->shape[3];
  const int64_t out_h = out->shape[2], out_w = out->shape[3];
  if (batch == 0 || out_c == 0 || out_h * out_w == 0) return;
  // Rows of at most 8 pixels fill an 8-lane vector: 16 lanes would compute as many wasted ones.
  lanes = out_w <= 8 ? 8 : std::min(lanes, DirectConvBlock());
  // A row's last vector reads up to its last lane; the taps reach (K - 1) * D / S further.
  const int64_t phase_w = (out_w + lanes - 1) / lanes * lanes + (kernel_w - 1) * p.dilation_w / p.stride_w;
  const int64_t reach = (kernel_h - 1) * p.dilation_h / p.stride_h;
  const int64_t planes = batch * out_c;
  const int64_t budget_rows = std::max<int64_t>(1, kDepthwisePixels / out_w);
  // At least 4 units in all, so two threads get balanced work on a few channels.
  const int64_t balance_rows = std::max<int64_t>(1, out_h * planes / 4);
  const int64_t rows_per_unit = std::min({budget_rows, balance_rows, out_h});
  const int64_t units_per_plane = (out_h + rows_per_unit - 1) / rows_per_unit;
  DepthwiseWork t{{Data(data), nullptr, batch * in_c, data->shape[2], data->shape[3], p.stride_h,
                   p.stride_w, 0, phase_w, p.pad_top, p.pad_left},
                  Data(weight), nullptr, kernel_h * kernel_w, Data(out), &epilogue, in_c, out_c,
                  out_c / in_c, out_h, out_w, lanes, rows_per_unit + reach, rows_per_unit,
                  units_per_plane, planes * units_per_plane};
  // Tap (kh, kw) of output (oy, ox) reads phase (kh * DH % SH, kw * DW % SW) at row
  // oy + kh * DH / SH, column ox + kw * DW / SW.
  thread_local std::vector<int64_t> offsets;
  offsets.resize(t.num_taps);
  const int64_t phase_size = t.buffer_rows * phase_w;
  for (int64_t kh = 0, tap = 0; kh < kernel_h; ++kh) {
    for (int64_t kw = 0; kw < kernel_w; ++kw, ++tap) {
      const int64_t a = kh * p.dilation_h % p.stride_h, b = kw * p.dilation_w % p.stride_w;
      offsets[tap] = (a * p.stride_w + b) * phase_size + kh * p.dilation_h / p.stride_h * phase_w +
                     kw * p.dilation_w / p.stride_w;
    }
  }
  t.taps = offsets.data();
  if (kernel_h == kernel_w && p.stride_h == p.stride_w && p.dilation_h == 1 && p.dilation_w == 1) {
    t.square_kernel = kernel_h;
    t.square_stride = p.stride_h;
  }
  Launch(RunDepthwiseUnits, &t, planes * out_h * out_w * t.num_taps >= kMinParallelGemm);
}

// ---------------------------------------------------------------------------------------------
// conv2d, depthwise on channel-blocked data (NCHW{B}c: [N, C / B, H, W, B]): one vector holds
// the B channels of one pixel, so every tap is a vector load of the (zero-padded) input and one
// multiply-add with the tap's B weights, whatever the stride and dilation; a register tile is
// kDepthwiseTile consecutive output pixels of a row, the taps' weights in registers.

/*! \brief One blocked depthwise call: units of one output row of one channel block, in the
 * order (image, band, block, row in the band), the tasks taking equal runs of them. */
struct BlockedDepthwiseWork {
  const float* x;  // [N, C / B, H, W, B]
  const float* w;  // [C / B, KH, KW, B]
  float* y;        // [N, C / B, OH, OW, B]
  const Epilogue* epilogue;
  int64_t blocks, height, width;  // of x: C / B, H, W
  int64_t kernel_h, kernel_w, out_h, out_w;
  Conv2DParams p;
  int64_t block;         // B
  bool vector_epilogue;  // IsBlockedVectorEpilogue
  bool register_epilogue;  // ... without a stored tile's step (applied to a stored row instead)
  int64_t num_units;     // N * C / B * OH
  int64_t bands;         // bands of output rows per image (DepthwiseBands)
  AffineClip affine;     // the register epilogue's form, where it has it
};

// An image the threads share (batch 1 on 2 threads) is cut into one band of output rows per
// thread, each band through every channel block, where a band's rows of one block hold at
// least this many bytes. The direct conv before and after a depthwise conv splits such an
// image by rows too, so each thread reads the rows its own core wrote; split by channel blocks,
// half of every block came from the other core. MobileNetV2 ran in 0.97 of its time (one
// process, alternating; its depthwise convs on 112x112 and 56x56 inputs 0.69-0.94 of their
// time, the 1x1 convs after them 0.77-0.95). Bands of shorter runs (its 14x14 and 7x7 planes,
// 2-6 KiB a block) ran 1.2-1.6x slower: each block's band is a short sequential run where the
// block split reads one long one.
constexpr int64_t kDepthwiseBandBytes = 16 << 10;

/*! \brief Row bands per image for `num_tasks` tasks (see kDepthwiseBandBytes), else 1: up to
 * one per task, each of ceil(OH / tasks) rows but the last, none empty (5 rows on 4 tasks: 3
 * bands of 2, 2 and 1 rows). */
int64_t DepthwiseBands(const BlockedDepthwiseWork& t, int64_t batch, int64_t num_tasks) {
  const int64_t band_bytes = t.out_h / num_tasks * t.out_w * t.block * int64_t{sizeof(float)};
  if (batch >= num_tasks || band_bytes < kDepthwiseBandBytes) return 1;
  return CeilDiv(t.out_h, CeilDiv(t.out_h, num_tasks));
}

/*! \brief A walk over units in BlockedDepthwiseWork's order from a given one, without a
 * division per unit (a 7x7 plane's unit is a few hundred multiply-adds). */
class DepthwiseUnitWalk {
 public:
  DepthwiseUnitWalk(const BlockedDepthwiseWork& t, int64_t unit)
      : t_(t), band_rows_((t.out_h + t.bands - 1) / t.bands) {
    const int64_t image_units = t.blocks * t.out_h, r = unit % image_units;
    image_ = unit / image_units;
    band_ = r / (t.blocks * band_rows_);
    rows_ = std::min(band_rows_, t.out_h - band_ * band_rows_);
    const int64_t k = r - band_ * t.blocks * band_rows_;
    block_ = k / rows_;
    row_ = k % rows_;
  }

  int64_t plane() const { return image_ * t_.blocks + block_; }  // image * blocks + block
  int64_t output_row() const { return band_ * band_rows_ + row_; }

  void Next() {
    if (++row_ < rows_) return;
    row_ = 0;
    if (++block_ < t_.blocks) return;
    block_ = 0;
    if (++band_ == t_.bands) {
      band_ = 0;
      ++image_;
    }
    rows_ = std::min(band_rows_, t_.out_h - band_ * band_rows_);
  }

 private:
  const BlockedDepthwiseWork& t_;
  const int64_t band_rows_;
  int64_t image_, band_, block_, row_, rows_;  // rows_: the current band's
};

constexpr int kDepthwiseTile = 8;

/*!
 * \brief T output pixels of a row into `y` (element offset `o` in the output): input column
 * `ix0` + q * stride for pixel q at tap column 0, taps rows [kh0, kh1) (those inside the input,
 * `rows[kh]` each), the block's K x K taps' weights in `wv` (K 0: t.kernel_h x t.kernel_w, read
 * from `w`), then the vector epilogue, if any. With kChecked, taps outside the input's columns
 * are skipped (zero padding); without, all are inside.
 */
template <int L, int T, int K, int S, bool kChecked>
__attribute__((always_inline)) inline void BlockedDepthwiseTile(
    const BlockedDepthwiseWork& t, const float* const* rows, int64_t kh0, int64_t kh1, int64_t ix0,
    const typename VectorOf<L>::Type* wv, const float* w, const BlockedRowVectors& vectors,
    float* y, int64_t o) {
  using V = typename VectorOf<L>::Type;
  const int64_t kernel_w = K ? K : t.kernel_w;
  const int64_t stride_w = S ? S : t.p.stride_w, dilation_w = S ? 1 : t.p.dilation_w;
  V acc[T];
  for (int q = 0; q < T; ++q) acc[q] = V{};
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    // The row at the tile's first tap, opaque to the optimizer: each pixel's load is then
    // src plus a constant where the stride is fixed (S set), where GCC had kept each pixel's
    // offset in a vector register of its own, moved to an address register before every
    // multiply-add. MobileNetV2's 3x3 depthwise convs on one thread (AMD Zen 4, direct
    // calls): 144 channels at 56x56 172 -> 156 us, 96 at 112x112 stride 2 162 -> 118.
    const float* src = rows[kh] + ix0 * L;
    asm("" : "+r"(src));
    for (int64_t kw = 0; kw < kernel_w; ++kw) {
      V weight;
      if (K) {
        weight = wv[kh * K + kw];
      } else {
        std::memcpy(&weight, w + (kh * kernel_w + kw) * L, sizeof(V));
      }
      for (int q = 0; q < T; ++q) {
        const int64_t dx = q * stride_w + kw * dilation_w;
        if (kChecked && (ix0 + dx < 0 || ix0 + dx >= t.width)) continue;
        V v;
        std::memcpy(&v, src + dx * L, sizeof(V));
        acc[q] += v * weight;
      }
    }
  }
  if (t.affine.applies) {
    const V bias = t.affine.Bias<V>(vectors);
    for (int q = 0; q < T; ++q) {
      const V v = t.affine(acc[q], bias, o + q * L);
      std::memcpy(y + q * L, &v, sizeof(V));
    }
    return;
  }
  for (int q = 0; q < T; ++q) {
    const V v = t.register_epilogue ? BlockedEpilogueVector<L>(*t.epilogue, vectors, acc[q], o + q * L)
                                    : acc[q];
    std::memcpy(y + q * L, &v, sizeof(V));
  }
}

/*! \brief Units [begin, end) (see BlockedDepthwiseWork) with K x K taps (K 0: any) at
 * column stride S with dilation 1 (S 0: any stride and dilation): tiles of up to
 * kDepthwiseTile pixels whose taps are all inside the input, pixel by pixel (bounds checked)
 * at the padded borders; no padded copy of the data. */
template <int L, int K, int S>
__attribute__((always_inline)) inline void BlockedDepthwiseRows(const BlockedDepthwiseWork& t,
                                                                int64_t begin, int64_t end) {
  using V = typename VectorOf<L>::Type;
  constexpr int kMaxRows = 16;  // taps rows (BlockedDepthwiseConv2D checks)
  const Conv2DParams& p = t.p;
  const int64_t reach = (t.kernel_w - 1) * p.dilation_w;  // of a pixel's taps, in columns
  // Output columns [inside0, inside1) read only input columns; tiles of 8, then 4, 2 and 1
  // pixels cover them. In tiles of 8 alone, the 6 inner columns of an 8-wide padded row and
  // the last 7 of a 56-wide one went pixel by pixel, bounds checked: mobilenet_cnn's 8x8
  // depthwise conv ran 44 -> 35 us on one thread, the model in 0.973 of its time, MobileNetV2
  // 0.987 (on two threads no faster: 0.99-1.01, alternating in one process).
  const auto [inside0, inside1] = OutputsInside(p.pad_left, p.stride_w, reach, t.width, t.out_w);
  DepthwiseUnitWalk walk(t, begin);
  for (int64_t unit = begin; unit < end; ++unit, walk.Next()) {
    const int64_t oy = walk.output_row(), plane = walk.plane();
    const float* x_plane = t.x + plane * t.height * t.width * L;
    const float* w = t.w + plane % t.blocks * t.kernel_h * t.kernel_w * L;
    float* y = t.y + (plane * t.out_h + oy) * t.out_w * L;
    const int64_t o = y - t.y;
    // The taps rows inside the input: [kh0, kh1) (not a structured binding: C++17 lambdas
    // cannot capture one).
    const int64_t iy0 = oy * p.stride_h - p.pad_top;
    int64_t kh0, kh1;
    std::tie(kh0, kh1) = TapsInside(iy0, t.kernel_h, p.dilation_h, t.height);
    const float* rows[kMaxRows];
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      rows[kh] = x_plane + (iy0 + kh * p.dilation_h) * t.width * L;
    }
    V wv[K ? K * K : 1];
    for (int i = 0; i < K * K; ++i) std::memcpy(&wv[i], w + i * L, sizeof(V));
    const BlockedRowVectors vectors(*t.epilogue, o);
    auto tile = [&](auto pixels, auto checked, int64_t ox) __attribute__((always_inline)) {
      BlockedDepthwiseTile<L, decltype(pixels)::value, K, S, decltype(checked)::value>(
          t, rows, kh0, kh1, ox * p.stride_w - p.pad_left, wv, w, vectors, y + ox * L, o + ox * L);
      return ox + decltype(pixels)::value;
    };
    using Checked = std::true_type;
    using Inside = std::false_type;
    int64_t ox = 0;
    while (ox < inside0) ox = tile(std::integral_constant<int, 1>{}, Checked{}, ox);
    while (ox + kDepthwiseTile <= inside1) {
      ox = tile(std::integral_constant<int, kDepthwiseTile>{}, Inside{}, ox);
    }
    if (ox + 4 <= inside1) ox = tile(std::integral_constant<int, 4>{}, Inside{}, ox);
    if (ox + 2 <= inside1) ox = tile(std::integral_constant<int, 2>{}, Inside{}, ox);
    if (ox < inside1) ox = tile(std::integral_constant<int, 1>{}, Inside{}, ox);
    while (ox < t.out_w) ox = tile(std::integral_constant<int, 1>{}, Checked{}, ox);
    if (t.vector_epilogue && !t.register_epilogue) {
      BlockedEpilogueVectors<L>(*t.epilogue, vectors, y, t.out_w, o);
    } else if (!t.vector_epilogue && !t.epilogue->empty()) {
      ApplyEpilogue(*t.epilogue, y, o, 1, t.out_w * L, 0);
    }
  }
}

/*! \brief Units [begin, end); 3x3 kernels (MobileNet's) and 5x5 ones (EfficientNet's, MnasNet's)
 * keep their taps' weights in registers (or the stack), and at stride 1 or 2 (dilation 1) their
 * tiles' column offsets are constants. */
template <int L, int K>
__attribute__((always_inline)) inline void BlockedDepthwiseSquare(const BlockedDepthwiseWork& t,
                                                                  int64_t begin, int64_t end) {
  const bool dense = t.p.dilation_w == 1;
  if (dense && t.p.stride_w == 1) {
    BlockedDepthwiseRows<L, K, 1>(t, begin, end);
  } else if (dense && t.p.stride_w == 2) {
    BlockedDepthwiseRows<L, K, 2>(t, begin, end);
  } else {
    BlockedDepthwiseRows<L, K, 0>(t, begin, end);
  }
}

template <int L>
__attribute__((always_inline)) inline void BlockedDepthwiseUnits(const BlockedDepthwiseWork& t,
                                                                 int64_t begin, int64_t end) {
  if (t.kernel_h == 3 && t.kernel_w == 3) {
    BlockedDepthwiseSquare<L, 3>(t, begin, end);
  } else if (t.kernel_h == 5 && t.kernel_w == 5) {
    BlockedDepthwiseSquare<L, 5>(t, begin, end);
  } else {
    BlockedDepthwiseRows<L, 0, 0>(t, begin, end);
  }
}

GIMLET_TARGET("avx2,fma")
void BlockedDepthwiseUnitsAvx2x8(const BlockedDepthwiseWork& t, int64_t begin, int64_t end) {
  BlockedDepthwiseUnits<8>(t, begin, end);
}
GIMLET_TARGET("avx2,fma")
void BlockedDepthwiseUnitsAvx2x16(const BlockedDepthwiseWork& t, int64_t begin, int64_t end) {
  BlockedDepthwiseUnits<16>(t, begin, end);
}
GIMLET_TARGET("avx512f,avx2,fma")
void BlockedDepthwiseUnitsAvx512(const BlockedDepthwiseWork& t, int64_t begin, int64_t end) {
  BlockedDepthwiseUnits<16>(t, begin, end);
}

int RunBlockedDepthwiseUnits(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  BlockedDepthwiseWork t = *static_cast<const BlockedDepthwiseWork*>(cdata);
  t.bands = DepthwiseBands(t, t.num_units / (t.blocks * t.out_h), penv->num_task);
  const auto [begin, end] = TaskRange(task_id, penv, t.num_units);
  RunForBlock(BlockedDepthwiseUnitsAvx2x8, BlockedDepthwiseUnitsAvx512, BlockedDepthwiseUnitsAvx2x16, t,
              begin, end);
  return 0;
}

/*!
 * \brief Depthwise conv2d (one group per channel, channel multiplier 1) on channel-blocked data:
 * data [N, C / B, H, W, B], weight [C / B, 1, KH, KW, B] (OIHW with the output channels
 * blocked), out [N, C / B, OH, OW, B]; B 8 or 16.
 */
void BlockedDepthwiseConv2D(DLTensor* data, DLTensor* weight, const Conv2DParams& p,
                            const Epilogue& epilogue, DLTensor* out) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(weight, "weight");
  CheckCompactFloat32(out, "out");
  const char* name = "gimlet.cpu.conv2d_nchwc_depthwise";
  TVM_FFI_ICHECK(data->ndim == 5 && weight->ndim == 5 && out->ndim == 5)
      << name << ": data, weight and out must be 5-D (channel-blocked)";
  const int64_t batch = data->shape[0], blocks = data->shape[1], block = data->shape[4];
  TVM_FFI_ICHECK(block == 8 || block == 16) << name << ": channel block " << block;
  TVM_FFI_ICHECK(DirectConvBlock() != 0) << name << " needs a CPU with AVX2 and FMA";
  TVM_FFI_ICHECK(weight->shape[0] == blocks && weight->shape[1] == 1 && weight->shape[4] == block &&
                 out->shape[0] == batch && out->shape[1] == blocks && out->shape[4] == block)
      << name << ": shapes differ (weight must be [C / B, 1, KH, KW, B], out [N, C / B, OH, OW, B])";
  TVM_FFI_ICHECK(p.stride_h > 0 && p.stride_w > 0 && p.dilation_h > 0 && p.dilation_w > 0 &&
                 p.pad_top >= 0 && p.pad_left >= 0)
      << name << ": strides and dilations must be positive, pads not negative";
  TVM_FFI_ICHECK(weight->shape[2] <= 16) << name << ": kernels of at most 16 rows";
  BlockedDepthwiseWork t{Data(data), Data(weight), Data(out), &epilogue, blocks, data->shape[2],
                         data->shape[3], weight->shape[2], weight->shape[3], out->shape[2],
                         out->shape[3], p, block, IsBlockedVectorEpilogue(epilogue, block)};
  t.register_epilogue = t.vector_epilogue && !HasStoredTileStep(epilogue);
  if (t.register_epilogue) t.affine = AffineClip(epilogue);
  t.bands = 1;
  if (batch == 0 || blocks == 0 || t.out_h * t.out_w == 0) return;
  t.num_units = batch * blocks * t.out_h;
  const int64_t work = t.num_units * t.out_w * block * t.kernel_h * t.kernel_w;
  Launch(RunBlockedDepthwiseUnits, &t, work >= kMinParallelGemm / 4);
}

// ---------------------------------------------------------------------------------------------
// Layout conversion at the edges of a channel-blocked region: NCHW <-> NCHW{B}c

/*! \brief One conversion: `planes` (N * C / B) blocks of B channel planes of `spatial` pixels. */
struct BlockedLayoutWork {
  const float* x;
  float* y;
  int64_t planes, spatial, block;  // planes: N * blocks
  int64_t channels, blocks;        // C of the NCHW side (at most blocks * B: the rest is padding)
  bool to_blocked;                 // NCHW -> NCHW{B}c, else back
};

int RunBlockedLayout(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const BlockedLayoutWork*>(cdata);
  const auto [begin, end] = TaskRange(task_id, penv, t.planes);
  for (int64_t plane = begin; plane < end; ++plane) {
    const int64_t first = plane % t.blocks * t.block;
    const int64_t valid = std::min(t.block, t.channels - first);  // channels of this block
    const int64_t nchw_offset = (plane / t.blocks * t.channels + first) * t.spatial;
    const int64_t blocked_offset = plane * t.spatial * t.block;
    const float* x = t.x + (t.to_blocked ? nchw_offset : blocked_offset);
    float* y = t.y + (t.to_blocked ? blocked_offset : nchw_offset);
    // 8 pixels x 8 channels at a time where the block is whole 8s and holds no padding, then
    // the rest one by one.
    int64_t i = 0;
    if (t.block % 8 == 0 && valid == t.block) {
      for (; i + 8 <= t.spatial; i += 8) {
        for (int64_t c = 0; c < t.block; c += 8) {
          if (t.to_blocked) {
            Transpose8x8(x + c * t.spatial + i, t.spatial, y + i * t.block + c, t.block);
          } else {
            Transpose8x8(x + i * t.block + c, t.block, y + c * t.spatial + i, t.spatial);
          }
        }
      }
    }
    // The blocked side in order, the block's channel planes as streams; padding written as 0.
    for (; i < t.spatial; ++i) {
      if (t.to_blocked) {
        for (int64_t c = 0; c < valid; ++c) y[i * t.block + c] = x[c * t.spatial + i];
        for (int64_t c = valid; c < t.block; ++c) y[i * t.block + c] = 0.0f;
      } else {
        for (int64_t c = 0; c < valid; ++c) y[c * t.spatial + i] = x[i * t.block + c];
      }
    }
  }
  return 0;
}

/*! \brief data [N, C, H, W] into out [N, ceil(C / B), H, W, B] (`to_blocked`; channels past C
 * are 0), or back (the padding dropped). */
void ConvertBlockedLayout(DLTensor* data, DLTensor* out, bool to_blocked) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(out, "out");
  const DLTensor* nchw = to_blocked ? data : out;
  const DLTensor* blocked = to_blocked ? out : data;
  TVM_FFI_ICHECK(nchw->ndim == 4 && blocked->ndim == 5 && blocked->shape[4] > 0 &&
                 nchw->shape[0] == blocked->shape[0] &&
                 (nchw->shape[1] + blocked->shape[4] - 1) / blocked->shape[4] == blocked->shape[1] &&
                 nchw->shape[2] == blocked->shape[2] && nchw->shape[3] == blocked->shape[3])
      << "gimlet.cpu: layout conversion between [N, C, H, W] and [N, ceil(C / B), H, W, B] with "
         "shapes that do not match";
  BlockedLayoutWork t{Data(data), Data(out), blocked->shape[0] * blocked->shape[1],
                      blocked->shape[2] * blocked->shape[3], blocked->shape[4], nchw->shape[1],
                      blocked->shape[1], to_blocked};
  Launch(RunBlockedLayout, &t, t.planes * t.spatial * t.block >= kMinParallelCopy);
}

/*! \brief `out` (channel-blocked, one image) cut to blocks [first, first + count), `shape` the
 * view's shape array: where one part of a channel concat writes its output. */
DLTensor ChannelBlocksView(const DLTensor* out, int64_t first, int64_t count, int64_t* shape) {
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK(out->ndim == 5 && out->shape[0] == 1 && first >= 0 && count >= 0 &&
                 first + count <= out->shape[1])
      << "gimlet.cpu: blocks [" << first << ", " << first + count
      << ") of an output that is not one image's channel-blocked tensor with that many blocks";
  DLTensor view = *out;
  std::copy(out->shape, out->shape + 5, shape);
  shape[1] = count;
  view.shape = shape;
  view.strides = nullptr;
  view.byte_offset += first * out->shape[2] * out->shape[3] * out->shape[4] * sizeof(float);
  return view;
}

/*! \brief One spatial mean call: planes of `spatial` pixels of `block` channels each. */
struct SpatialMeanWork {
  const float* x;
  float* y;
  int64_t planes, spatial, block;
};

/*! \brief The mean of each of B channels over `spatial` pixels of B floats (B a compile-time
 * block, so the lanes are one vector), four partial sums deep. */
template <int B>
void SpatialMeanPlane(const float* x, int64_t spatial, float* y) {
  float sums[4][B] = {};
  int64_t i = 0;
  for (; i + 4 <= spatial; i += 4) {
    for (int k = 0; k < 4; ++k) {
      for (int c = 0; c < B; ++c) sums[k][c] += x[(i + k) * B + c];
    }
  }
  for (; i < spatial; ++i) {
    for (int c = 0; c < B; ++c) sums[0][c] += x[i * B + c];
  }
  const float scale = 1.0f / static_cast<float>(spatial);
  for (int c = 0; c < B; ++c) y[c] = ((sums[0][c] + sums[1][c]) + (sums[2][c] + sums[3][c])) * scale;
}

int RunSpatialMean(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const SpatialMeanWork*>(cdata);
  const auto [begin, end] = TaskRange(task_id, penv, t.planes);
  for (int64_t plane = begin; plane < end; ++plane) {
    const float* x = t.x + plane * t.spatial * t.block;
    float* y = t.y + plane * t.block;
    if (t.block == 16) {
      SpatialMeanPlane<16>(x, t.spatial, y);
    } else if (t.block == 8) {
      SpatialMeanPlane<8>(x, t.spatial, y);
    } else {
      for (int64_t c = 0; c < t.block; ++c) {
        double sum = 0.0;
        for (int64_t i = 0; i < t.spatial; ++i) sum += x[i * t.block + c];
        y[c] = static_cast<float>(sum / static_cast<double>(t.spatial));
      }
    }
  }
  return 0;
}

/*!
 * \brief The mean over the spatial axes of channel-blocked data [N, C / B, H, W, B] into
 * out [N, C / B, 1, 1, B] (global average pooling, a squeeze-and-excitation block's squeeze):
 * each pixel's B channels are one vector, added plane by plane on TVM's pool. TVM's generated
 * reduction summed each channel on its own, B floats apart (EfficientNet-B0's 17 means took
 * 3x onnxruntime's time).
 */
void SpatialMean(DLTensor* data, DLTensor* out) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK(data->ndim == 5 && out->ndim == 5 && out->shape[0] == data->shape[0] &&
                 out->shape[1] == data->shape[1] && out->shape[2] == 1 && out->shape[3] == 1 &&
                 out->shape[4] == data->shape[4])
      << "gimlet.cpu.nchwc_spatial_mean: data must be [N, C / B, H, W, B] and out [N, C / B, 1, "
         "1, B]";
  SpatialMeanWork t{Data(data), Data(out), data->shape[0] * data->shape[1],
                    data->shape[2] * data->shape[3], data->shape[4]};
  TVM_FFI_ICHECK(t.spatial > 0) << "gimlet.cpu.nchwc_spatial_mean: the mean of no pixels";
  Launch(RunSpatialMean, &t, t.planes * t.spatial * t.block >= kMinParallelCopy);
}

/*! \brief One max-pooling call on channel-blocked data: units of one output row of one plane
 * (an image's channel block), row by row, each row through the image's planes: a thread's
 * share is a band of rows, whose input the same core wrote where the conv before split its
 * output by rows (as DepthwiseBands). */
struct MaxPoolWork {
  const float* x;
  float* y;
  int64_t batch, blocks, height, width, out_h, out_w, block;
  int64_t kernel_h, kernel_w;
  Conv2DParams p;
};

/*! \brief Units [begin, end) (MaxPoolWork's order) of `t`, B lanes a pixel: the maximum of
 * each window's pixels inside the input (the padding never wins), NaN if any of them is.
 * The running maximum is `m > v ? m : v`, one max instruction (which yields v where either is
 * NaN, so a NaN can be lost again), and whether any pixel was NaN is kept beside it: with NaN
 * kept in the comparison itself (`v > m || v != v`), each pixel was one dependent chain of a
 * compare, a mask OR and a blend per window pixel, and the window's columns took two
 * divisions a pixel (TapsInside skips them inside the input): 3x3 / 2 pooling of 8 images of
 * 64x64 x 16 ran 105 -> 69 us on one thread. */
template <int B>
void MaxPoolRows(const MaxPoolWork& t, int64_t begin, int64_t end) {
  using V = typename VectorOf<B>::Type;
  using I = typename IntsOf<V>::Type;
  const Conv2DParams& p = t.p;
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t image = unit / (t.out_h * t.blocks), oy = unit / t.blocks % t.out_h;
    const int64_t plane = image * t.blocks + unit % t.blocks;
    const float* x = t.x + plane * t.height * t.width * B;
    float* y = t.y + (plane * t.out_h + oy) * t.out_w * B;
    const int64_t iy0 = oy * p.stride_h - p.pad_top;
    const auto [kh0, kh1] = TapsInside(iy0, t.kernel_h, p.dilation_h, t.height);
    for (int64_t ox = 0; ox < t.out_w; ++ox) {
      const int64_t ix0 = ox * p.stride_w - p.pad_left;
      const auto [kw0, kw1] = TapsInside(ix0, t.kernel_w, p.dilation_w, t.width);
      V m = V{} - std::numeric_limits<float>::infinity();
      I nan = I{};
      for (int64_t kh = kh0; kh < kh1; ++kh) {
        const float* row = x + ((iy0 + kh * p.dilation_h) * t.width + ix0) * B;
        for (int64_t kw = kw0; kw < kw1; ++kw) {
          V v;
          std::memcpy(&v, row + kw * p.dilation_w * B, sizeof(V));
          m = m > v ? m : v;
          nan |= v != v;
        }
      }
      m = nan != 0 ? V{} + std::numeric_limits<float>::quiet_NaN() : m;
      std::memcpy(y + ox * B, &m, sizeof(V));
    }
  }
}

int RunMaxPool(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const MaxPoolWork*>(cdata);
  const auto [begin, end] = TaskRange(task_id, penv, t.batch * t.blocks * t.out_h);
  if (t.block == 16) {
    MaxPoolRows<16>(t, begin, end);
  } else {
    MaxPoolRows<8>(t, begin, end);
  }
  return 0;
}

/*!
 * \brief 2-D max pooling of channel-blocked data [N, C / B, H, W, B] (B 8 or 16) into out
 * [N, C / B, OH, OW, B] (its extents give the output size, ceil mode included): each pixel's B
 * channels one vector, rows on TVM's pool. TVM's generated pooling on the blocked layout took
 * 1.3x onnxruntime's time (SqueezeNet's and ResNet's 3x3 stride-2 pools).
 */
void MaxPool2D(DLTensor* data, int64_t stride_h, int64_t stride_w, int64_t pad_top, int64_t pad_left,
               int64_t dilation_h, int64_t dilation_w, int64_t kernel_h, int64_t kernel_w, DLTensor* out) {
  const Conv2DParams p{stride_h, stride_w, pad_top, pad_left, dilation_h, dilation_w};
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(out, "out");
  const char* name = "gimlet.cpu.max_pool2d_nchwc";
  TVM_FFI_ICHECK(data->ndim == 5 && out->ndim == 5 && out->shape[0] == data->shape[0] &&
                 out->shape[1] == data->shape[1] && out->shape[4] == data->shape[4] &&
                 (data->shape[4] == 8 || data->shape[4] == 16))
      << name << ": data must be [N, C / B, H, W, B] and out [N, C / B, OH, OW, B], B 8 or 16";
  TVM_FFI_ICHECK(kernel_h > 0 && kernel_w > 0 && p.stride_h > 0 && p.stride_w > 0 && p.dilation_h > 0 &&
                 p.dilation_w > 0 && p.pad_top >= 0 && p.pad_left >= 0)
      << name << ": kernel, strides and dilations must be positive, pads not negative";
  MaxPoolWork t{Data(data), Data(out), data->shape[0], data->shape[1], data->shape[2], data->shape[3],
                out->shape[2], out->shape[3], data->shape[4], kernel_h, kernel_w, p};
  Launch(RunMaxPool, &t,
         t.batch * t.blocks * t.out_h * t.out_w * t.block * kernel_h * kernel_w >= kMinParallelCopy);
}

// ---------------------------------------------------------------------------------------------
// conv2d, Winograd F(m x m, 3 x 3) (Lavin and Gray, "Fast Algorithms for Convolutional Neural
// Networks", 2015) for 3x3 stride-1 convs (groups 1): an m x m output tile of channel o is
// A^T [sum_c U[o, c] . V[c]] A, with V[c] = B^T d B for the tile's alpha x alpha input patch d
// of channel c (alpha = m + 2) and U[o, c] = G g G^T for the 3x3 kernel g: alpha^2
// multiply-adds per tile and channel pair instead of 9 m^2 (2.25x fewer for m = 2, 4x for
// m = 4), done as alpha^2 GEMMs over the channels. The weight transform is done once, at build
// time (relax_passes/dispatch_cpu_library.py, `winograd_weight`), into [alpha^2, O, C].
// A call runs three phases on TVM's pool: the input transform into V [alpha^2, C, tiles] (per
// input plane), the GEMMs M[xi] = U[xi] @ V[xi] (per xi), and the output transform into NCHW
// followed by the epilogue (per output plane). Both transforms work on vectors of kLanes tiles
// of a row of tiles, which they read (write) through m phases of the rows (element j of phase
// b: row element j * m + b), so each of the patch's elements is a plain vector load (store).
// Per-call costs that mattered (64 channels at 56x56, F(4x4), 1 thread): single-lane stores of
// a row's last vector of tiles made the input transform 2x slower, and the output transform's
// per-element interleave (an index division per element) 1.8x.
//
// On channel-blocked data and output (NCHW{B}c, what relax_passes/blocked_layout.py runs a
// network's regions in) the transforms work on vectors of a pixel's B channels instead: V is
// [alpha^2, tiles, C] and M [alpha^2, tiles, O], each patch element one vector load and each
// transformed point one vector store, the GEMMs M[xi] = V[xi] U[xi] with U transposed at build
// time ([alpha^2, C, O]), and the output written in its layout with its epilogue. ResNets' 3x3
// convs then run blocked like the 1x1 convs around them, with no conversion to NCHW and back
// at each (about 300 us of ResNet-50's 29 ms), and the transforms and GEMMs ran in 0.78x the
// NCHW ones' time (64 channels at 56x56, F(4x4), 2 threads; benchmarks/README.md).

/*! \brief The transform matrices of F(M x M, 3 x 3): B^T (alpha x alpha) and A^T (M x alpha);
 * G is applied at build time (winograd_weight). Points 0, 1, -1 (and 2, -2 for M = 4), infinity. */
template <int M>
struct Winograd;
template <>
struct Winograd<2> {
  static constexpr int kAlpha = 4;
  static constexpr float kBt[4][4] = {{1, 0, -1, 0}, {0, 1, 1, 0}, {0, -1, 1, 0}, {0, 1, 0, -1}};
  static constexpr float kAt[2][4] = {{1, 1, 1, 0}, {0, 1, -1, -1}};
};
template <>
struct Winograd<4> {
  static constexpr int kAlpha = 6;
  static constexpr float kBt[6][6] = {{4, 0, -5, 0, 1, 0},  {0, -4, -4, 1, 1, 0},
                                      {0, 4, -4, -1, 1, 0}, {0, -2, -1, 2, 1, 0},
                                      {0, 2, -1, -2, 1, 0}, {0, 4, 0, -5, 0, 1}};
  static constexpr float kAt[4][6] = {
      {1, 1, 1, 1, 1, 0}, {0, 1, -1, 2, -2, 0}, {0, 1, 1, 4, 4, 0}, {0, 1, -1, 8, -8, 1}};
};

/*!
 * \brief out[i * out_stride] = sum_k mat[i][k] in[k * in_stride] for a constant matrix: after
 * unrolling, zero coefficients drop out and ones become plain adds (the compiler may not fold
 * 0 * x or 1 * x into the sum by itself: NaN and signed zeros).
 */
template <int R, int C, typename V>
__attribute__((always_inline)) inline void MultiplyConstant(const float (&mat)[R][C],
                                                            const V* in, int in_stride, V* out,
                                                            int out_stride) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    V acc{};
    bool first = true;
#pragma GCC unroll 8
    for (int k = 0; k < C; ++k) {
      const float c = mat[i][k];
      if (c == 0.0f) continue;
      const V v = in[k * in_stride];
      const V term = c == 1.0f ? v : c == -1.0f ? -v : c * v;
      acc = first ? term : acc + term;
      first = false;
    }
    out[i * out_stride] = acc;
  }
}

/*! \brief One Winograd conv2d call (see above). */
struct WinogradWork {
  const float* x;  // [N, C, H, W], or blocked [N, C / B, H, W, B]
  const float* u;  // [alpha^2, O, C]; blocked: [alpha^2, C, O]
  float* v;        // [alpha^2, C, N * tiles]; blocked: [alpha^2, N * tiles, C]
  float* m;        // [alpha^2, O, N * tiles]; blocked: [alpha^2, N * tiles, O]
  float* y;        // [N, O, OH, OW], or blocked [N, O / B, OH, OW, B]
  const Epilogue* epilogue;
  int64_t batch, in_c, height, width, out_c, out_h, out_w, pad_top, pad_left;
  int64_t block;             // B of blocked data and output, 0 for NCHW
  bool vector_epilogue;      // blocked, and IsBlockedVectorEpilogue
  int64_t tiles_h, tiles_w;  // ceil(OH / m), ceil(OW / m)
  int64_t phase_len;         // elements per phase row: ceil(tiles_w / kLanes) * kLanes + 1

  int64_t Tiles() const { return batch * tiles_h * tiles_w; }
};

/*! \brief V[:, c, image's tiles] for input plane `plane` (image * C + c); `phases`: M phase
 * planes of (tiles_h * M + 2) rows of phase_len floats. */
template <int M>
void WinogradInputPlane(const WinogradWork& t, int64_t plane, float* phases) {
  constexpr int A = Winograd<M>::kAlpha;
  const int64_t img = plane / t.in_c, c = plane % t.in_c, tiles = t.Tiles();
  const int64_t rows = t.tiles_h * M + 2;  // row r: input row r - pad_top
  const float* x = t.x + plane * t.height * t.width;
  // One fill for the padding, then the data.
  std::fill(phases, phases + M * rows * t.phase_len, 0.0f);
  const int64_t r0 = std::min(rows, t.pad_top), r1 = std::min(rows, t.pad_top + t.height);
  for (int b = 0; b < M; ++b) {
    // Elements j with 0 <= j * M + b - pad_left < width come from the data.
    const int64_t j0 = std::min(t.phase_len, (std::max<int64_t>(t.pad_left - b, 0) + M - 1) / M);
    const int64_t j1 = std::clamp<int64_t>((t.width + t.pad_left - b + M - 1) / M, j0, t.phase_len);
    for (int64_t r = r0; r < r1; ++r) {
      const float* src = x + (r - t.pad_top) * t.width + j0 * M + b - t.pad_left;
      float* dst = phases + (b * rows + r) * t.phase_len;
      for (int64_t j = j0; j < j1; ++j) dst[j] = src[(j - j0) * M];
    }
  }
  for (int64_t ty = 0; ty < t.tiles_h; ++ty) {
    float* v = t.v + c * tiles + (img * t.tiles_h + ty) * t.tiles_w;
    for (int64_t next = 0; next < t.tiles_w; next += kLanes) {
      // A row's last vector ends at its last tile (overlapping the one before: those tiles are
      // written twice, alike), so only rows shorter than a vector need single-lane stores.
      const int64_t tx = std::max<int64_t>(0, std::min(next, t.tiles_w - kLanes));
      Floats d[A][A], tmp[A][A], out[A][A];
      for (int k = 0; k < A; ++k)
        for (int j = 0; j < A; ++j)
          std::memcpy(&d[k][j], phases + ((j % M) * rows + ty * M + k) * t.phase_len + tx + j / M,
                      sizeof(Floats));
      for (int j = 0; j < A; ++j) MultiplyConstant(Winograd<M>::kBt, &d[0][j], A, &tmp[0][j], A);
      for (int i = 0; i < A; ++i) MultiplyConstant(Winograd<M>::kBt, tmp[i], 1, out[i], 1);
      const int64_t n = std::min<int64_t>(kLanes, t.tiles_w - tx);
      for (int i = 0; i < A; ++i) {
        for (int j = 0; j < A; ++j) {
          float* dst = v + (i * A + j) * t.in_c * tiles + tx;
          if (n == kLanes) {
            std::memcpy(dst, &out[i][j], sizeof(Floats));
          } else {
            for (int64_t q = 0; q < n; ++q) dst[q] = out[i][j][q];
          }
        }
      }
    }
  }
}

/*! \brief Output plane `plane` (image * O + o) from M[:, o, image's tiles], then the epilogue;
 * `rows`: M x M phase rows of phase_len floats. */
template <int M>
void WinogradOutputPlane(const WinogradWork& t, int64_t plane, float* rows) {
  constexpr int A = Winograd<M>::kAlpha;
  const int64_t img = plane / t.out_c, o = plane % t.out_c, tiles = t.Tiles();
  float* y = t.y + plane * t.out_h * t.out_w;
  for (int64_t ty = 0; ty < t.tiles_h; ++ty) {
    const float* m = t.m + o * tiles + (img * t.tiles_h + ty) * t.tiles_w;
    for (int64_t tx = 0; tx < t.tiles_w; tx += kLanes) {
      Floats s[A][A], tmp[M][A], out[M][M];
      for (int i = 0; i < A; ++i)
        for (int j = 0; j < A; ++j)
          std::memcpy(&s[i][j], m + (i * A + j) * t.out_c * tiles + tx, sizeof(Floats));
      for (int j = 0; j < A; ++j) MultiplyConstant(Winograd<M>::kAt, &s[0][j], A, &tmp[0][j], A);
      for (int i = 0; i < M; ++i) MultiplyConstant(Winograd<M>::kAt, tmp[i], 1, out[i], 1);
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < M; ++j)
          std::memcpy(rows + (i * M + j) * t.phase_len + tx, &out[i][j], sizeof(Floats));
    }
    // Interleave the phase rows into the output rows: whole tiles, then the cut last one.
    const int64_t whole = t.out_w / M;
    for (int i = 0; i < M && ty * M + i < t.out_h; ++i) {
      float* dst = y + (ty * M + i) * t.out_w;
      const float* src = rows + i * M * t.phase_len;
      for (int64_t j = 0; j < whole; ++j) {
        for (int b = 0; b < M; ++b) dst[j * M + b] = src[b * t.phase_len + j];
      }
      for (int64_t col = whole * M; col < t.out_w; ++col) {
        dst[col] = src[col % M * t.phase_len + whole];
      }
    }
  }
  if (!t.epilogue->empty()) {
    ApplyEpilogue(*t.epilogue, y, y - t.y, 1, t.out_h * t.out_w, t.out_h * t.out_w);
  }
}

/*! \brief Blocked data: V[:, tiles of row `ty` of image `img`, :] (`unit`: img * tiles_h + ty),
 * each patch element one vector of the L channels of a pixel; a tile's channel blocks one after
 * another, so a thread writes V's rows (one tile's channels at a point) whole. */
template <int M, int L>
__attribute__((always_inline)) inline void BlockedWinogradInputRow(const WinogradWork& t,
                                                                   int64_t unit) {
  using V = typename VectorOf<L>::Type;
  using U = typename VectorOf<L>::Unaligned;
  constexpr int A = Winograd<M>::kAlpha;
  const int64_t blocks = t.in_c / L, ty = unit % t.tiles_h, img = unit / t.tiles_h;
  const int64_t tiles = t.Tiles(), plane = t.height * t.width * L;
  const int64_t y0 = ty * M - t.pad_top;
  float* v = t.v + unit * t.tiles_w * t.in_c;
  for (int64_t tx = 0; tx < t.tiles_w; ++tx) {
    const int64_t x0 = tx * M - t.pad_left;
    const bool inside = y0 >= 0 && x0 >= 0 && y0 + A <= t.height && x0 + A <= t.width;
    const float* x = t.x + img * blocks * plane;
    for (int64_t cb = 0; cb < blocks; ++cb, x += plane, v += L) {
      V d[A][A], tmp[A][A], out[A][A];
      for (int k = 0; k < A; ++k) {
        for (int j = 0; j < A; ++j) {
          const int64_t iy = y0 + k, ix = x0 + j;
          if (inside || (iy >= 0 && iy < t.height && ix >= 0 && ix < t.width)) {
            d[k][j] = *reinterpret_cast<const U*>(x + (iy * t.width + ix) * L);
          } else {
            d[k][j] = V{};
          }
        }
      }
      for (int j = 0; j < A; ++j) MultiplyConstant(Winograd<M>::kBt, &d[0][j], A, &tmp[0][j], A);
      for (int i = 0; i < A; ++i) MultiplyConstant(Winograd<M>::kBt, tmp[i], 1, out[i], 1);
      for (int i = 0; i < A; ++i) {
        for (int j = 0; j < A; ++j) {
          *reinterpret_cast<U*>(v + (i * A + j) * tiles * t.in_c) = out[i][j];
        }
      }
    }
  }
}

/*! \brief Blocked output: the rows of tile row `ty` of image `img` (`unit` as in
 * BlockedWinogradInputRow) from M, block by block, each block's rows then taking the epilogue
 * while they are in cache. */
template <int M, int L>
__attribute__((always_inline)) inline void BlockedWinogradOutputRow(const WinogradWork& t,
                                                                    int64_t unit) {
  using V = typename VectorOf<L>::Type;
  using U = typename VectorOf<L>::Unaligned;
  constexpr int A = Winograd<M>::kAlpha;
  const int64_t blocks = t.out_c / L, ty = unit % t.tiles_h, img = unit / t.tiles_h;
  const int64_t tiles = t.Tiles(), plane = t.out_h * t.out_w * L;
  const int64_t rows = std::min<int64_t>(M, t.out_h - ty * M);
  for (int64_t ob = 0; ob < blocks; ++ob) {
    float* y = t.y + (img * blocks + ob) * plane;
    const float* m = t.m + unit * t.tiles_w * t.out_c + ob * L;
    for (int64_t tx = 0; tx < t.tiles_w; ++tx, m += t.out_c) {
      V s[A][A], tmp[M][A], out[M][M];
      for (int i = 0; i < A; ++i) {
        for (int j = 0; j < A; ++j) {
          s[i][j] = *reinterpret_cast<const U*>(m + (i * A + j) * tiles * t.out_c);
        }
      }
      for (int j = 0; j < A; ++j) MultiplyConstant(Winograd<M>::kAt, &s[0][j], A, &tmp[0][j], A);
      for (int i = 0; i < M; ++i) MultiplyConstant(Winograd<M>::kAt, tmp[i], 1, out[i], 1);
      const int64_t cols = std::min<int64_t>(M, t.out_w - tx * M);
      for (int64_t i = 0; i < rows; ++i) {
        float* dst = y + ((ty * M + i) * t.out_w + tx * M) * L;
        for (int64_t j = 0; j < cols; ++j) *reinterpret_cast<U*>(dst + j * L) = out[i][j];
      }
    }
    float* first = y + ty * M * t.out_w * L;
    const int64_t pixels = rows * t.out_w, offset = first - t.y;
    if (t.vector_epilogue) {
      BlockedEpilogueVectors<L>(*t.epilogue, BlockedRowVectors(*t.epilogue, offset), first,
                                pixels, offset);
    } else if (!t.epilogue->empty()) {
      ApplyEpilogue(*t.epilogue, first, offset, 1, pixels * L, pixels * L);
    }
  }
}

/*! \brief Blocked units [begin, end) of the input (`input`) or output transform, per instance. */
template <int M, int L>
__attribute__((always_inline)) inline void BlockedWinogradUnits(const WinogradWork& t,
                                                                bool input, int64_t begin,
                                                                int64_t end) {
  for (int64_t unit = begin; unit < end; ++unit) {
    if (input) {
      BlockedWinogradInputRow<M, L>(t, unit);
    } else {
      BlockedWinogradOutputRow<M, L>(t, unit);
    }
  }
}

/*! \brief BlockedWinogradUnits for tiles of `m` x `m` outputs. */
template <int L>
__attribute__((always_inline)) inline void BlockedWinogradUnitsOf(const WinogradWork& t, int m,
                                                                  bool input, int64_t begin,
                                                                  int64_t end) {
  if (m == 2) {
    BlockedWinogradUnits<2, L>(t, input, begin, end);
  } else {
    BlockedWinogradUnits<4, L>(t, input, begin, end);
  }
}

GIMLET_TARGET("avx2,fma")
void BlockedWinogradUnitsAvx2x8(const WinogradWork& t, int m, bool input, int64_t begin,
                                int64_t end) {
  BlockedWinogradUnitsOf<8>(t, m, input, begin, end);
}
GIMLET_TARGET("avx2,fma")
void BlockedWinogradUnitsAvx2x16(const WinogradWork& t, int m, bool input, int64_t begin,
                                 int64_t end) {
  BlockedWinogradUnitsOf<16>(t, m, input, begin, end);
}
GIMLET_TARGET("avx512f,avx2,fma")
void BlockedWinogradUnitsAvx512(const WinogradWork& t, int m, bool input, int64_t begin,
                                int64_t end) {
  BlockedWinogradUnitsOf<16>(t, m, input, begin, end);
}

/*! \brief The blocked transform's units of one task: (image, tile row) each. */
template <int M, bool kInput>
int RunBlockedWinogradUnits(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const WinogradWork*>(cdata);
  const auto [begin, end] = TaskRange(task_id, penv, t.batch * t.tiles_h);
  RunForBlock(BlockedWinogradUnitsAvx2x8, BlockedWinogradUnitsAvx512, BlockedWinogradUnitsAvx2x16, t, M,
              kInput, begin, end);
  return 0;
}

template <int M>
int RunWinogradInput(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const WinogradWork*>(cdata);
  thread_local std::vector<float> phases;
  phases.resize(M * (t.tiles_h * M + 2) * t.phase_len);
  const auto [begin, end] = TaskRange(task_id, penv, t.batch * t.in_c);
  for (int64_t plane = begin; plane < end; ++plane) WinogradInputPlane<M>(t, plane, phases.data());
  return 0;
}

template <int M>
int RunWinogradOutput(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const WinogradWork*>(cdata);
  thread_local std::vector<float> rows;
  rows.resize(M * M * t.phase_len);
  const auto [begin, end] = TaskRange(task_id, penv, t.batch * t.out_c);
  for (int64_t plane = begin; plane < end; ++plane) WinogradOutputPlane<M>(t, plane, rows.data());
  return 0;
}

template <int M>
int RunWinogradGemms(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const WinogradWork*>(cdata);
  const int64_t tiles = t.Tiles();
  const auto [begin, end] = TaskRange(task_id, penv, Winograd<M>::kAlpha * Winograd<M>::kAlpha);
  for (int64_t xi = begin; xi < end; ++xi) {
    const float* u = t.u + xi * t.out_c * t.in_c;
    const float* v = t.v + xi * t.in_c * tiles;
    float* m = t.m + xi * t.out_c * tiles;
    if (t.block != 0) {  // M[xi] [tiles, O] = V[xi] [tiles, C] @ U[xi] [C, O]
      Sgemm(false, tiles, t.out_c, t.in_c, v, t.in_c, u, t.out_c, m, t.out_c);
    } else {  // M[xi] [O, tiles] = U[xi] [O, C] @ V[xi] [C, tiles]
      Sgemm(false, t.out_c, tiles, t.in_c, u, t.in_c, v, tiles, m, tiles);
    }
  }
  return 0;
}

template <int M>
void RunWinograd(WinogradWork& t, bool parallel) {
  constexpr int64_t kPoints = Winograd<M>::kAlpha * Winograd<M>::kAlpha;
  t.tiles_h = (t.out_h + M - 1) / M;
  t.tiles_w = (t.out_w + M - 1) / M;
  t.phase_len = (t.tiles_w + kLanes - 1) / kLanes * kLanes + 1;
  thread_local std::vector<float> v, m;
  t.v = Scratch(v, kPoints * t.in_c * t.Tiles());
  // The output transform reads whole vectors: up to kLanes - 1 floats past the last tile.
  t.m = Scratch(m, kPoints * t.out_c * t.Tiles() + kLanes);
  const bool blocked = t.block != 0;
  Launch(blocked ? RunBlockedWinogradUnits<M, true> : RunWinogradInput<M>, &t, parallel);
  Launch(RunWinogradGemms<M>, &t, parallel);
  Launch(blocked ? RunBlockedWinogradUnits<M, false> : RunWinogradOutput<M>, &t, parallel);
}

/*!
 * \brief conv2d with a 3x3 kernel, stride 1, dilation 1, groups 1, by Winograd F(m x m, 3 x 3);
 * data: [N, C, H, W], out: [N, O, OH, OW], weight: the transformed kernel [alpha^2, O, C]
 * (alpha^2 16: m = 2; 36: m = 4); or channel-blocked data [N, C / B, H, W, B] and out
 * [N, O / B, OH, OW, B] (B 8 or 16; AVX2 at least, 16-lane vectors in halves without AVX-512),
 * weight [alpha^2, C / B, B, O] (the transformed kernel transposed: the GEMMs' B operand).
 */
void WinogradConv2D(DLTensor* data, DLTensor* weight, const Conv2DParams& p,
                    const Epilogue& epilogue, DLTensor* out) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(weight, "weight");
  CheckCompactFloat32(out, "out");
  const bool blocked = data->ndim == 5;
  TVM_FFI_ICHECK((data->ndim == 4 && out->ndim == 4 && weight->ndim == 3) ||
                 (blocked && out->ndim == 5 && weight->ndim == 4))
      << "gimlet.cpu.conv2d_nchw_winograd: data, out and the transformed weight must be 4-D, "
         "4-D and 3-D (NCHW) or 5-D, 5-D and 4-D (NCHW{B}c)";
  TVM_FFI_ICHECK(p.stride_h == 1 && p.stride_w == 1 && p.dilation_h == 1 && p.dilation_w == 1)
      << "gimlet.cpu.conv2d_nchw_winograd: stride and dilation must be 1";
  TVM_FFI_ICHECK(p.pad_top >= 0 && p.pad_left >= 0)
      << "gimlet.cpu.conv2d_nchw_winograd: negative padding";
  const int64_t points = weight->shape[0];
  TVM_FFI_ICHECK(points == 16 || points == 36)
      << "gimlet.cpu.conv2d_nchw_winograd: " << points
      << " transform points is neither 16 (F(2x2, 3x3)) nor 36 (F(4x4, 3x3))";
  const int64_t block = blocked ? data->shape[4] : 0;
  if (blocked) {
    TVM_FFI_ICHECK(out->shape[4] == block && (block == 8 || block == 16))
        << "gimlet.cpu.conv2d_nchw_winograd: blocked data and out need one block of 8 or 16 "
           "channels, not "
        << block << " and " << out->shape[4];
    TVM_FFI_ICHECK(DirectConvBlock() != 0)
        << "gimlet.cpu.conv2d_nchw_winograd: blocked data needs AVX2 and FMA on the CPU";
  }
  const int64_t lanes = std::max<int64_t>(block, 1);
  WinogradWork t{Data(data), Data(weight), nullptr, nullptr, Data(out), &epilogue,
                 data->shape[0], data->shape[1] * lanes, data->shape[2], data->shape[3],
                 out->shape[1] * lanes, out->shape[2], out->shape[3], p.pad_top, p.pad_left};
  t.block = block;
  t.vector_epilogue = blocked && IsBlockedVectorEpilogue(epilogue, block);
  const bool weight_fits =
      blocked ? weight->shape[1] * weight->shape[2] == t.in_c && weight->shape[3] == t.out_c
              : weight->shape[1] == t.out_c && weight->shape[2] == t.in_c;
  TVM_FFI_ICHECK(weight_fits && out->shape[0] == t.batch)
      << "gimlet.cpu.conv2d_nchw_winograd: shapes differ";
  if (t.batch * t.out_c * t.out_h * t.out_w == 0) return;
  const bool parallel = t.batch * t.out_c * t.out_h * t.out_w * t.in_c * 9 >= kMinParallelGemm;
  if (points == 16) {
    RunWinograd<2>(t, parallel);
  } else {
    RunWinograd<4>(t, parallel);
  }
}

// ---------------------------------------------------------------------------------------------
// attention

/*! \brief One attention call, cut into units of a few query rows of one (batch, head). */
struct AttentionWork {
  const float* q;  // [B, S, N, D]
  const float* k;  // [B, T, N, D]
  const float* v;  // [B, T, N, E]
  float* out;      // [B, S, N, E]
  const float* bias = nullptr;  // broadcast to [B, N, S, T] through bias_stride (0: broadcast)
  int64_t bias_stride[4] = {0, 0, 0, 0};
  float scale;
  int64_t batch, seq, heads, depth, seq_kv, depth_v;
  int64_t rows_per_unit, units_per_head;
};

/*! \brief s = softmax(s * scale + bias) over one row; bias (or null) read at bias_stride. */
void SoftmaxRow(float* s, int64_t n, float scale, const float* bias, int64_t bias_stride) {
  float max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = s[j] * scale + (bias == nullptr ? 0.0f : bias[j * bias_stride]);
    max = std::max(max, s[j]);
  }
  MapInPlace(s, n, [max](Floats v) { return ExpNonPositive(v - max); });
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += s[j];
  const float inverse = 1.0f / sum;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) s[j] *= inverse;
}

// Query rows per unit: their score rows stay in L2 next to the head's keys and values.
constexpr int64_t kAttentionRows = 32;

int RunAttentionUnits(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& t = *static_cast<const AttentionWork*>(cdata);
  thread_local std::vector<float> scores;
  const auto [begin, end] = TaskRange(task_id, penv, t.batch * t.heads * t.units_per_head);
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t head = unit / t.units_per_head % t.heads, b = unit / t.units_per_head / t.heads;
    const int64_t i0 = unit % t.units_per_head * t.rows_per_unit;
    const int64_t rows = std::min(t.seq, i0 + t.rows_per_unit) - i0;
    scores.resize(rows * t.seq_kv);
    // scores = q[b, i0:i0+rows, head] @ k[b, :, head]^T
    Sgemm(true, rows, t.seq_kv, t.depth, t.q + ((b * t.seq + i0) * t.heads + head) * t.depth,
          t.heads * t.depth, t.k + (b * t.seq_kv * t.heads + head) * t.depth, t.heads * t.depth,
          scores.data(), t.seq_kv);
    for (int64_t r = 0; r < rows; ++r) {
      const float* bias = t.bias == nullptr ? nullptr
                                            : t.bias + b * t.bias_stride[0] + head * t.bias_stride[1] +
                                                  (i0 + r) * t.bias_stride[2];
      SoftmaxRow(scores.data() + r * t.seq_kv, t.seq_kv, t.scale, bias, t.bias_stride[3]);
    }
    // out[b, i0:i0+rows, head] = softmax(scores) @ v[b, :, head]
    Sgemm(false, rows, t.depth_v, t.seq_kv, scores.data(), t.seq_kv,
          t.v + (b * t.seq_kv * t.heads + head) * t.depth_v, t.heads * t.depth_v,
          t.out + ((b * t.seq + i0) * t.heads + head) * t.depth_v, t.heads * t.depth_v);
  }
  return 0;
}

/*!
 * \brief out = softmax(scale * q @ k^T + bias) @ v per batch and head, in BSNH layout:
 * q: [B, S, N, D], k: [B, T, N, D], v: [B, T, N, E], out: [B, S, N, E]; bias (or null):
 * 4-D, broadcast to [B, N, S, T]. Units of query rows of one head run on TVM's pool.
 */
void Attention(DLTensor* q, DLTensor* k, DLTensor* v, DLTensor* bias, double scale,
               DLTensor* out) {
  for (auto [t, name] : {std::pair{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}}) {
    CheckCompactFloat32(t, name);
    TVM_FFI_ICHECK_EQ(t->ndim, 4) << "gimlet.cpu.attention: " << name << " must be 4-D";
  }
  AttentionWork work{Data(q), Data(k), Data(v), Data(out)};
  work.scale = static_cast<float>(scale);
  work.batch = q->shape[0];
  work.seq = q->shape[1];
  work.heads = q->shape[2];
  work.depth = q->shape[3];
  work.seq_kv = k->shape[1];
  work.depth_v = v->shape[3];
  TVM_FFI_ICHECK(k->shape[0] == work.batch && k->shape[2] == work.heads && k->shape[3] == work.depth &&
                 v->shape[0] == work.batch && v->shape[1] == work.seq_kv && v->shape[2] == work.heads &&
                 out->shape[0] == work.batch && out->shape[1] == work.seq &&
                 out->shape[2] == work.heads && out->shape[3] == work.depth_v)
      << "gimlet.cpu.attention: shapes differ";
  if (bias != nullptr) {
    CheckCompactFloat32(bias, "bias");
    TVM_FFI_ICHECK_EQ(bias->ndim, 4) << "gimlet.cpu.attention: bias must be 4-D";
    const int64_t full[4] = {work.batch, work.heads, work.seq, work.seq_kv};
    int64_t stride = 1;
    for (int d = 3; d >= 0; --d) {
      TVM_FFI_ICHECK(bias->shape[d] == 1 || bias->shape[d] == full[d])
          << "gimlet.cpu.attention: bias does not broadcast";
      work.bias_stride[d] = bias->shape[d] == 1 ? 0 : stride;
      stride *= bias->shape[d];
    }
    work.bias = Data(bias);
  }
  if (work.batch * work.heads * work.seq * work.depth_v == 0) return;
  work.rows_per_unit = std::min(work.seq, kAttentionRows);
  work.units_per_head = (work.seq + work.rows_per_unit - 1) / work.rows_per_unit;
  const int64_t flops = work.batch * work.heads * work.seq * work.seq_kv * (work.depth + work.depth_v);
  Launch(RunAttentionUnits, &work, flops >= kMinParallelGemm);
}

/*!
 * \brief conv2d by im2col + OpenBLAS as a packed function: (data, weight, stride_h, stride_w,
 * pad_top, pad_left, dilation_h, dilation_w, groups, epilogue steps..., out); bottom/right
 * padding is implied by the output shape. Registered as `gimlet.cpu.conv2d_nchw` (the generic
 * call, which the compiler's default rule may still move to another kernel) and as
 * `gimlet.cpu.conv2d_nchw_im2col` (a build that chose this algorithm).
 */
void Im2colConv2DPacked(PackedArgs args, tvm::ffi::Any*) {
  DLTensor* out = args[args.size() - 1].cast<DLTensor*>();
  Conv2D(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(), Conv2DParamsOf(args),
         args[8].cast<int64_t>(), ParseEpilogue(args, 9, args.size() - 1, out), out);
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  scipy_openblas_set_num_threads(1);  // parallelism comes from TVM's pool (see the top)
  refl::GlobalDef()
      .def_packed("gimlet.cpu.matmul",
                  [](PackedArgs args, tvm::ffi::Any*) {
                    // (a, b, transpose_b, epilogue steps..., out)
                    DLTensor* out = args[args.size() - 1].cast<DLTensor*>();
                    Matmul(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(),
                           args[2].cast<int64_t>(), ParseEpilogue(args, 3, args.size() - 1, out),
                           out);
                  })
      .def_packed("gimlet.cpu.conv2d_nchw", Im2colConv2DPacked)
      .def_packed("gimlet.cpu.conv2d_nchw_im2col", Im2colConv2DPacked)
      .def_packed("gimlet.cpu.conv2d_nchw_direct",
                  [](PackedArgs args, tvm::ffi::Any*) {
                    // (data, packed weight, stride_h, stride_w, pad_top, pad_left,
                    //  dilation_h, dilation_w, epilogue steps..., out)
                    DLTensor* out = args[args.size() - 1].cast<DLTensor*>();
                    DirectConv2D(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(),
                                 Conv2DParamsOf(args),
                                 ParseEpilogue(args, 8, args.size() - 1, out), out);
                  })
      .def_packed("gimlet.cpu.conv2d_nchw_direct_scaled",
                  [](PackedArgs args, tvm::ffi::Any*) {
                    // (data, scale, packed weight, stride_h, stride_w, pad_top, pad_left,
                    //  dilation_h, dilation_w, epilogue steps..., out)
                    DLTensor* out = args[args.size() - 1].cast<DLTensor*>();
                    ScaledDirectConv2D(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(),
                                       args[2].cast<DLTensor*>(), Conv2DParamsOf(args, 3),
                                       ParseEpilogue(args, 9, args.size() - 1, out), out);
                  })
      .def_packed("gimlet.cpu.conv2d_nchwc_direct_concat",
                  [](PackedArgs args, tvm::ffi::Any*) {
                    // ((data, packed weight, stride_h, stride_w, pad_top, pad_left,
                    //   dilation_h, dilation_w, n, n epilogue arguments) per part..., out):
                    // direct convs writing their blocked outputs one after another into out
                    // (one image: a concat of the parts along the channel blocks).
                    DLTensor* out = args[args.size() - 1].cast<DLTensor*>();
                    int64_t first = 0;
                    for (int i = 0; i < args.size() - 1;) {
                      DLTensor* weight = args[i + 1].cast<DLTensor*>();
                      const int steps_end = i + 9 + static_cast<int>(args[i + 8].cast<int64_t>());
                      TVM_FFI_ICHECK(weight->ndim == 5 && steps_end < args.size())
                          << "gimlet.cpu.conv2d_nchwc_direct_concat: a part's arguments are cut short";
                      int64_t shape[5];
                      DLTensor part = ChannelBlocksView(out, first, weight->shape[0], shape);
                      DirectConv2D(args[i].cast<DLTensor*>(), weight, Conv2DParamsOf(args, i + 2),
                                   ParseEpilogue(args, i + 9, steps_end, &part), &part);
                      first += weight->shape[0];
                      i = steps_end;
                    }
                    TVM_FFI_ICHECK(first == out->shape[1])
                        << "gimlet.cpu.conv2d_nchwc_direct_concat: the parts have " << first
                        << " channel blocks, the output " << out->shape[1];
                  })
      .def_packed("gimlet.cpu.conv2d_nchw_rows",
                  [](PackedArgs args, tvm::ffi::Any*) {
                    // (data, weight, stride_h, stride_w, pad_top, pad_left, dilation_h,
                    //  dilation_w, lanes, epilogue steps..., out)
                    DLTensor* out = args[args.size() - 1].cast<DLTensor*>();
                    RowConv2D(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(),
                              Conv2DParamsOf(args), args[8].cast<int64_t>(),
                              ParseEpilogue(args, 9, args.size() - 1, out), out);
                  })
      .def_packed("gimlet.cpu.conv2d_nchw_depthwise",
                  [](PackedArgs args, tvm::ffi::Any*) {
                    // (data, weight, stride_h, stride_w, pad_top, pad_left, dilation_h,
                    //  dilation_w, lanes, epilogue steps..., out)
                    DLTensor* out = args[args.size() - 1].cast<DLTensor*>();
                    DepthwiseConv2D(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(),
                                    Conv2DParamsOf(args), args[8].cast<int64_t>(),
                                    ParseEpilogue(args, 9, args.size() - 1, out), out);
                  })
      .def_packed("gimlet.cpu.conv2d_nchwc_depthwise",
                  [](PackedArgs args, tvm::ffi::Any*) {
                    // (data, blocked weight, stride_h, stride_w, pad_top, pad_left,
                    //  dilation_h, dilation_w, epilogue steps..., out)
                    DLTensor* out = args[args.size() - 1].cast<DLTensor*>();
                    BlockedDepthwiseConv2D(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(),
                                           Conv2DParamsOf(args),
                                           ParseEpilogue(args, 8, args.size() - 1, out), out);
                  })
      .def("gimlet.cpu.nchw_to_nchwc",
           [](DLTensor* data, DLTensor* out) { ConvertBlockedLayout(data, out, true); })
      .def("gimlet.cpu.nchwc_to_nchw",
           [](DLTensor* data, DLTensor* out) { ConvertBlockedLayout(data, out, false); })
      .def("gimlet.cpu.nchwc_spatial_mean", SpatialMean)
      .def("gimlet.cpu.max_pool2d_nchwc", MaxPool2D)
      .def_packed("gimlet.cpu.conv2d_nchw_winograd",
                  [](PackedArgs args, tvm::ffi::Any*) {
                    // (data, transformed weight, stride_h, stride_w, pad_top, pad_left,
                    //  dilation_h, dilation_w, epilogue steps..., out)
                    DLTensor* out = args[args.size() - 1].cast<DLTensor*>();
                    WinogradConv2D(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(),
                                   Conv2DParamsOf(args),
                                   ParseEpilogue(args, 8, args.size() - 1, out), out);
                  })
      .def("gimlet.cpu.conv2d_direct_block", [] { return DirectConvBlock(); })
      .def_packed("gimlet.cpu.attention", [](PackedArgs args, tvm::ffi::Any*) {
        // (q, k, v, scale, out) or (q, k, v, bias, scale, out)
        const bool has_bias = args.size() == 6;
        Attention(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(), args[2].cast<DLTensor*>(),
                  has_bias ? args[3].cast<DLTensor*>() : nullptr,
                  args[args.size() - 2].cast<double>(), args[args.size() - 1].cast<DLTensor*>());
      });
}

}  // namespace cpu
}  // namespace gimlet
