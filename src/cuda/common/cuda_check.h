// Error checking for the CUDA backend: every runtime call and every launch is checked and turned
// into epx::Error naming the call and where it happened.
#pragma once

#include <cuda_runtime_api.h>

#include "epx/error.h"
#include "epx/tensor.h"

namespace epx::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line);

inline cudaStream_t to_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }

/// Multiprocessors of the current device (cached per device).
int sm_count();

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
