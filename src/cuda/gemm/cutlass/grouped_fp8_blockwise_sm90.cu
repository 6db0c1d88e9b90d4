// The cooperative FP8 block-scaled grouped forward, and the choice between the schedules
// (grouped_fp8_sm90.cuh).
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/gemm/cutlass/grouped_fp8_sm90.cuh"
#ifdef EPX_GEMM_TRIALS
#include "cuda/gemm/cutlass/trials/fp8_forward_trials.h"
#endif
#include "epx/error.h"

namespace epx::cuda {

Fp8GemmSchedule fp8_gemm_schedule(int64_t row_capacity, int groups, int64_t row_align) {
  const bool aligned = row_align > 0 && row_align % 128 == 0;
  const char* v = std::getenv("EPX_FP8_GEMM_KERNEL");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) {
    if (groups > 0 && row_capacity <= 64 * static_cast<int64_t>(groups)) return Fp8GemmSchedule::kPingpong;
    return aligned ? Fp8GemmSchedule::kContiguous : Fp8GemmSchedule::kCooperative;
  }
  if (std::strcmp(v, "cooperative") == 0) return Fp8GemmSchedule::kCooperative;
  if (std::strcmp(v, "pingpong") == 0) return Fp8GemmSchedule::kPingpong;
  if (std::strcmp(v, "contiguous") == 0) {
    require(aligned, "epx::grouped_gemm_forward_fp8", "EPX_FP8_GEMM_KERNEL is contiguous, which needs every group to ",
            "start at a multiple of 128 rows; row_align is ", row_align, ", expected a multiple of 128");
    return Fp8GemmSchedule::kContiguous;
  }
#ifdef EPX_GEMM_TRIALS
  if (fp8_forward_trial_named(v) != nullptr) return Fp8GemmSchedule::kCooperative;  // a pointer-array candidate
#endif
  throw Error(Status::kInvalidArgument, detail::concat("epx: EPX_FP8_GEMM_KERNEL is \"", v,
                                                       "\", expected auto, cooperative, pingpong or contiguous"));
}

std::vector<const char*> fp8_gemm_schedule_names() {
  std::vector<const char*> names = {"cooperative", "pingpong", "contiguous"};
#ifdef EPX_GEMM_TRIALS
  int count = 0;
  const Fp8ForwardTrial* trials = fp8_forward_trials(count);
  for (int i = 0; i < count; ++i) names.push_back(trials[i].name);
#endif
  return names;
}

void grouped_forward_fp8_blockwise(const void* a, const float* a_scales, const void* bt, const float* b_scales,
                                   void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets,
                                   const int32_t* rows, int groups, int64_t row_capacity, Stream stream) {
#ifdef EPX_GEMM_TRIALS
  if (const Fp8ForwardTrial* t = fp8_forward_trial_named(std::getenv("EPX_FP8_GEMM_KERNEL")))
    return t->run(a, a_scales, bt, b_scales, out, ld_out, K, N, offsets, rows, groups, stream);
#endif
  if (fp8_gemm_schedule(row_capacity, groups) == Fp8GemmSchedule::kPingpong)
    return grouped_forward_fp8_blockwise_pingpong(a, a_scales, bt, b_scales, out, ld_out, K, N, offsets, rows, groups,
                                                  stream);
  grouped_fp8::forward<grouped_fp8::Cooperative>(a, a_scales, bt, b_scales, out, ld_out, K, N, offsets, rows, groups,
                                                 stream);
}

}  // namespace epx::cuda
