// What this build is: version, flags, and what the CUDA backend sees at run time.
#pragma once

#include <string>
#include <vector>

namespace epx {

struct BuildInfo {
  std::string version;
  std::string build_type;
  bool cuda_backend = false;
  bool gpu_grouped_gemm = false;  // the CUTLASS kernels the GPU expert FFN needs were built
  std::string cuda_runtime, cuda_driver, nccl, cuda_archs;
  std::vector<std::string> devices;  // "cuda:0 NVIDIA H200, 132 SMs, 139.8 GiB, sm_90"
};

BuildInfo build_info();

}  // namespace epx
