/*!
 * \file cpu_library.cc
 * \brief fp32 matmul and NCHW conv2d on OpenBLAS (scipy-openblas32), as TVM packed functions.
 *
 * All functions use destination-passing style: inputs first, the output tensor last.
 * Tensors must be compact row-major float32 on the CPU.
 *
 * Threading: OpenBLAS runs its parallel jobs on TVM's own thread pool (through
 * scipy_openblas_set_threads_callback_function), with as many threads as that pool has, so
 * library calls and generated kernels never compete for cores. Measured on 2 Zen 4 cores
 * (default build, medians vs onnxruntime): OpenBLAS's own 2 pthreads next to TVM's pool made
 * the MLP 9x and the small ResNet 270x slower than onnxruntime (the two pools' spinning
 * workers preempt each other); 1 OpenBLAS thread left the MLP at 1.1-1.6x and the ResNet at
 * 2.4-2.8x; sharing TVM's pool gave 1.1-1.2x and 1.9-2.1x. conv2d additionally runs its own
 * work units on the pool with single-threaded sgemm (see Conv2D).
 */
#include <cblas.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>
#include <tvm/runtime/c_backend_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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
// Running OpenBLAS jobs on TVM's thread pool.

struct BlasJobs {
  openblas_dojob_callback dojob;
  int num_jobs;
  size_t job_size;
  char* job_data;
  int dojob_data;
};

int RunBlasJob(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  auto* jobs = static_cast<BlasJobs*>(cdata);
  for (int i = task_id; i < jobs->num_jobs; i += penv->num_task) {
    jobs->dojob(i, jobs->job_data + i * jobs->job_size, jobs->dojob_data);
  }
  return 0;
}

void RunBlasJobsOnTVMPool(int /*sync*/, openblas_dojob_callback dojob, int num_jobs,
                          size_t job_size, void* job_data, int dojob_data) {
  // OpenBLAS jobs wait for each other, so all of them must run at once: one task each.
  BlasJobs jobs{dojob, num_jobs, job_size, static_cast<char*>(job_data), dojob_data};
  TVMBackendParallelLaunch(RunBlasJob, &jobs, num_jobs);
}

int CountPoolThreads(int /*task_id*/, TVMParallelGroupEnv* penv, void* cdata) {
  *static_cast<int*>(cdata) = penv->num_task;
  return 0;
}

// Called before the first BLAS call (not at load time: the pool must not start inside dlopen).
void UseTVMThreadPoolForBlas() {
  static const bool done = [] {
    int pool_threads = 1;
    TVMBackendParallelLaunch(CountPoolThreads, &pool_threads, 0);
    scipy_openblas_set_num_threads(std::max(pool_threads, 1));
    scipy_openblas_set_threads_callback_function(RunBlasJobsOnTVMPool);
    return true;
  }();
  (void)done;
}

// Row-major C[m, n] = A[m, k] @ (B[k, n] or B[n, k]^T).
void Sgemm(bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a, const float* b,
           float* c) {
  if (m == 0 || n == 0) return;
  UseTVMThreadPoolForBlas();
  if (k == 0) {
    std::fill(c, c + m * n, 0.0f);
    return;
  }
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, transpose_b ? CblasTrans : CblasNoTrans, m, n,
                    k, 1.0f, a, k, b, transpose_b ? k : n, 0.0f, c, n);
}

// ---------------------------------------------------------------------------------------------
// matmul

/*!
 * \brief out = a @ b (or a @ b^T over the last two axes), batch axes broadcast numpy-style.
 * a: [..., M, K], b: [..., K, N] or [..., N, K], out: [..., M, N].
 */
void Matmul(DLTensor* a, DLTensor* b, int64_t transpose_b, DLTensor* out) {
  CheckCompactFloat32(a, "a");
  CheckCompactFloat32(b, "b");
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK(a->ndim >= 2 && b->ndim >= 2 && out->ndim >= 2);
  const int64_t m = a->shape[a->ndim - 2], k = a->shape[a->ndim - 1];
  const int64_t n = transpose_b ? b->shape[b->ndim - 2] : b->shape[b->ndim - 1];
  TVM_FFI_ICHECK_EQ(k, transpose_b ? b->shape[b->ndim - 1] : b->shape[b->ndim - 2])
      << "gimlet.cpu.matmul: reduction lengths differ";
  TVM_FFI_ICHECK(out->shape[out->ndim - 2] == m && out->shape[out->ndim - 1] == n);
  const float* a_data = Data(a);
  const float* b_data = Data(b);
  float* out_data = Data(out);

  const int64_t b_batch = Product(b->shape, b->shape + b->ndim - 2);
  if (b_batch == 1) {
    // One weight matrix: fold every batch axis of a into M (a is compact).
    const int64_t rows = Product(a->shape, a->shape + a->ndim - 1);
    TVM_FFI_ICHECK_EQ(rows * n, Product(out->shape, out->shape + out->ndim));
    Sgemm(transpose_b != 0, rows, n, k, a_data, b_data, out_data);
    return;
  }
  // General broadcast: walk the output batch index, keeping offsets into a and b.
  const int batch_ndim = out->ndim - 2;
  std::vector<int64_t> a_stride(batch_ndim, 0), b_stride(batch_ndim, 0);
  {
    int64_t sa = m * k, sb = k * n;
    for (int d = batch_ndim - 1; d >= 0; --d) {
      const int ad = d - (batch_ndim - (a->ndim - 2));
      const int bd = d - (batch_ndim - (b->ndim - 2));
      const int64_t a_extent = ad >= 0 ? a->shape[ad] : 1;
      const int64_t b_extent = bd >= 0 ? b->shape[bd] : 1;
      TVM_FFI_ICHECK((a_extent == 1 || a_extent == out->shape[d]) &&
                     (b_extent == 1 || b_extent == out->shape[d]))
          << "gimlet.cpu.matmul: batch axes do not broadcast";
      a_stride[d] = a_extent == 1 ? 0 : sa;
      b_stride[d] = b_extent == 1 ? 0 : sb;
      sa *= a_extent;
      sb *= b_extent;
    }
  }
  const int64_t num_batches = Product(out->shape, out->shape + batch_ndim);
  std::vector<int64_t> index(batch_ndim, 0);
  int64_t a_offset = 0, b_offset = 0;
  for (int64_t i = 0; i < num_batches; ++i) {
    Sgemm(transpose_b != 0, m, n, k, a_data + a_offset, b_data + b_offset, out_data + i * m * n);
    for (int d = batch_ndim - 1; d >= 0; --d) {
      a_offset += a_stride[d];
      b_offset += b_stride[d];
      if (++index[d] < out->shape[d]) break;
      a_offset -= a_stride[d] * index[d];
      b_offset -= b_stride[d] * index[d];
      index[d] = 0;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// conv2d

struct Conv2DParams {
  int64_t stride_h, stride_w, pad_top, pad_left, dilation_h, dilation_w;
};

/*! \brief One NCHW / OIHW conv2d call, cut into work units of a few output rows each. */
struct Conv2DWork {
  const float* x;
  const float* w;
  float* y;
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

/*! \brief One work unit: out rows [oy0, oy1) of one image-group = weight @ unfolded input. */
void RunConv2DUnit(const Conv2DWork& t, int64_t unit, std::vector<float>* col) {
  const int64_t plane = unit / t.units_per_plane;  // image * groups + group
  const int64_t g = plane % t.groups, img = plane / t.groups;
  const int64_t oy0 = unit % t.units_per_plane * t.rows_per_unit;
  const int64_t oy1 = std::min(t.out_h, oy0 + t.rows_per_unit);
  const int64_t num_cols = (oy1 - oy0) * t.out_w, spatial = t.out_h * t.out_w;
  const int64_t reduction = t.group_in_c * t.kernel_h * t.kernel_w;
  const float* x = t.x + (img * t.in_c + g * t.group_in_c) * t.height * t.width;
  const float* cols = x + oy0 * t.out_w;
  int64_t ld_cols = spatial;
  if (!t.pointwise) {
    col->resize(reduction * num_cols);
    Im2Col(t, x, oy0, oy1, col->data());
    cols = col->data();
    ld_cols = num_cols;
  }
  float* y = t.y + (img * t.groups + g) * t.group_out_c * spatial + oy0 * t.out_w;
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, t.group_out_c, num_cols, reduction,
                    1.0f, t.w + g * t.group_out_c * reduction, reduction, cols, ld_cols, 0.0f, y,
                    spatial);
}

int RunConv2DUnits(int task_id, TVMParallelGroupEnv* penv, void* cdata) {
  const auto& work = *static_cast<const Conv2DWork*>(cdata);
  thread_local std::vector<float> col;
  const int64_t per_task = (work.num_units + penv->num_task - 1) / penv->num_task;
  const int64_t end = std::min(work.num_units, (task_id + 1) * per_task);
  for (int64_t unit = task_id * per_task; unit < end; ++unit) RunConv2DUnit(work, unit, &col);
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
 * cache-resident too. Otherwise whole planes are unfolded and multi-threaded sgemm splits them.
 */
void Conv2D(DLTensor* data, DLTensor* weight, const Conv2DParams& p, int64_t groups,
            DLTensor* out) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(weight, "weight");
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK(data->ndim == 4 && weight->ndim == 4 && out->ndim == 4);
  const int64_t batch = data->shape[0], in_c = data->shape[1];
  const int64_t out_c = weight->shape[0], group_in_c = weight->shape[1];
  TVM_FFI_ICHECK(groups >= 1 && in_c == group_in_c * groups && out_c % groups == 0);
  TVM_FFI_ICHECK(out->shape[0] == batch && out->shape[1] == out_c);
  Conv2DWork work{Data(data), Data(weight), Data(out), in_c, data->shape[2], data->shape[3],
                  group_in_c, out_c / groups, groups, weight->shape[2], weight->shape[3],
                  out->shape[2], out->shape[3], p};
  if (batch == 0 || out_c == 0 || work.out_h == 0 || work.out_w == 0) return;
  work.pointwise = work.kernel_h == 1 && work.kernel_w == 1 && p.stride_h == 1 &&
                   p.stride_w == 1 && p.pad_top == 0 && p.pad_left == 0 &&
                   work.out_h == work.height && work.out_w == work.width;
  const int64_t reduction = group_in_c * work.kernel_h * work.kernel_w;
  if (reduction == 0) {
    std::fill(work.y, work.y + batch * out_c * work.out_h * work.out_w, 0.0f);
    return;
  }
  UseTVMThreadPoolForBlas();
  const int64_t planes = batch * groups;
  if (work.out_h * work.out_w < 4 * work.group_out_c) {
    // Few output pixels per channel (deep layers): units would repack the large weight
    // matrix for a handful of columns each, so unfold whole planes and let BLAS split them.
    work.rows_per_unit = work.out_h;
    work.units_per_plane = 1;
    work.num_units = planes;
    thread_local std::vector<float> col;
    for (int64_t unit = 0; unit < work.num_units; ++unit) RunConv2DUnit(work, unit, &col);
    return;
  }
  const int64_t budget_rows = std::max<int64_t>(1, kColumnBudget / reduction / work.out_w);
  // At least 4 units in all, so two threads get balanced work on a single image.
  const int64_t balance_rows = std::max<int64_t>(1, work.out_h * planes / 4);
  work.rows_per_unit = std::min({budget_rows, balance_rows, work.out_h});
  work.units_per_plane = (work.out_h + work.rows_per_unit - 1) / work.rows_per_unit;
  work.num_units = planes * work.units_per_plane;
  // Each pool thread runs whole units with single-threaded BLAS (no nested parallelism).
  const int blas_threads = scipy_openblas_get_num_threads();
  scipy_openblas_set_num_threads(1);
  TVMBackendParallelLaunch(RunConv2DUnits, &work, 0);
  scipy_openblas_set_num_threads(blas_threads);
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef()
      .def_packed("gimlet.cpu.matmul",
                  [](PackedArgs args, tvm::ffi::Any*) {
                    // (a, b, transpose_b, out)
                    Matmul(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(),
                           args[2].cast<int64_t>(), args[3].cast<DLTensor*>());
                  })
      .def_packed("gimlet.cpu.conv2d_nchw", [](PackedArgs args, tvm::ffi::Any*) {
        // (data, weight, stride_h, stride_w, pad_top, pad_left, dilation_h, dilation_w,
        //  groups, out); bottom/right padding is implied by the output shape.
        Conv2DParams p{args[2].cast<int64_t>(), args[3].cast<int64_t>(), args[4].cast<int64_t>(),
                       args[5].cast<int64_t>(), args[6].cast<int64_t>(), args[7].cast<int64_t>()};
        Conv2D(args[0].cast<DLTensor*>(), args[1].cast<DLTensor*>(), p, args[8].cast<int64_t>(),
               args[9].cast<DLTensor*>());
      });
}

}  // namespace cpu
}  // namespace gimlet
