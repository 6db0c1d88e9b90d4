#include "cuda/gemm/cutlass/trials/forward_trials.h"

namespace epx::cuda {

#define EPX_DECLARE_FORWARD_TRIAL(fn)                                                                                  \
  void fn(GroupedOperand a, GroupedOperand b, void* out, int64_t ld_out, int64_t K, int64_t N, const int32_t* offsets, \
          const int32_t* rows, int groups, Stream stream);
EPX_DECLARE_FORWARD_TRIAL(forward_trial_nosource)
EPX_DECLARE_FORWARD_TRIAL(dgrad_trial_nosource)
EPX_DECLARE_FORWARD_TRIAL(forward_trial_cluster2x1)
EPX_DECLARE_FORWARD_TRIAL(forward_trial_cluster1x2)
EPX_DECLARE_FORWARD_TRIAL(dgrad_trial_cluster2x1)
EPX_DECLARE_FORWARD_TRIAL(dgrad_trial_cluster1x2)
EPX_DECLARE_FORWARD_TRIAL(forward_trial_with_source)
EPX_DECLARE_FORWARD_TRIAL(dgrad_trial_with_source)
EPX_DECLARE_FORWARD_TRIAL(forward_trial_noc_epi_auto)
EPX_DECLARE_FORWARD_TRIAL(dgrad_trial_noc_epi_auto)
EPX_DECLARE_FORWARD_TRIAL(forward_trial_cooperative)
EPX_DECLARE_FORWARD_TRIAL(dgrad_trial_cooperative)
EPX_DECLARE_FORWARD_TRIAL(forward_trial_pingpong)
EPX_DECLARE_FORWARD_TRIAL(dgrad_trial_pingpong)
EPX_DECLARE_FORWARD_TRIAL(forward_trial_pingpong_noc_c21)
EPX_DECLARE_FORWARD_TRIAL(dgrad_trial_pingpong_noc_c21)
#undef EPX_DECLARE_FORWARD_TRIAL

const ForwardTrial* forward_trials(int& count) {
  static const ForwardTrial trials[] = {
      {"cooperative_nosource", false, forward_trial_nosource},
      {"cooperative_nosource", true, dgrad_trial_nosource},
      {"cooperative_cluster2x1", false, forward_trial_cluster2x1},
      {"cooperative_cluster1x2", false, forward_trial_cluster1x2},
      {"cooperative_cluster2x1", true, dgrad_trial_cluster2x1},
      {"cooperative_cluster1x2", true, dgrad_trial_cluster1x2},
      {"cooperative_with_source", false, forward_trial_with_source},
      {"cooperative_with_source", true, dgrad_trial_with_source},
      {"cooperative_noc_epi_auto", false, forward_trial_noc_epi_auto},
      {"cooperative_noc_epi_auto", true, dgrad_trial_noc_epi_auto},
      {"cooperative", false, forward_trial_cooperative},
      {"cooperative", true, dgrad_trial_cooperative},
      {"pingpong", false, forward_trial_pingpong},
      {"pingpong", true, dgrad_trial_pingpong},
      {"pingpong_noc_c21", false, forward_trial_pingpong_noc_c21},
      {"pingpong_noc_c21", true, dgrad_trial_pingpong_noc_c21},
  };
  count = static_cast<int>(sizeof(trials) / sizeof(trials[0]));
  return trials;
}

}  // namespace epx::cuda
