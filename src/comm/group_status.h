// Turns the layout status words a GPU group keeps on the device (first bad pair, its id and kind,
// the largest recv overflow) into the epx::Error that Group::check() raises, with the messages the
// host reference raises at once.
#pragma once

#include <cstdint>

namespace epx::comm {

/// s = {overflow rows, bad pair (kNoBadPair = none), its id, kind (1 out of range, 2 repeated,
/// 3 another top-k on rank s[1] with K s[2]), K}. Throws the first error found, else returns.
/// smaller_handles: a handle with fewer rows than the group's was prepared since the last check,
/// so the overflow may be against that handle's capacity (the device keeps only the excess).
void raise_layout_status(const int32_t* s, int rank, int num_experts, int64_t recv_capacity_rows,
                         bool smaller_handles);

}  // namespace epx::comm
