// Programmatic dependent launch for back-to-back kernels on one stream (Hopper and later).
//
// A kernel launched with launch_after_previous() may be scheduled while the kernel before it on the
// stream is still finishing: its blocks take SMs as the previous grid's blocks leave, and each waits
// at its first instruction (wait_for_previous_grid) until that grid has completed and its memory is
// visible. What is saved is the launch latency between the two grids (the gap between one kernel's
// last block and the next kernel's first), which is a visible part of a decode-sized EP op.
//
// Rules that keep stream order intact:
//  - a kernel launched this way calls wait_for_previous_grid() before it touches global memory. The
//    wait covers everything earlier on the stream: the previous grid itself waited for its own
//    predecessor before it could complete;
//  - a kernel may call allow_next_grid() once it no longer needs SM room for its own blocks; the
//    next grid still cannot read what this one writes before it completes (the wait above), so the
//    trigger only moves the next launch earlier;
//  - kernels launched with <<<>>> are unaffected: they start after the previous grid completes.
// EPX_PDL=0 launches plainly (the device calls are then no-ops), for comparisons.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/common/cuda_check.h"

namespace epx::cuda {

/// Whether launch_after_previous() asks for programmatic serialization (EPX_PDL=0|1, default 1;
/// read once).
bool dependent_launch_enabled();

/// The kernel's first statement when it is launched with launch_after_previous().
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Lets the stream's next grid be scheduled once every block of this grid has called it or exited.
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// kernel<<<grid, block, smem, stream>>>(args...), allowed to overlap the previous grid's end.
/// Launch errors throw epx::Error naming `name`.
template <class... Params, class... Args>
void launch_after_previous(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                           cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = dependent_launch_enabled() ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) throw_cuda_error(e, name, __FILE__, __LINE__);
}

}  // namespace epx::cuda
