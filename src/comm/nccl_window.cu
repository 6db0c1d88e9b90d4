#include "comm/nccl_window.h"

#include <nccl_device.h>

#include "cuda/common/cuda_check.h"

namespace epx::comm {
namespace {

__global__ void resolve_kernel(ncclWindow_t window, int R, size_t inbox_offset, char** base, unsigned** inbox) {
  for (int p = threadIdx.x; p < R; p += blockDim.x) {
    char* b = static_cast<char*>(ncclGetPeerPointer(window, 0, p));
    base[p] = b;
    inbox[p] = reinterpret_cast<unsigned*>(b + inbox_offset);
  }
}

}  // namespace

void resolve_peer_windows(ncclWindow_t window, int num_ranks, size_t inbox_offset, char** base, unsigned** inbox,
                          cudaStream_t stream) {
  resolve_kernel<<<1, 64, 0, stream>>>(window, num_ranks, inbox_offset, base, inbox);
  EPX_CHECK_LAUNCH("resolve_kernel");
}

int lsa_team_size(ncclComm_t comm) { return ncclTeamLsa(comm).nRanks; }

}  // namespace epx::comm
