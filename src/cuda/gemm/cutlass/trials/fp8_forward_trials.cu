#include <cstring>

#include "cuda/gemm/cutlass/trials/fp8_forward_trials.h"

namespace epx::cuda {

#define EPX_DECLARE_FP8_TRIAL(fn)                                                                                 \
  void fn(const void* a, const float* a_scales, const void* bt, const float* b_scales, void* out, int64_t ld_out, \
          int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int groups, Stream stream);
EPX_DECLARE_FP8_TRIAL(fp8_trial_cooperative_cluster2x1)
EPX_DECLARE_FP8_TRIAL(fp8_trial_cooperative_cluster1x2)
EPX_DECLARE_FP8_TRIAL(fp8_trial_cooperative_wait)
EPX_DECLARE_FP8_TRIAL(fp8_trial_pingpong_wait)
EPX_DECLARE_FP8_TRIAL(fp8_trial_cooperative_with_source)
EPX_DECLARE_FP8_TRIAL(fp8_trial_cooperative_epi_auto)
EPX_DECLARE_FP8_TRIAL(fp8_trial_cooperative_epi128x128)
#undef EPX_DECLARE_FP8_TRIAL

const Fp8ForwardTrial* fp8_forward_trials(int& count) {
  static const Fp8ForwardTrial trials[] = {
      {"cooperative_cluster2x1", fp8_trial_cooperative_cluster2x1},
      {"cooperative_cluster1x2", fp8_trial_cooperative_cluster1x2},
      {"cooperative_wait", fp8_trial_cooperative_wait},
      {"pingpong_wait", fp8_trial_pingpong_wait},
      {"cooperative_with_source", fp8_trial_cooperative_with_source},
      {"cooperative_epi_auto", fp8_trial_cooperative_epi_auto},
      {"cooperative_epi128x128", fp8_trial_cooperative_epi128x128},
  };
  count = static_cast<int>(sizeof(trials) / sizeof(trials[0]));
  return trials;
}

const Fp8ForwardTrial* fp8_forward_trial_named(const char* name) {
  if (name == nullptr) return nullptr;
  int count = 0;
  const Fp8ForwardTrial* trials = fp8_forward_trials(count);
  for (int i = 0; i < count; ++i)
    if (std::strcmp(trials[i].name, name) == 0) return &trials[i];
  return nullptr;
}

}  // namespace epx::cuda
