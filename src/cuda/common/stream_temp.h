// A temporary from the stream-ordered pool (cudaMallocAsync on a stream), given back in stream
// order (cudaFreeAsync) when it goes out of scope, after every reader has been queued on that
// stream: no host synchronisation and no device-wide allocation, so it is safe inside a CUDA graph
// capture and while peers' collectives are in flight.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/common/cuda_check.h"

namespace epx::cuda {

class StreamTemp {
 public:
  StreamTemp(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) EPX_CUDA_CHECK(cudaMallocAsync(&p_, bytes, stream_));
  }
  ~StreamTemp() {
    if (p_) cudaFreeAsync(p_, stream_);
  }
  StreamTemp(const StreamTemp&) = delete;
  StreamTemp& operator=(const StreamTemp&) = delete;

  /// Null for zero bytes.
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace epx::cuda
