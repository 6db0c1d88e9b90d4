// The router's small kernels: count_routed (tokens per expert from the ids), router_losses (aux and z-loss
// from the statistics) and update_expert_bias (the aux-loss-free bias step).
#pragma once

#include "cuda/router/router_device.cuh"

namespace epx::cuda::router_kernels {

// ---- count_routed -------------------------------------------------------------------------------

// One thread per token. Global mode aggregates in a shared histogram first; sequence mode adds
// straight to counts[s, e]. Addends are integers, so the float sums are exact and order-free.
template <class C>
__global__ void __launch_bounds__(256) count_routed_kernel(const void* ids, int idx64, int64_t T, int K, int E,
                                                           int64_t L, int global_mode, C* counts, unsigned* status) {
  __shared__ unsigned hist[kMaxExperts];
  if (global_mode)
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0u;
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < T; t += stride) {
    int v[kMaxTopk];
    unsigned bad = 0;
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      v[k] = -1;
      if (k < K) {
        const int64_t o = t * K + k;
        const int64_t x = idx64 ? static_cast<const int64_t*>(ids)[o] : static_cast<const int32_t*>(ids)[o];
        if (x < -1 || x >= E)
          bad |= kStatusBadId;
        else
          v[k] = static_cast<int>(x);
      }
    }
#pragma unroll
    for (int k = 1; k < kMaxTopk; ++k)
#pragma unroll
      for (int k2 = 0; k2 < k; ++k2)
        if (v[k] >= 0 && v[k] == v[k2]) {
          bad |= kStatusRepeatedId;
          v[k] = -1;  // the first occurrence counts; v[k2] >= 0 keeps comparing the original id
        }
    if (bad) atomicOr(status, bad);
    const int64_t row = global_mode ? 0 : (t / L) * E;
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
      if (v[k] >= 0) {
        if (global_mode)
          atomicAdd(hist + v[k], 1u);
        else
          atomicAdd(counts + row + v[k], C(1));
      }
  }
  if (global_mode) {
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (hist[e] != 0u) atomicAdd(counts + e, static_cast<C>(hist[e]));
  }
}

// ---- router_losses ------------------------------------------------------------------------------

// One block. Sums in a fixed order (strided per thread, then a fixed tree), in the stats' dtype.
template <class Acc, class Out>
__global__ void __launch_bounds__(256) router_losses_kernel(const Acc* prob, const Acc* counts, const Acc* scalars,
                                                            Out* losses, int E, int K, int64_t S, int mode,
                                                            Acc coeff, Acc zcoeff, Acc L) {
  __shared__ Acc red[256];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const Acc tokens = scalars != nullptr ? scalars[1] : Acc(0);
  const Acc factor = coeff * static_cast<Acc>(E) / static_cast<Acc>(K);
  Acc aux = 0;
  if (mode == 1 && coeff > Acc(0) && tokens > Acc(0)) {
    Acc part = 0;
    for (int e = tid; e < E; e += 256) part += prob[e] * counts[e];
    red[tid] = part;
    __syncthreads();
    for (int off = 128; off > 0; off >>= 1) {
      if (tid < off) red[tid] += red[tid + off];
      __syncthreads();
    }
    aux = factor / (tokens * tokens) * red[0];
  } else if (mode == 2 && coeff > Acc(0) && S > 0) {
    Acc mine = 0;  // this warp's sequences, in order
    for (int64_t s = warp; s < S; s += 8) {
      Acc part = 0;
      for (int e = lane; e < E; e += 32) part += prob[s * E + e] * counts[s * E + e];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(kFull, part, o);
      mine += factor / (L * L) * part;
    }
    if (lane == 0) red[warp] = mine;
    __syncthreads();
    Acc total = 0;
    for (int w = 0; w < 8; ++w) total += red[w];
    aux = total / static_cast<Acc>(S);
  }
  Acc z = 0;
  if (zcoeff > Acc(0) && tokens > Acc(0)) z = zcoeff * scalars[0] / tokens;
  if (tid == 0) {
    losses[0] = static_cast<Out>(aux);
    losses[1] = static_cast<Out>(z);
  }
}

// ---- update_expert_bias -------------------------------------------------------------------------

// One block: sum(counts) in double (exact for integer counts), then the sign update per expert.
template <class C>
__global__ void __launch_bounds__(1024) update_expert_bias_kernel(float* bias, const C* counts, int64_t E,
                                                                  float rate) {
  __shared__ double red[1024];
  const int tid = threadIdx.x;
  double part = 0;
  for (int64_t e = tid; e < E; e += 1024) part += static_cast<double>(counts[e]);
  red[tid] = part;
  __syncthreads();
  for (int off = 512; off > 0; off >>= 1) {
    if (tid < off) red[tid] += red[tid + off];
    __syncthreads();
  }
  const double sum = red[0];
  for (int64_t e = tid; e < E; e += 1024) {
    const double diff = sum - static_cast<double>(E) * static_cast<double>(counts[e]);
    const float sign = diff > 0 ? 1.0f : diff < 0 ? -1.0f : 0.0f;
    bias[e] = bias[e] + rate * sign;
  }
}

}  // namespace epx::cuda::router_kernels
