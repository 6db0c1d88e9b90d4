// Row movement between token order and the expert-major layout, one warp per token.
//
// Work items: the T tokens, then the E_local experts whose padding rows must be zeroed; warps
// stride over them. A token's warp first publishes its K destination rows (lane k owns slot k) in
// shared memory, then streams the row in 16-byte vectors, several loads in flight per lane
// (UNROLL), each value stored to every destination. Reductions (combine, dispatch_backward) keep
// one fp32 accumulator per element and add the slots in ascending order, so every output element
// is computed by one thread in one fixed order: bit-identical run to run and equal to the CPU
// reference. The dot products of combine_backward reduce per lane in element order and then
// across the warp with a fixed butterfly: deterministic, but not the reference's sequential
// order (compared with a tolerance).
#pragma once

#include <cstdint>

#include "cuda/common/dtype_cuda.cuh"

namespace epx::cuda::permute {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

struct Layout {
  int T, K, Le;
  const int32_t* routed;          // [T, K]
  const int32_t* pair_pos;        // [T, K]
  const int32_t* offsets;         // [Le + 1]
  const int32_t* expert_rows;     // [Le]
  int32_t* recv_row;              // [T, K] (the one-rank slice of [1, max_tokens, K])
};

// ---- dispatch: copy ------------------------------------------------------------------------

struct PermuteArgs {
  Layout L;
  int64_t capacity;
  const char* x;
  int64_t row_bytes;
  const char* x_scales;
  int64_t scale_bytes;
  const float* topk_weights;  // [T, K] or null
  char* recv;
  char* recv_scales;
  float* recv_weights;        // or null
};

template <class V>
__device__ __forceinline__ void zero_row(char* base, int64_t bytes, int lane) {
  V* p = reinterpret_cast<V*>(base);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t v = lane; v < n; v += 32) p[v] = V{};
}

template <class V>
__device__ __forceinline__ void copy_bytes_to_rows(const char* src, int64_t bytes, char* dst_base, int64_t dst_stride,
                                                   const int32_t* rows, int K, int lane) {
  const V* s = reinterpret_cast<const V*>(src);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t v0 = lane; v0 < n; v0 += 32 * kUnroll) {
    V val[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * 32;
      if (v < n) val[u] = s[v];
    }
    for (int k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r < 0) continue;
      V* d = reinterpret_cast<V*>(dst_base + r * dst_stride);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * 32;
        if (v < n) d[v] = val[u];
      }
    }
  }
}

template <class V>
__global__ void __launch_bounds__(kThreads) permute_kernel(PermuteArgs a) {
  __shared__ int32_t rows_s[kWarps][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Layout& L = a.L;
  if (static_cast<int64_t>(L.offsets[L.Le]) > a.capacity) return;  // overflow: write nothing
  const int64_t items = static_cast<int64_t>(L.T) + L.Le;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kWarps + warp; it < items; it += nw) {
    if (it < L.T) {
      const int64_t t = it;
      int32_t row = -1;
      if (lane < L.K) {
        const int32_t e = L.routed[t * L.K + lane];
        if (e >= 0) row = L.offsets[e] + L.pair_pos[t * L.K + lane];
        L.recv_row[t * L.K + lane] = row;
        if (row >= 0 && a.recv_weights) a.recv_weights[row] = a.topk_weights ? a.topk_weights[t * L.K + lane] : 0.0f;
      }
      rows_s[warp][lane] = row;
      __syncwarp();
      copy_bytes_to_rows<V>(a.x + t * a.row_bytes, a.row_bytes, a.recv, a.row_bytes, rows_s[warp], L.K, lane);
      if (a.scale_bytes)
        copy_bytes_to_rows<uint8_t>(a.x_scales + t * a.scale_bytes, a.scale_bytes, a.recv_scales, a.scale_bytes,
                                    rows_s[warp], L.K, lane);
      __syncwarp();
    } else {
      const int e = static_cast<int>(it - L.T);
      for (int64_t r = L.offsets[e] + L.expert_rows[e]; r < L.offsets[e + 1]; ++r) {
        zero_row<V>(a.recv + r * a.row_bytes, a.row_bytes, lane);
        if (a.scale_bytes) zero_row<uint8_t>(a.recv_scales + r * a.scale_bytes, a.scale_bytes, lane);
        if (lane == 0 && a.recv_weights) a.recv_weights[r] = 0.0f;
      }
    }
  }
}

// ---- combine and dispatch_backward: reductions over a token's rows --------------------------

struct ReduceArgs {
  Layout L;
  int64_t H;
  const void* rows_in;        // [rows, H] y or d_recv_x
  const float* row_weights;   // or null: plain sum
  void* out;                  // [T, H]
  const float* d_row_in;      // dispatch_backward: d_recv_weights, or null
  float* d_topk_weights;      // dispatch_backward: [T, K], or null
};

template <class T, int N>
__global__ void __launch_bounds__(kThreads) reduce_rows_kernel(ReduceArgs a) {
  __shared__ int32_t rows_s[kWarps][32];
  __shared__ float w_s[kWarps][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Layout& L = a.L;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t nvec = a.H / N;
  using P = Pack<T, N>;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < L.T; t += nw) {
    int32_t row = -1;
    float w = 1.0f;
    if (lane < L.K) {
      row = L.recv_row[t * L.K + lane];
      if (row >= 0 && a.row_weights) w = a.row_weights[row];
      if (a.d_topk_weights) a.d_topk_weights[t * L.K + lane] = row >= 0 && a.d_row_in ? a.d_row_in[row] : 0.0f;
    }
    rows_s[warp][lane] = row;
    w_s[warp][lane] = w;
    __syncwarp();
    const P* in = static_cast<const P*>(a.rows_in);
    P* out = static_cast<P*>(a.out) + t * nvec;
    for (int64_t v = lane; v < nvec; v += 32) {
      float acc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = 0.0f;
      for (int k = 0; k < L.K; ++k) {
        const int32_t r = rows_s[warp][k];
        if (r < 0) continue;
        const P p = in[r * nvec + v];
        if (a.row_weights) {
          const float wk = w_s[warp][k];
#pragma unroll
          for (int i = 0; i < N; ++i) acc[i] = fmaf(wk, to_float(p.v[i]), acc[i]);
        } else {
#pragma unroll
          for (int i = 0; i < N; ++i) acc[i] += to_float(p.v[i]);
        }
      }
      P o;
#pragma unroll
      for (int i = 0; i < N; ++i) o.v[i] = from_float<T>(acc[i]);
      out[v] = o;
    }
    __syncwarp();
  }
}

// ---- combine_backward: spread d_out to the rows, dot products for the row weights ------------

struct SpreadArgs {
  Layout L;
  int64_t H;
  const void* d_out;          // [T, H]
  const void* y;              // [rows, H] (read only for d_row_weights)
  const float* row_weights;   // or null: plain copy
  void* d_y;                  // [rows, H]
  float* d_row_weights;       // or null
};

template <class T, int N, int KMAX>
__global__ void __launch_bounds__(kThreads) spread_rows_kernel(SpreadArgs a) {
  __shared__ int32_t rows_s[kWarps][32];
  __shared__ float w_s[kWarps][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Layout& L = a.L;
  const int64_t items = static_cast<int64_t>(L.T) + L.Le;
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t nvec = a.H / N;
  using P = Pack<T, N>;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kWarps + warp; it < items; it += nw) {
    if (it >= L.T) {
      const int e = static_cast<int>(it - L.T);
      for (int64_t r = L.offsets[e] + L.expert_rows[e]; r < L.offsets[e + 1]; ++r) {
        P* d = static_cast<P*>(a.d_y) + r * nvec;
        for (int64_t v = lane; v < nvec; v += 32) d[v] = P{};
        if (lane == 0 && a.d_row_weights) a.d_row_weights[r] = 0.0f;
      }
      continue;
    }
    const int64_t t = it;
    int32_t row = -1;
    float w = 1.0f;
    if (lane < L.K) {
      row = L.recv_row[t * L.K + lane];
      if (row >= 0 && a.row_weights) w = a.row_weights[row];
    }
    rows_s[warp][lane] = row;
    w_s[warp][lane] = w;
    __syncwarp();
    float dot[KMAX];
#pragma unroll
    for (int k = 0; k < KMAX; ++k) dot[k] = 0.0f;
    const P* g_in = static_cast<const P*>(a.d_out) + t * nvec;
    for (int64_t v = lane; v < nvec; v += 32) {
      const P g = g_in[v];
      float gf[N];
#pragma unroll
      for (int i = 0; i < N; ++i) gf[i] = to_float(g.v[i]);
#pragma unroll
      for (int k = 0; k < KMAX; ++k) {
        if (k >= L.K) break;
        const int32_t r = rows_s[warp][k];
        if (r < 0) continue;
        P o;
        if (a.row_weights) {
          const float wk = w_s[warp][k];
#pragma unroll
          for (int i = 0; i < N; ++i) o.v[i] = from_float<T>(wk * gf[i]);
        } else {
          o = g;
        }
        static_cast<P*>(a.d_y)[r * nvec + v] = o;
        if (a.d_row_weights) {
          const P yp = static_cast<const P*>(a.y)[r * nvec + v];
#pragma unroll
          for (int i = 0; i < N; ++i) dot[k] = fmaf(gf[i], to_float(yp.v[i]), dot[k]);
        }
      }
    }
    if (a.d_row_weights) {
#pragma unroll
      for (int k = 0; k < KMAX; ++k) {
        if (k >= L.K) break;
        float d = dot[k];
#pragma unroll
        for (int m = 16; m > 0; m >>= 1) d += __shfl_xor_sync(0xffffffffu, d, m);
        if (lane == 0 && rows_s[warp][k] >= 0) a.d_row_weights[rows_s[warp][k]] = d;
      }
    }
    __syncwarp();
  }
}

}  // namespace epx::cuda::permute
