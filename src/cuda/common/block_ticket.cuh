// "Last block to arrive" tickets: each block of a grid publishes what it wrote and takes a ticket;
// the block that draws the last one reads everybody's results and finishes the reduction.
//
// One thread fences, after a CTA barrier, instead of a fence in every thread: the barrier orders the
// block's writes before thread 0's fence, which is cumulative (the pattern of cooperative groups'
// grid sync and CUTLASS's GenericBarrier). The fence is fence.acq_rel, not the fence.sc of
// __threadfence(): a release before the ticket and an acquire after it are all the pattern needs,
// and the sequentially consistent fence costs more on the kernel's critical path (the last block
// runs it twice after its own work).
#pragma once

namespace epx::cuda {

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

/// Block-uniform: every thread's global writes before the call are published, and the return value
/// says whether this block drew ticket `arrivals - 1` of *counter (then it may read what every other
/// block published -- with ld.cg or stronger, not through L1 -- and *counter is back to 0 for the
/// next launch). `flag` is a shared int of the block, free for the call.
__device__ __forceinline__ bool arrive_last(unsigned* counter, unsigned arrivals, int& flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_gpu();  // release: the block's writes before the ticket
    const unsigned ticket = atomicAdd(counter, 1u);
    const bool last = ticket == arrivals - 1u;
    if (last) {
      *counter = 0u;
      fence_acq_rel_gpu();  // acquire: the other blocks' writes, before the block reads them
    }
    flag = last;
  }
  __syncthreads();
  return flag != 0;
}

}  // namespace epx::cuda
