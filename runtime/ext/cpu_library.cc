/*!
 * \file cpu_library.cc
 * \brief fp32 matmul and NCHW conv2d on OpenBLAS (scipy-openblas32), as TVM packed functions.
 *
 * All functions use destination-passing style: inputs first, the output tensor last.
 * Tensors must be compact row-major float32 on the CPU.
 *
 * Threading: OpenBLAS runs its parallel jobs on TVM's own thread pool (through
 * scipy_openblas_set_threads_callback_function), with as many threads as that pool has.
 * Two separate pools on 2 cores (OpenBLAS pthreads next to TVM workers that spin after
 * each parallel region) cost time on every library call that follows a TVM kernel; with one
 * pool, library calls and generated kernels never compete for cores.
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

/*!
 * \brief Unfold one image's channels [c0, c0 + channels) into columns:
 * col[(c * kh + i) * kw + j, oy * out_w + ox] = x[c, oy*sh - pt + i*dh, ox*sw - pl + j*dw].
 */
void Im2Col(const float* x, int64_t channels, int64_t height, int64_t width, int64_t kernel_h,
            int64_t kernel_w, int64_t out_h, int64_t out_w, const Conv2DParams& p, float* col) {
  for (int64_t c = 0; c < channels; ++c) {
    const float* x_c = x + c * height * width;
    for (int64_t i = 0; i < kernel_h; ++i) {
      for (int64_t j = 0; j < kernel_w; ++j) {
        float* col_row = col + ((c * kernel_h + i) * kernel_w + j) * out_h * out_w;
        for (int64_t oy = 0; oy < out_h; ++oy) {
          const int64_t y = oy * p.stride_h - p.pad_top + i * p.dilation_h;
          float* dst = col_row + oy * out_w;
          if (y < 0 || y >= height) {
            std::fill(dst, dst + out_w, 0.0f);
            continue;
          }
          const float* x_row = x_c + y * width;
          const int64_t x0 = j * p.dilation_w - p.pad_left;
          if (p.stride_w == 1) {
            // Contiguous source: zero the padded edges, copy the middle.
            const int64_t lo = std::clamp<int64_t>(-x0, 0, out_w);
            const int64_t hi = std::clamp<int64_t>(width - x0, lo, out_w);
            std::fill(dst, dst + lo, 0.0f);
            std::memcpy(dst + lo, x_row + x0 + lo, (hi - lo) * sizeof(float));
            std::fill(dst + hi, dst + out_w, 0.0f);
          } else {
            for (int64_t ox = 0; ox < out_w; ++ox) {
              const int64_t xx = x0 + ox * p.stride_w;
              dst[ox] = (xx >= 0 && xx < width) ? x_row[xx] : 0.0f;
            }
          }
        }
      }
    }
  }
}

/*!
 * \brief NCHW / OIHW conv2d: per image and group, out = weight @ im2col(data).
 * data: [N, C, H, W], weight: [O, C / groups, KH, KW], out: [N, O, OH, OW].
 */
void Conv2D(DLTensor* data, DLTensor* weight, const Conv2DParams& p, int64_t groups,
            DLTensor* out) {
  CheckCompactFloat32(data, "data");
  CheckCompactFloat32(weight, "weight");
  CheckCompactFloat32(out, "out");
  TVM_FFI_ICHECK(data->ndim == 4 && weight->ndim == 4 && out->ndim == 4);
  const int64_t batch = data->shape[0], in_c = data->shape[1], height = data->shape[2],
                width = data->shape[3];
  const int64_t out_c = weight->shape[0], group_in_c = weight->shape[1],
                kernel_h = weight->shape[2], kernel_w = weight->shape[3];
  const int64_t out_h = out->shape[2], out_w = out->shape[3];
  TVM_FFI_ICHECK(groups >= 1 && in_c == group_in_c * groups && out_c % groups == 0);
  TVM_FFI_ICHECK(out->shape[0] == batch && out->shape[1] == out_c);
  const int64_t group_out_c = out_c / groups;
  const int64_t spatial = out_h * out_w;
  const int64_t reduction = group_in_c * kernel_h * kernel_w;
  const bool pointwise = kernel_h == 1 && kernel_w == 1 && p.stride_h == 1 && p.stride_w == 1 &&
                         p.pad_top == 0 && p.pad_left == 0 && out_h == height && out_w == width;
  std::vector<float> col(pointwise ? 0 : reduction * spatial);
  const float* x = Data(data);
  const float* w = Data(weight);
  float* y = Data(out);
  for (int64_t img = 0; img < batch; ++img) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* x_g = x + (img * in_c + g * group_in_c) * height * width;
      const float* cols = x_g;
      if (!pointwise) {
        Im2Col(x_g, group_in_c, height, width, kernel_h, kernel_w, out_h, out_w, p, col.data());
        cols = col.data();
      }
      Sgemm(false, group_out_c, spatial, reduction, w + g * group_out_c * reduction, cols,
            y + (img * out_c + g * group_out_c) * spatial);
    }
  }
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
