#include "cuda/common/cuda_check.h"

#include <mutex>
#include <vector>

namespace epx::cuda {

void throw_cuda_error(cudaError_t e, const char* what, const char* file, int line) {
  const char* base = file;
  for (const char* p = file; *p; ++p)
    if (*p == '/') base = p + 1;
  throw Error(Status::kCudaError, detail::concat("epx: ", what, " failed (", base, ":", line, "): ", cudaGetErrorName(e),
                                                 ": ", cudaGetErrorString(e)));
}

int sm_count() {
  static std::mutex mu;
  static std::vector<int> counts;
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lk(mu);
  if (static_cast<int>(counts.size()) <= dev) counts.resize(dev + 1, 0);
  if (!counts[dev]) EPX_CUDA_CHECK(cudaDeviceGetAttribute(&counts[dev], cudaDevAttrMultiProcessorCount, dev));
  return counts[dev];
}

}  // namespace epx::cuda
