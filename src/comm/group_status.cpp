#include "comm/group_status.h"

#include "core/ep_state.h"
#include "epx/error.h"

namespace epx::comm {

void raise_layout_status(const int32_t* s, int rank, int num_experts, int64_t recv_capacity_rows,
                         bool smaller_handles) {
  if (s[3] == 3)
    throw Error(Status::kInvalidArgument, detail::concat("epx::prepare: rank ", s[1], " prepared with top-k ", s[2],
                                                         ", this rank with ", s[4],
                                                         " (every rank must prepare the same layer)"));
  if (s[1] != kNoBadPair) {
    const int K = s[4] > 0 ? s[4] : 1;
    const int t = s[1] / K, k = s[1] % K;
    if (s[3] == 2)
      throw Error(Status::kInvalidArgument,
                  detail::concat("epx::prepare: topk_idx row ", t, " names expert ", s[2], " twice (slot ", k,
                                 "); each token picks distinct experts (the slot was treated as masked)"));
    throw Error(Status::kInvalidArgument,
                detail::concat("epx::prepare: topk_idx[", t, ", ", k, "] is ", s[2],
                               ", expected -1 (masked) or an expert id in [0, ", num_experts,
                               ") (the slot was treated as masked)"));
  }
  if (s[0] > 0 && smaller_handles)
    throw Error(Status::kCapacityExceeded,
                detail::concat("epx::dispatch_forward: rank ", rank, " would receive ", s[0], " expert-major rows ",
                               "more than the recv capacity of a handle (PrepareOptions::recv_capacity_rows, at most ",
                               "the group's ", recv_capacity_rows, "); nothing was written"));
  if (s[0] > 0)
    throw Error(Status::kCapacityExceeded,
                "epx::dispatch_forward: " +
                    recv_overflow_message(rank, recv_capacity_rows + s[0], recv_capacity_rows, recv_capacity_rows));
}

}  // namespace epx::comm
