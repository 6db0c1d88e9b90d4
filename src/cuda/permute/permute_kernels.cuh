// Row movement between token order and the expert-major layout, one warp per token.
//
// Work items: the T tokens, then the padding rows of the E_local experts in chunks of kPadRows rows
// (an expert pads at most align - 1 rows, so align = 128 gives 16 chunks per expert); warps stride
// over them. A token's routing (expert, position, weight of each slot: lane k owns slot k) is loaded
// one token ahead, so publishing its K destination rows costs one cached load (the expert offset),
// not a round trip to memory. The dispatch copy (permute_kernel) streams the row in 16-byte
// vectors, kUnroll per lane, the next batch's loads issued before the current batch is stored to
// every destination; the bulk variants (permute_bulk.cuh) stage the row in shared memory instead.
// Reductions (combine, dispatch_backward) keep one fp32 accumulator per element and add the slots
// in ascending order, so every output element is computed by one thread in one fixed order:
// bit-identical run to run and equal to the CPU reference. The dot products of combine_backward
// reduce per lane in element order and then across the warp with a fixed butterfly: deterministic,
// but not the reference's sequential order (compared with a tolerance).
#pragma once

#include <cstdint>

#include "cuda/common/dtype_cuda.cuh"
#include "cuda/common/row_reduce.cuh"

namespace epx::cuda::permute {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;
/// Padding rows zeroed per work item.
constexpr int kPadRows = 8;

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
  int64_t row_bytes;          // bytes of one x row
  const char* x_scales;
  int64_t scale_bytes;        // bytes of one scale row (x_scales and recv_scales), 0 = none
  const float* topk_weights;  // [T, K] or null
  char* recv;
  char* recv_scales;
  float* recv_weights;        // or null
  int pad_chunks;             // padding work items per expert: ceil((align - 1) / kPadRows)
};

/// One top-k slot of a token as lane k < K holds it, loaded ahead of its use.
struct Slot {
  int32_t e = -1, pos = 0;
  float w = 0.0f;
};

__device__ __forceinline__ Slot load_slot(const PermuteArgs& a, int64_t t, int lane) {
  Slot s;
  if (lane < a.L.K) {
    const int64_t i = t * a.L.K + lane;
    s.e = a.L.routed[i];
    s.pos = a.L.pair_pos[i];
    if (a.recv_weights && a.topk_weights) s.w = a.topk_weights[i];
  }
  return s;
}

/// Destination row of lane k's slot of token t (-1: masked or dropped); records it in recv_row and
/// writes the row's weight. Lanes >= K return -1.
__device__ __forceinline__ int32_t publish_slot(const PermuteArgs& a, int64_t t, int lane, const Slot& s) {
  int32_t row = -1;
  if (lane < a.L.K) {
    if (s.e >= 0) row = a.L.offsets[s.e] + s.pos;
    a.L.recv_row[t * a.L.K + lane] = row;
    if (row >= 0 && a.recv_weights) a.recv_weights[row] = s.w;
  }
  return row;
}

/// Rows [r0, r1) of padding work item q (chunk q % pad_chunks of expert q / pad_chunks); empty when
/// the expert pads fewer rows.
__device__ __forceinline__ void pad_item_rows(const Layout& L, int pad_chunks, int64_t q, int64_t& r0, int64_t& r1) {
  const int e = static_cast<int>(q / pad_chunks), c = static_cast<int>(q % pad_chunks);
  const int64_t end = L.offsets[e + 1];
  r0 = static_cast<int64_t>(L.offsets[e]) + L.expert_rows[e] + static_cast<int64_t>(c) * kPadRows;
  r1 = r0 + kPadRows < end ? r0 + kPadRows : end;
}

template <class V>
__device__ __forceinline__ void zero_row(char* base, int64_t bytes, int lane) {
  V* p = reinterpret_cast<V*>(base);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t v = lane; v < n; v += 32) p[v] = V{};
}

/// `bytes` zero bytes at p with the widest of 16/8/4/1-byte stores that `align` allows (a power of
/// two dividing both p and bytes).
__device__ __forceinline__ void zero_bytes(char* p, int64_t bytes, int align, int lane) {
  if (align >= 16) zero_row<uint4>(p, bytes, lane);
  else if (align >= 8) zero_row<uint2>(p, bytes, lane);
  else if (align >= 4) zero_row<uint32_t>(p, bytes, lane);
  else zero_row<uint8_t>(p, bytes, lane);
}

template <class V>
__device__ __forceinline__ void load_batch(const V* s, int n, int v0, V (&out)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int v = v0 + u * 32;
    if (v < n) out[u] = s[v];
  }
}

/// Copies `bytes` from src to the rows rows[0..K) (negative: skipped) of dst_base (row stride
/// dst_stride), each vector loaded once and stored K times. Software-pipelined: the loads of the next
/// batch are in flight while the current batch is stored. (A row is far below 2^31 vectors.)
template <class V>
__device__ __forceinline__ void copy_bytes_to_rows(const char* src, int64_t bytes, char* dst_base, int64_t dst_stride,
                                                   const int32_t* rows, int K, int lane) {
  const V* s = reinterpret_cast<const V*>(src);
  const int n = static_cast<int>(bytes / static_cast<int64_t>(sizeof(V)));
  V cur[kUnroll], nxt[kUnroll];
  load_batch<V>(s, n, lane, cur);
  for (int v0 = lane; v0 < n; v0 += 32 * kUnroll) {
    load_batch<V>(s, n, v0 + 32 * kUnroll, nxt);
    for (int k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r < 0) continue;
      V* d = reinterpret_cast<V*>(dst_base + r * dst_stride) + v0;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * 32 < n) d[u * 32] = cur[u];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) cur[u] = nxt[u];
  }
}

/// The same for short rows (scale rows): one vector per lane at a time.
template <class V>
__device__ __forceinline__ void copy_short_to_rows(const char* src, int64_t bytes, char* dst_base, int64_t dst_stride,
                                                   const int32_t* rows, int K, int lane) {
  const V* s = reinterpret_cast<const V*>(src);
  const int n = static_cast<int>(bytes / static_cast<int64_t>(sizeof(V)));
  for (int v = lane; v < n; v += 32) {
    const V val = s[v];
    for (int k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r >= 0) reinterpret_cast<V*>(dst_base + r * dst_stride)[v] = val;
    }
  }
}

/// Zeroes the padding rows of work item q: payload (out_row_bytes, stores of payload_align),
/// scale row (scale_bytes, stores of scale_align) and weight.
__device__ __forceinline__ void zero_pad_item(const PermuteArgs& a, int64_t q, int64_t out_row_bytes,
                                              int payload_align, int scale_align, int lane) {
  int64_t r0, r1;
  pad_item_rows(a.L, a.pad_chunks, q, r0, r1);
  for (int64_t r = r0; r < r1; ++r) {
    zero_bytes(a.recv + r * out_row_bytes, out_row_bytes, payload_align, lane);
    if (a.scale_bytes) zero_bytes(a.recv_scales + r * a.scale_bytes, a.scale_bytes, scale_align, lane);
    if (lane == 0 && a.recv_weights) a.recv_weights[r] = 0.0f;
  }
}

/// Resident CTAs per SM the copy kernel is compiled for (caps registers at 64): 32 warps per SM.
constexpr int kPermuteMinBlocks = 4;

template <class V>
__global__ void __launch_bounds__(kThreads, kPermuteMinBlocks) permute_kernel(PermuteArgs a) {
  __shared__ int32_t rows_s[kWarps][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Layout& L = a.L;
  if (static_cast<int64_t>(L.offsets[L.Le]) > a.capacity) return;  // overflow: write nothing
  const int64_t nw = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t gw = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  Slot next;
  if (gw < L.T) next = load_slot(a, gw, lane);
  for (int64_t t = gw; t < L.T; t += nw) {
    const Slot cur = next;
    if (t + nw < L.T) next = load_slot(a, t + nw, lane);
    rows_s[warp][lane] = publish_slot(a, t, lane, cur);
    __syncwarp();
    copy_bytes_to_rows<V>(a.x + t * a.row_bytes, a.row_bytes, a.recv, a.row_bytes, rows_s[warp], L.K, lane);
    if (a.scale_bytes)
      copy_short_to_rows<uint8_t>(a.x_scales + t * a.scale_bytes, a.scale_bytes, a.recv_scales, a.scale_bytes,
                                  rows_s[warp], L.K, lane);
    __syncwarp();
  }
  // Padding items in reverse warp order: the warps that had one token fewer start them.
  const int64_t pad_items = static_cast<int64_t>(L.Le) * a.pad_chunks;
  for (int64_t q = nw - 1 - gw; q < pad_items; q += nw)
    zero_pad_item(a, q, a.row_bytes, static_cast<int>(sizeof(V)), 1, lane);
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
    // The token's rows, compacted in slot order; 2 rows x 2 vectors per lane in flight.
    const int n = compact_rows(row, w, L.K, lane, rows_s[warp], w_s[warp]);
    weighted_row_sum<2, 2>(static_cast<const P*>(a.rows_in), nvec, rows_s[warp], w_s[warp], n,
                           a.row_weights != nullptr, static_cast<P*>(a.out) + t * nvec, 0, nvec, lane);
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

template <class T, int N, int KMAX, int G>
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
    const int n = compact_rows(row, w, L.K, lane, rows_s[warp], w_s[warp]);
    float dot[KMAX];
#pragma unroll
    for (int k = 0; k < KMAX; ++k) dot[k] = 0.0f;
    spread_row<KMAX, G>(static_cast<const P*>(a.d_out) + t * nvec, nvec, rows_s[warp], w_s[warp], n,
                        a.row_weights != nullptr, static_cast<P*>(a.d_y),
                        a.d_row_weights ? static_cast<const P*>(a.y) : nullptr, dot, lane);
    if (a.d_row_weights) store_row_dots<KMAX>(dot, n, rows_s[warp], a.d_row_weights, lane);
    __syncwarp();
  }
}

}  // namespace epx::cuda::permute
