// The operands of the FP8 grouped forward in the layouts Hopper's blockwise-scaled kernel reads:
// weights quantized with 128x128 blocks AND transposed to K-major in one pass, and the 1x128
// activation scales of quantize() regrouped into one M-major block per group (see
// grouped_gemm_cuda.h). Quantization is bit for bit epx/quant.h's FP8 block recipe.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_cuda.cuh"
#include "cuda/gemm/fp8_operands.h"
#include "cuda/quant/quant_kernels.cuh"

namespace epx::cuda {
namespace {

constexpr int kBlock = 128;
constexpr int kThreads = 256;
constexpr int kPitch = kBlock + 4;  // bytes per row of the transposed tile: word-aligned rows, fewer bank conflicts

// One 128x128 block of w[g] [K, N] per CTA, read from global memory once: each thread loads its
// 64 elements as 16-byte vectors (kVec elements; element by element where w is not 16-byte
// aligned) and keeps them in registers while the block's finite amax is reduced, then writes their
// codes transposed into shared memory, from where whole k-runs go out to w_q[g] [N, K]; the
// block's scale goes to w_scales[g][kb][nb]. (The first version read the block twice with 2-byte
// loads: 1/6 of HBM speed.)
template <class T>
__global__ void __launch_bounds__(kThreads) quantize_transpose_kernel(const T* __restrict__ w, uint8_t* __restrict__ w_q,
                                                                      float* __restrict__ w_scales, int64_t K,
                                                                      int64_t N, bool vector_loads) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  constexpr int kVecPerRow = kBlock / kVec;               // loads across one 128-element row
  constexpr int kRowsPerPass = kThreads / kVecPerRow;
  constexpr int kPasses = kBlock / kRowsPerPass;          // kPasses * kVec = 64 elements per thread
  __shared__ alignas(16) uint8_t tile[kBlock * kPitch];  // read back as 32-bit words
  __shared__ uint32_t warp_max[kThreads / 32];
  const int64_t nb = blockIdx.x, kb = blockIdx.y, g = blockIdx.z;
  const T* src = w + (g * K + kb * kBlock) * N + nb * kBlock;
  const int c = threadIdx.x % kVecPerRow, r0 = threadIdx.x / kVecPerRow;
  T v[kPasses][kVec];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const T* at = src + static_cast<int64_t>(r0 + p * kRowsPerPass) * N + c * kVec;
    if (vector_loads) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(at));
      memcpy(v[p], &raw, sizeof raw);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) v[p][e] = at[e];
    }
  }
  uint32_t amax = 0;
#pragma unroll
  for (int p = 0; p < kPasses; ++p)
#pragma unroll
    for (int e = 0; e < kVec; ++e) amax = max(amax, quant::finite_abs_bits(to_float(v[p][e])));
  for (int off = 16; off > 0; off >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = 0;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) amax = max(amax, warp_max[i]);
  const float mul = quant::fp8_block_multiplier(amax);
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int k = r0 + p * kRowsPerPass;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {  // the code of element (k, n) at [n][k]
      const uint32_t code = quant::canonical_nan_e4m3x4(quant::cvt_e4m3x2(__fmul_rn(to_float(v[p][e]), mul), 0.0f));
      tile[(c * kVec + e) * kPitch + k] = static_cast<uint8_t>(code & 0xffu);
    }
  }
  __syncthreads();
  uint8_t* dst = w_q + (g * N + nb * kBlock) * K + kb * kBlock;
  for (int i = threadIdx.x; i < kBlock * kBlock / 4; i += kThreads) {
    const int n = i / (kBlock / 4), k4 = (i % (kBlock / 4)) * 4;  // 4 codes per store, along k
    *reinterpret_cast<uint32_t*>(dst + n * K + k4) = *reinterpret_cast<const uint32_t*>(tile + n * kPitch + k4);
  }
  if (threadIdx.x == 0) w_scales[(g * (K / kBlock) + kb) * (N / kBlock) + nb] = quant::fp8_block_scale(amax);
}

// One thread per (k block j, row r), r fastest, so a warp's writes into a group's M-major block are
// contiguous; the group comes from a binary search of the row in offsets. (One block per group was
// latency-bound on a skewed layout: its largest group alone took most of a millisecond.)
__global__ void group_scales_kernel(const float* __restrict__ rowwise, float* __restrict__ grouped, int64_t total_rows,
                                    int64_t kb, const int32_t* __restrict__ offsets, const int32_t* __restrict__ rows,
                                    int groups) {
  const int64_t n = total_rows * kb;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i / total_rows, r = i % total_rows;
    int lo = 0, hi = groups;  // the last group g with offsets[g] <= r
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (offsets[mid] <= r) lo = mid;
      else hi = mid;
    }
    const int64_t off = offsets[lo], m = rows[lo];
    if (r < off || r - off >= m) continue;  // a padding row, or past the layout
    grouped[off * kb + j * m + (r - off)] = rowwise[r * kb + j];
  }
}

// One thread per (k block j, row r), r fastest: the writes are contiguous, the reads strided by
// k_blocks (a few MB in all, from L2).
__global__ void transpose_scales_kernel(const float* __restrict__ rowwise, float* __restrict__ mmajor,
                                        int64_t total_rows, int64_t padded_rows, int64_t kb) {
  const int64_t n = padded_rows * kb;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = i / padded_rows, r = i % padded_rows;
    mmajor[i] = r < total_rows ? rowwise[r * kb + j] : 0.0f;
  }
}

}  // namespace

void quantize_transpose_weights_fp8(const void* w, DType dtype, int64_t G, int64_t K, int64_t N, void* w_q,
                                    float* w_scales, Stream stream) {
  if (G == 0 || K == 0 || N == 0) return;
  const dim3 grid(static_cast<unsigned>(N / kBlock), static_cast<unsigned>(K / kBlock), static_cast<unsigned>(G));
  cudaStream_t s = to_cuda(stream);
  auto* q = static_cast<uint8_t*>(w_q);
  // Rows are 16-byte aligned (N is a multiple of 128); the base decides.
  const bool vec = reinterpret_cast<uintptr_t>(w) % 16 == 0;
  switch (dtype) {
    case DType::kF32:
      quantize_transpose_kernel<<<grid, kThreads, 0, s>>>(static_cast<const float*>(w), q, w_scales, K, N, vec);
      break;
    case DType::kBF16:
      quantize_transpose_kernel<<<grid, kThreads, 0, s>>>(static_cast<const __nv_bfloat16*>(w), q, w_scales, K, N, vec);
      break;
    default:
      quantize_transpose_kernel<<<grid, kThreads, 0, s>>>(static_cast<const __half*>(w), q, w_scales, K, N, vec);
      break;
  }
  EPX_CHECK_LAUNCH("quantize_transpose_kernel");
}

void group_activation_scales(const float* rowwise, float* grouped, int64_t total_rows, int64_t k_blocks,
                             const int32_t* offsets, const int32_t* rows, int groups, Stream stream) {
  if (groups == 0 || k_blocks == 0 || total_rows == 0) return;
  const int64_t n = total_rows * k_blocks;
  const int grid = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
  group_scales_kernel<<<grid, kThreads, 0, to_cuda(stream)>>>(rowwise, grouped, total_rows, k_blocks, offsets, rows,
                                                              groups);
  EPX_CHECK_LAUNCH("group_scales_kernel");
}

void transpose_activation_scales(const float* rowwise, float* mmajor, int64_t total_rows, int64_t padded_rows,
                                 int64_t k_blocks, Stream stream) {
  if (k_blocks == 0 || padded_rows == 0) return;
  const int64_t n = padded_rows * k_blocks;
  const int grid = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
  transpose_scales_kernel<<<grid, kThreads, 0, to_cuda(stream)>>>(rowwise, mmajor, total_rows, padded_rows, k_blocks);
  EPX_CHECK_LAUNCH("transpose_scales_kernel");
}

}  // namespace epx::cuda
