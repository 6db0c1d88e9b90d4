#include "cuda/gemm/cutlass/trials/wgrad_trials.h"

namespace epx::cuda {

#define EPX_DECLARE_TRIAL(fn)                                                                                  \
  void fn(GroupedOperand a, GroupedOperand d, void* out, int64_t out_group_stride, int64_t K, int64_t N,      \
          const int32_t* offsets, const int32_t* rows, int groups, Stream stream);
EPX_DECLARE_TRIAL(wgrad_trial_coop_epi128x64)
EPX_DECLARE_TRIAL(wgrad_trial_coop_epi128x64_noc)
EPX_DECLARE_TRIAL(wgrad_trial_coop_epi128x128_noc)
EPX_DECLARE_TRIAL(wgrad_trial_pingpong_epi64x64_noc)
EPX_DECLARE_TRIAL(wgrad_trial_pingpong_epi64x128_noc)
EPX_DECLARE_TRIAL(wgrad_trial_coop256x128_epi128x64_noc)
EPX_DECLARE_TRIAL(wgrad_trial_pingpong_epi64x64_noc_f32)
EPX_DECLARE_TRIAL(wgrad_trial_coop_epi128x64_noc_f32)
EPX_DECLARE_TRIAL(wgrad_trial_pingpong_epi64x32_noc_f32)
EPX_DECLARE_TRIAL(wgrad_trial_pingpong_epi64x64_noc_c21)
EPX_DECLARE_TRIAL(wgrad_trial_pingpong_epi64x64_noc_c12)
EPX_DECLARE_TRIAL(wgrad_trial_coop_epi128x128_noc_c12)
EPX_DECLARE_TRIAL(wgrad_trial_pingpong_epi64x64_noc_c21_f32)
EPX_DECLARE_TRIAL(wgrad_trial_coop_epi128x128_noc_c21_f32)
#undef EPX_DECLARE_TRIAL

const WgradTrial* wgrad_trials(int& count) {
  static const WgradTrial trials[] = {
      {"coop_epi128x64", false, wgrad_trial_coop_epi128x64},
      {"coop_epi128x64_noc", false, wgrad_trial_coop_epi128x64_noc},
      {"coop_epi128x128_noc", false, wgrad_trial_coop_epi128x128_noc},
      {"pingpong_epi64x64_noc", false, wgrad_trial_pingpong_epi64x64_noc},
      {"pingpong_epi64x128_noc", false, wgrad_trial_pingpong_epi64x128_noc},
      {"coop256x128_epi128x64_noc", false, wgrad_trial_coop256x128_epi128x64_noc},
      {"pingpong_epi64x64_noc", true, wgrad_trial_pingpong_epi64x64_noc_f32},
      {"coop_epi128x64_noc", true, wgrad_trial_coop_epi128x64_noc_f32},
      {"pingpong_epi64x32_noc", true, wgrad_trial_pingpong_epi64x32_noc_f32},
      {"pingpong_epi64x64_noc_cluster2x1", false, wgrad_trial_pingpong_epi64x64_noc_c21},
      {"pingpong_epi64x64_noc_cluster1x2", false, wgrad_trial_pingpong_epi64x64_noc_c12},
      {"coop_epi128x128_noc_cluster1x2", false, wgrad_trial_coop_epi128x128_noc_c12},
      {"pingpong_epi64x64_noc_cluster2x1", true, wgrad_trial_pingpong_epi64x64_noc_c21_f32},
      {"coop_epi128x128_noc_cluster2x1", true, wgrad_trial_coop_epi128x128_noc_c21_f32},
  };
  count = static_cast<int>(sizeof(trials) / sizeof(trials[0]));
  return trials;
}

}  // namespace epx::cuda
