/*!
 * \file cuda_library.cc
 * \brief fp32 matmul on cuBLAS, as a TVM packed function (kernel selection's CUDA library
 * candidate).
 *
 * `gimlet.cuda.matmul(a, b, out)`, destination-passing style: `a` [..., M, K] by `b` [K, N]
 * into `out` [..., M, N], all compact row-major float32 on one CUDA device. The leading axes
 * of `a` are rows of one GEMM. cuBLAS is column-major: the row-major product C = A B is
 * computed as its transpose, C^T = B^T A^T, where a row-major matrix read column-major is
 * its transpose, so no data moves. cuBLAS's default math mode: fp32 arithmetic, no TF32 (the
 * results are checked against the same reference as every other candidate).
 *
 * Runs on the stream TVM has current for the device, with one cuBLAS handle per thread and
 * device.
 */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/reflection/registry.h>

#include <cstdint>
#include <limits>
#include <unordered_map>

namespace gimlet {
namespace cuda {

namespace {

void Check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    TVM_FFI_THROW(RuntimeError) << "gimlet.cuda: " << what << ": " << cudaGetErrorString(status);
  }
}

void Check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    TVM_FFI_THROW(RuntimeError) << "gimlet.cuda: " << what << ": " << cublasGetStatusString(status);
  }
}

void CheckCompactFloat32(const DLTensor* t, const char* name, int device_id) {
  TVM_FFI_ICHECK(t->dtype.code == kDLFloat && t->dtype.bits == 32 && t->dtype.lanes == 1)
      << "gimlet.cuda: " << name << " must be float32";
  TVM_FFI_ICHECK(t->device.device_type == kDLCUDA && t->device.device_id == device_id)
      << "gimlet.cuda: " << name << " must be on CUDA device " << device_id;
  if (t->strides == nullptr) return;
  int64_t expected = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    TVM_FFI_ICHECK(t->shape[i] == 1 || t->strides[i] == expected)
        << "gimlet.cuda: " << name << " must be compact";
    expected *= t->shape[i];
  }
}

float* Data(const DLTensor* t) {
  return reinterpret_cast<float*>(static_cast<char*>(t->data) + t->byte_offset);
}

int AsInt(int64_t value, const char* name) {
  TVM_FFI_ICHECK(value <= std::numeric_limits<int>::max())
      << "gimlet.cuda: " << name << " = " << value << " is too large for cuBLAS";
  return static_cast<int>(value);
}

// The calling thread's cuBLAS handle for `device_id` (the device must be current), bound to
// TVM's current stream for the device.
cublasHandle_t Handle(int device_id) {
  thread_local std::unordered_map<int, cublasHandle_t> handles;
  auto found = handles.find(device_id);
  if (found == handles.end()) {
    cublasHandle_t handle;
    Check(cublasCreate(&handle), "creating a cuBLAS handle");
    found = handles.emplace(device_id, handle).first;
  }
  auto stream = static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, device_id));
  Check(cublasSetStream(found->second, stream), "setting the cuBLAS stream");
  return found->second;
}

void Matmul(DLTensor* a, DLTensor* b, DLTensor* out) {
  const int device_id = out->device.device_id;
  CheckCompactFloat32(a, "a", device_id);
  CheckCompactFloat32(b, "b", device_id);
  CheckCompactFloat32(out, "out", device_id);
  TVM_FFI_ICHECK(a->ndim >= 2 && b->ndim == 2 && out->ndim == a->ndim)
      << "gimlet.cuda.matmul: takes a [..., M, K] by b [K, N] into out [..., M, N]";
  const int64_t k = a->shape[a->ndim - 1], n = b->shape[1];
  int64_t rows = 1;
  for (int i = 0; i < a->ndim - 1; ++i) {
    TVM_FFI_ICHECK(out->shape[i] == a->shape[i]) << "gimlet.cuda.matmul: out's leading axes";
    rows *= a->shape[i];
  }
  TVM_FFI_ICHECK(b->shape[0] == k && out->shape[out->ndim - 1] == n)
      << "gimlet.cuda.matmul: a's K must match b's rows, and out's columns b's";
  if (rows == 0 || n == 0) return;
  Check(cudaSetDevice(device_id), "selecting the device");
  cublasHandle_t handle = Handle(device_id);
  if (k == 0) {
    cudaStream_t stream;
    Check(cublasGetStream(handle, &stream), "reading the cuBLAS stream");
    Check(cudaMemsetAsync(Data(out), 0, rows * n * sizeof(float), stream), "zeroing out");
    return;
  }
  const float alpha = 1.0f, beta = 0.0f;
  // Column-major: out^T [n x rows] = b^T [n x k] * a^T [k x rows].
  Check(cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, AsInt(n, "N"), AsInt(rows, "M"),
                    AsInt(k, "K"), &alpha, Data(b), AsInt(n, "N"), Data(a), AsInt(k, "K"),
                    &beta, Data(out), AsInt(n, "N")),
        "cublasSgemm");
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  namespace refl = tvm::ffi::reflection;
  refl::GlobalDef().def("gimlet.cuda.matmul", [](DLTensor* a, DLTensor* b, DLTensor* out) {
    Matmul(a, b, out);
  });
}

}  // namespace cuda
}  // namespace gimlet
