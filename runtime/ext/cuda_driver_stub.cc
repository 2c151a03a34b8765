// A stand-in for the NVIDIA driver library (libcuda.so.1) on machines without one.
//
// TVM's CUDA runtime (libtvm_runtime_cuda.so) links against the driver; without it the
// library does not load, and TVM then embeds CUDA source instead of compiling it with nvcc.
// With this stub loaded first, the runtime loads, CUDA kernels are compiled to real fatbins,
// and every driver call answers "no device". Never loaded where a real driver exists.
// The entry points are those libtvm_runtime_cuda.so imports; arguments are ignored.

extern "C" {

typedef int CUresult;
static const CUresult kNoDevice = 100;  // CUDA_ERROR_NO_DEVICE

CUresult cuGetErrorName(CUresult, const char** name) {
  if (name) *name = "CUDA_ERROR_NO_DEVICE";
  return 0;
}

CUresult cuGetErrorString(CUresult, const char** text) {
  if (text) *text = "no NVIDIA driver on this machine (gimlet-tvm driver stub)";
  return 0;
}

CUresult cuDeviceGetName() { return kNoDevice; }
CUresult cuFuncSetAttribute() { return kNoDevice; }
CUresult cuLaunchKernelEx() { return kNoDevice; }
CUresult cuModuleGetFunction() { return kNoDevice; }
CUresult cuModuleLoadData() { return kNoDevice; }
CUresult cuModuleUnload() { return kNoDevice; }
CUresult cuTensorMapEncodeTiled() { return kNoDevice; }
}
