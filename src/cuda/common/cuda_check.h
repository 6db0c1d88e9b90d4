// Error checking for the CUDA backend: every runtime call and every launch is checked and turned
// into epx::Error naming the call and where it happened.
#pragma once

#include <cuda_runtime_api.h>

#include "epx/error.h"
#include "epx/tensor.h"

#define EPX_CUDA_CHECK_IMPL(expr, what)                                                          \
  do {                                                                                           \
    cudaError_t epx_err_ = (expr);                                                               \
    if (epx_err_ != cudaSuccess) ::epx::cuda::throw_cuda_error(epx_err_, what, __FILE__, __LINE__); \
  } while (0)

namespace epx::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line);

inline cudaStream_t to_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }

/// Multiprocessors of the current device (cached per device).
int sm_count();

/// Makes `device` current for a scope and restores the caller's device afterwards: an op runs on
/// its tensors' device without changing the caller's notion of the current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    EPX_CUDA_CHECK_IMPL(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) EPX_CUDA_CHECK_IMPL(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && previous_ >= 0 && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace epx::cuda

#define EPX_CUDA_CHECK(expr)                                                      \
  do {                                                                            \
    cudaError_t epx_err_ = (expr);                                                \
    if (epx_err_ != cudaSuccess) ::epx::cuda::throw_cuda_error(epx_err_, #expr, __FILE__, __LINE__); \
  } while (0)

/// After a <<<>>> launch: reports launch-configuration errors at once (not asynchronous faults).
#define EPX_CHECK_LAUNCH(kernel_name)                                             \
  do {                                                                            \
    cudaError_t epx_err_ = cudaGetLastError();                                    \
    if (epx_err_ != cudaSuccess) ::epx::cuda::throw_cuda_error(epx_err_, "launch of " kernel_name, __FILE__, __LINE__); \
  } while (0)
