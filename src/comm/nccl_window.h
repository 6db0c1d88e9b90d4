// The one place that touches NCCL's device API: turn a registered symmetric window into plain
// device pointers to every rank's copy (LSA pointers), so the EP kernels need no NCCL headers.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>

namespace epx::comm {

/// Writes base[p] = LSA pointer of rank p's window and inbox[p] = base[p] + inbox_offset for
/// p in [0, R), into the device arrays `base` and `inbox`. Stream-ordered.
void resolve_peer_windows(ncclWindow_t window, int num_ranks, size_t inbox_offset, char** base, unsigned** inbox,
                          cudaStream_t stream);

/// Ranks of this rank's LSA team (the ranks it can reach by load/store).
int lsa_team_size(ncclComm_t comm);

}  // namespace epx::comm
