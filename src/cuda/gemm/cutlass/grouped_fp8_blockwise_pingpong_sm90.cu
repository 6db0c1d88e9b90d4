// The ping-pong FP8 block-scaled grouped forward (grouped_fp8_sm90.cuh): its own translation unit so
// the two schedules compile in parallel.
#include "cuda/gemm/cutlass/grouped_fp8_sm90.cuh"

namespace epx::cuda {

void grouped_forward_fp8_blockwise_pingpong(const void* a, const float* a_scales, const void* bt,
                                            const float* b_scales, void* out, int64_t ld_out, int64_t K, int64_t N,
                                            const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  grouped_fp8::forward<grouped_fp8::Pingpong>(a, a_scales, bt, b_scales, out, ld_out, K, N, offsets, rows, groups,
                                              stream);
}

}  // namespace epx::cuda
