#include "core/version.h"

#include <cstdio>

#ifdef EPX_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#ifndef EPX_VERSION
#define EPX_VERSION "0.0.0"
#endif
#ifndef EPX_BUILD_TYPE
#define EPX_BUILD_TYPE "unknown"
#endif
#ifndef EPX_CUDA_ARCH_LIST
#define EPX_CUDA_ARCH_LIST ""
#endif

namespace epx {

BuildInfo build_info() {
  BuildInfo b;
  b.version = EPX_VERSION;
  b.build_type = EPX_BUILD_TYPE;
#ifdef EPX_HAVE_CUDA
  b.cuda_backend = true;
#ifdef EPX_HAVE_CUTLASS
  b.gpu_grouped_gemm = true;
#endif
  b.cuda_archs = EPX_CUDA_ARCH_LIST;
  auto ver = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  b.cuda_runtime = ver(rt);
  b.cuda_driver = cudaDriverGetVersion(&drv) == cudaSuccess && drv ? ver(drv) : "none";
  int nv = 0;
  ncclGetVersion(&nv);
  b.nccl = std::to_string(nv / 10000) + "." + std::to_string(nv / 100 % 100) + "." + std::to_string(nv % 100);
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    n = 0;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    char mem[32];
    std::snprintf(mem, sizeof mem, "%.1f GiB", p.totalGlobalMem / 1073741824.0);
    b.devices.push_back("cuda:" + std::to_string(i) + " " + p.name + ", " + std::to_string(p.multiProcessorCount) +
                        " SMs, " + mem + ", sm_" + std::to_string(p.major) + std::to_string(p.minor));
  }
#endif
  return b;
}

}  // namespace epx
