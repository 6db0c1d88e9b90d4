// Per-warp row arithmetic shared by the single-GPU permute kernels (src/cuda/permute) and the EP
// kernels (src/comm): the weighted sum of a token's expert rows (combine, dispatch_backward) and the
// spread of one row to them with the row-weight dot products (combine_backward). One copy of the
// per-element order, so every path gives the same bits, and one place where the loads are batched.
//
// Both are written for the memory system: each lane keeps several 16-byte loads in flight before it
// uses any of them. Two compiler behaviours undid that before and are avoided on purpose:
//  - bf16 elements converted one by one (__bfloat162float on a Pack's fields) let the compiler
//    repack the halves of a load into new registers right after it, before the next loads went out
//    (pack_float reads them from the 32-bit words instead);
//  - a load of y between stores to d_y cannot be moved above those stores (the compiler does not know
//    they never alias), so spread_row loads a group of y rows before it stores.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/common/dtype_cuda.cuh"

namespace epx::cuda {

/// N elements of T moved as one access (16 bytes for the vector paths).
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

/// Element i of a pack as a float (bf16: from its 32-bit word, bf16_word_half_to_float).
template <class T, int N>
__device__ __forceinline__ float pack_float(const Pack<T, N>& p, int i) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && N % 2 == 0) {
    uint32_t w;
    memcpy(&w, reinterpret_cast<const char*>(&p) + (i / 2) * 4, 4);
    return bf16_word_half_to_float(w, i % 2);
  } else {
    return to_float(p.v[i]);
  }
}

/// Compacts, in slot order, the rows a warp's lanes hold (lane k < K: slot k's row, < 0 where it has
/// none here) and their weights into rows_s / w_s; returns how many. Ends with a warp barrier.
__device__ __forceinline__ int compact_rows(int32_t row, float w, int K, int lane, int32_t* rows_s, float* w_s) {
  const unsigned here = __ballot_sync(0xffffffffu, lane < K && row >= 0);
  if (lane < K && row >= 0) {
    const int at = __popc(here & ((1u << lane) - 1u));
    rows_s[at] = row;
    w_s[at] = w;
  }
  __syncwarp();
  return __popc(here);
}

/// dst[v] = sum over the n rows (in order) of w_k x in[rows[k]][v] (plain sum without weights), fp32
/// accumulation, one rounding, for the vectors v in [begin, end) that are lane + multiples of 32. kRows
/// rows x kUnroll vectors per lane are loaded before the first add; per element the rows still add in
/// order, so the sums are those of the plain loop.
template <int kRows, int kUnroll, class T, int N>
__device__ __forceinline__ void weighted_row_sum(const Pack<T, N>* in, int64_t nvec, const int32_t* rows,
                                                 const float* w, int n, bool weighted, Pack<T, N>* dst,
                                                 int64_t begin, int64_t end, int lane) {
  using P = Pack<T, N>;
  for (int64_t v0 = begin + lane; v0 < end; v0 += 32 * kUnroll) {
    float acc[kUnroll][N];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int i = 0; i < N; ++i) acc[u][i] = 0.0f;
    for (int k0 = 0; k0 < n; k0 += kRows) {
      P p[kRows][kUnroll];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int64_t base = static_cast<int64_t>(k0 + j < n ? rows[k0 + j] : 0) * nvec + v0;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (k0 + j < n && v0 + u * 32 < end) p[j][u] = in[base + u * 32];
      }
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        if (k0 + j >= n) break;
        const float wk = w[k0 + j];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (weighted) {
#pragma unroll
            for (int i = 0; i < N; ++i) acc[u][i] = fmaf(wk, pack_float(p[j][u], i), acc[u][i]);
          } else {
#pragma unroll
            for (int i = 0; i < N; ++i) acc[u][i] += pack_float(p[j][u], i);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v0 + u * 32 >= end) continue;
      P o;
#pragma unroll
      for (int i = 0; i < N; ++i) o.v[i] = from_float<T>(acc[u][i]);
      dst[v0 + u * 32] = o;
    }
  }
}

/// y rows spread_row loads before it stores: up to 4 where K <= 16 (the callers may take all 8 where
/// K <= 8: spread_y_rows_k8), 2 where K > 16 (whose KMAX dot products leave no registers for 4).
template <int KMAX>
constexpr int spread_group() {
  return KMAX > 16 ? 2 : 4;
}

/// The row g_in (nvec vectors, this lane's: lane + multiples of 32) to each of the n rows: d_y[row] =
/// w_k x g (g itself without weights); with y, dot[k] += <g, y[rows[k]]> per lane in element order
/// (the caller reduces dot across the warp). kGroup y rows load before their d_y rows are stored.
template <int KMAX, int kGroup, class T, int N>
__device__ __forceinline__ void spread_row(const Pack<T, N>* g_in, int64_t nvec, const int32_t* rows, const float* w,
                                           int n, bool weighted, Pack<T, N>* d_y, const Pack<T, N>* y,
                                           float (&dot)[KMAX], int lane) {
  using P = Pack<T, N>;
  static_assert(KMAX % kGroup == 0, "groups of y rows tile KMAX");
  for (int64_t v = lane; v < nvec; v += 32) {
    const P gp = g_in[v];
#pragma unroll
    for (int k0 = 0; k0 < KMAX; k0 += kGroup) {
      if (k0 >= n) break;
      P yp[kGroup];
      if (y) {
#pragma unroll
        for (int j = 0; j < kGroup; ++j)
          if (k0 + j < n) yp[j] = y[rows[k0 + j] * nvec + v];
      }
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        if (k0 + j >= n) break;
        P o;
        if (weighted) {
          const float wk = w[k0 + j];
#pragma unroll
          for (int i = 0; i < N; ++i) o.v[i] = from_float<T>(wk * pack_float(gp, i));
        } else {
          o = gp;
        }
        d_y[rows[k0 + j] * nvec + v] = o;
        if (y) {
#pragma unroll
          for (int i = 0; i < N; ++i) dot[k0 + j] = fmaf(pack_float(gp, i), pack_float(yp[j], i), dot[k0 + j]);
        }
      }
    }
  }
}

/// d_row_weights[rows[k]] = the warp's sum of the lanes' dot[k], for the n rows spread_row filled
/// (the same butterfly everywhere, so every path gives the same bits). Lane 0 stores.
template <int KMAX>
__device__ __forceinline__ void store_row_dots(const float (&dot)[KMAX], int n, const int32_t* rows,
                                               float* d_row_weights, int lane) {
#pragma unroll
  for (int k = 0; k < KMAX; ++k) {
    if (k >= n) break;
    float d = dot[k];
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) d += __shfl_xor_sync(0xffffffffu, d, m);
    if (lane == 0) d_row_weights[rows[k]] = d;
  }
}

}  // namespace epx::cuda
