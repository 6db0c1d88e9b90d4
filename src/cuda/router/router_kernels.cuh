// Router kernels: the CUDA twin of src/ref/router.cpp (semantics in include/epx/router.h).
//
// Layout. One warp per token. Lane l owns the V = 2^ceil(log2(E/32)) CONTIGUOUS experts
// [l*V, l*V + V) in registers (V in {1, 2, 4, 8, 16}); slots at or past E read as NaN, which the
// contract already treats as "ineligible", so padding needs no special case. Rows are loaded with
// 16-byte vector loads where alignment allows.
//
// Selection keys. The selection score s_e (+ bias) becomes a 32-bit key whose unsigned order is the
// float order (order_key); NaN ranks as -inf and -0 as +0, exactly the comparisons the reference's
// stable sort makes, and 0 is reserved for "not a candidate" (order_key(-inf) = 0x007FFFFF > 0).
// Top-k, fast path: the low IB = log2(32*V) bits of each key are replaced by (IM - e), so that keys
// become unique and a larger composite means (higher key, then lower index). Each lane keeps its
// three best composites, K+1 rounds of one redux.max pick the global order, and the result is
// exact unless (a) two consecutive picks agree on the truncated high bits (then the dropped bits
// could have reordered them) or (b) a lane ran out of cached candidates early. In either case, which
// the warp detects, the token is redone by the exact path (K rounds of max key, lowest lane, lowest
// slot), so the fast path only ever changes speed, never results. Proof sketch of (a): if the high
// parts of picks 1..K+1 strictly decrease, anything not picked has a high part <= that of pick K+1,
// hence an exact key below pick K's.
// Groups (G > 1): a group's score is the sum of its two best EXACT keys (as floats) over eligible
// experts. With G <= 16 a group spans more than V experts (or V = 1), so a lane touches at most two
// groups: it keeps the top-2 of each part, and lane g merges the parts of the lanes covering group g
// in lane order. Each group's place in the reference's stable sort (higher scores first, ties to
// the lower group) is counted directly; the first group_topk places keep their candidates.
//
// Weights are recomputed by the slot lanes from a reload of the selected logit with the same
// expressions (explicit __f*_rn intrinsics, so no contraction can make the two sites differ).
//
// Statistics in the same pass, deterministically: each warp sums p_aux[t, e] of its tokens in
// registers in token order; a block combines its warps in warp order into one row per chunk of
// tokens (a chunk never straddles two sequences). A sequence of more than one chunk is reduced by a
// two-level tree of "last arriver sums its children in index order" (fan-in 32, tickets reset by
// the arriver that completes them); lse^2 and the valid-token count are summed per block and then
// by the last block in a fixed order. Every order is fixed by (T, seq_len) alone, so prob_sum and
// scalars are bit-identical run to run. No floating-point atomics anywhere except in count_routed,
// whose addends are integers (exact, hence order-independent, below 2^24).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/dtype_cuda.cuh"

namespace epx::cuda::router_kernels {

// Every router kernel's first statement: it is launched behind the previous grid (launch_router_kernel
// below), so nothing is read before that grid completes. With trigger_now the next grid may be
// scheduled as soon as every block of this one has started; the forward kernels may instead trigger
// before their statistics tail (FwdParams::trigger, EPX_ROUTER_TRIGGER), where the next grid's waiting
// blocks no longer sit beside a long token loop.
__device__ __forceinline__ void begin_after_previous_grid(bool trigger_now = true) {
  wait_for_previous_grid();
  if (trigger_now) allow_next_grid();
}


constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxExperts = 512;
constexpr int kMaxTopk = 16;
constexpr int kMaxGroups = 16;
// Stats reduction leaves: at most kMaxChunks blocks; a sequence spanning several chunks has at most
// kMaxChunks of them and all such chunks together number fewer than kRows0 (see router.cu).
constexpr int kMaxChunks = 512;
constexpr int kFanIn = 32;
constexpr int kRows0 = 2 * kMaxChunks;
constexpr int kRows1 = kMaxChunks;

enum ScoreKind : int { kScoreSoftmax = 0, kScoreSoftmaxAfterTopk = 1, kScoreSigmoid = 2 };

/// Bits of the per-(device, stream) status word (see router.h: router_status).
enum StatusBits : unsigned { kStatusBadId = 1u, kStatusRepeatedId = 2u };

// ---- parameters ---------------------------------------------------------------------------------

struct FwdParams {
  const void* logits;
  const float* bias;  // nullptr: no bias
  void* topk_idx;
  float* topk_w;
  float* prob_sum;  // nullptr: not wanted
  float* scalars;   // nullptr: not wanted
  int64_t T;
  int E, K, G, group_topk, per;
  int idx64, normalize, vec_ok;
  float scale;
  // Chunking: sequence s = c / bps holds chunks j = c % bps of C tokens (the last one shorter).
  int64_t L, C, bps, nchunks;
  // Scratch (router.cu): level-0 rows, level-1 rows, their tickets, per-block scalar leaves.
  float* rows0;
  float* rows1;
  unsigned* cnt1;
  unsigned* cnt2;
  float* leaf_lse;
  unsigned long long* leaf_cnt;
  unsigned* scal_ticket;
  // route_forward_fast_kernel only: fixed-point prob_sum accumulators, rows (s * rep + r) of
  // kMaxExperts (zero between launches), rep replicas per sequence (>= 1).
  unsigned long long* acc;
  int rep;
  int trigger;  // a RouterTrigger
};

// Where a forward kernel lets the stream's next grid be scheduled (EPX_ROUTER_TRIGGER): as its blocks
// start, before a chunk's statistics are committed, or only as its blocks exit.
enum RouterTrigger : int { kTriggerAtStart = 0, kTriggerBeforeStats = 1, kTriggerAtExit = 2 };

__device__ __forceinline__ void begin_forward_after_previous_grid(const FwdParams& p) {
  begin_after_previous_grid(p.trigger == kTriggerAtStart);
}
__device__ __forceinline__ void allow_next_grid_before_stats(const FwdParams& p) {
  if (p.trigger == kTriggerBeforeStats) allow_next_grid();
}

struct BwdParams {
  const void* logits;
  const void* topk_idx;
  const float* d_w;      // nullptr: no gradient through the weights
  const float* counts;   // [S, E], read when aux_mode != 0
  const float* scalars;  // nullptr: tokens = 0
  void* d_logits;
  unsigned* status;
  int64_t T, L;
  int E, K, sf, idx64, normalize, vec_ok;
  float scale;
  int aux_mode;         // 0: no aux term, 1: global (aux_base / tokens^2), 2: sequence (aux_seq)
  float aux_base;       // d_aux * coeff * E / K
  float aux_seq;        // aux_base / L^2 / S
  float z_base;         // d_z * z_coeff (0: no z term), divided by tokens on the device
};

// ---- small helpers ------------------------------------------------------------------------------

template <class LT>
struct ElemBits;
template <>
struct ElemBits<float> {
  using U = unsigned int;
  static constexpr uint32_t kNaN = 0x7fc00000u;
};
template <>
struct ElemBits<__nv_bfloat16> {
  using U = unsigned short;
  static constexpr uint32_t kNaN = 0x7fc0u;
};

template <int V, class LT>
struct RowRaw {
  static constexpr int kBytes = V * static_cast<int>(sizeof(LT));
  static constexpr int kWords = (kBytes + 3) / 4;
  uint32_t w[kWords];
};

// Lane's V elements of one row as raw words; elements at or past E read as NaN (ineligible).
template <int V, class LT>
__device__ __forceinline__ void load_row(RowRaw<V, LT>& r, const LT* row, int e0, int E, bool vec_ok) {
  using R = RowRaw<V, LT>;
  if (vec_ok && e0 + V <= E) {
    const char* p = reinterpret_cast<const char*>(row + e0);
    if constexpr (R::kBytes >= 16) {
#pragma unroll
      for (int i = 0; i < R::kBytes / 16; ++i) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
        r.w[4 * i] = v.x;
        r.w[4 * i + 1] = v.y;
        r.w[4 * i + 2] = v.z;
        r.w[4 * i + 3] = v.w;
      }
    } else if constexpr (R::kBytes == 8) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      r.w[0] = v.x;
      r.w[1] = v.y;
    } else if constexpr (R::kBytes == 4) {
      r.w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    } else {
      r.w[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
    }
  } else {
#pragma unroll
    for (int i = 0; i < R::kWords; ++i) r.w[i] = 0u;
    const auto* src = reinterpret_cast<const typename ElemBits<LT>::U*>(row);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      uint32_t bits = ElemBits<LT>::kNaN;
      if (e0 + j < E) bits = static_cast<uint32_t>(__ldg(src + e0 + j));
      if constexpr (sizeof(LT) == 4)
        r.w[j] = bits;
      else
        r.w[j >> 1] |= bits << (16 * (j & 1));
    }
  }
}

template <int V, class LT>
__device__ __forceinline__ void unpack_row(const RowRaw<V, LT>& r, float (&x)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if constexpr (sizeof(LT) == 4)
      x[j] = __uint_as_float(r.w[j]);
    else
      x[j] = __uint_as_float((j & 1) ? (r.w[j >> 1] & 0xffff0000u) : (r.w[j >> 1] << 16));
  }
}

__device__ __forceinline__ float load_elem(const float* row, int e) { return __ldg(row + e); }
__device__ __forceinline__ float load_elem(const __nv_bfloat16* row, int e) {
  return __uint_as_float(static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned short*>(row) + e)) << 16);
}

__device__ __forceinline__ uint32_t store_bits(float v, float*) { return __float_as_uint(v); }
__device__ __forceinline__ uint32_t store_bits(float v, __nv_bfloat16*) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
}

// Lane's V results into one row (elements at or past E are not written).
template <int V, class LT>
__device__ __forceinline__ void store_row(LT* row, int e0, int E, bool vec_ok, const float (&d)[V]) {
  using R = RowRaw<V, LT>;
  if (vec_ok && e0 + V <= E) {
    R r;
#pragma unroll
    for (int i = 0; i < R::kWords; ++i) r.w[i] = 0u;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const uint32_t b = store_bits(d[j], static_cast<LT*>(nullptr));
      if constexpr (sizeof(LT) == 4)
        r.w[j] = b;
      else
        r.w[j >> 1] |= b << (16 * (j & 1));
    }
    char* p = reinterpret_cast<char*>(row + e0);
    if constexpr (R::kBytes >= 16) {
#pragma unroll
      for (int i = 0; i < R::kBytes / 16; ++i)
        reinterpret_cast<uint4*>(p)[i] = make_uint4(r.w[4 * i], r.w[4 * i + 1], r.w[4 * i + 2], r.w[4 * i + 3]);
    } else if constexpr (R::kBytes == 8) {
      *reinterpret_cast<uint2*>(p) = make_uint2(r.w[0], r.w[1]);
    } else if constexpr (R::kBytes == 4) {
      *reinterpret_cast<unsigned int*>(p) = r.w[0];
    } else {
      *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(r.w[0]);
    }
  } else {
    auto* dst = reinterpret_cast<typename ElemBits<LT>::U*>(row);
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (e0 + j < E) dst[e0 + j] = static_cast<typename ElemBits<LT>::U>(store_bits(d[j], static_cast<LT*>(nullptr)));
  }
}

// Butterflies: every lane ends with the same value (each step adds a commutative pair), so the
// result is one fixed function of the inputs.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
// Over lanes 0..15 (the K <= 16 slots) and, separately, 16..31.
__device__ __forceinline__ float half_max(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
__device__ __forceinline__ float half_sum(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// The reference's sigmoid 1 / (1 + exp(-x)); __fadd_rn keeps the sum from fusing into expf's last
// multiply, so every call site gets the same bits.
__device__ __forceinline__ float sigmoid_score(float x) { return __frcp_rn(__fadd_rn(1.0f, expf(-x))); }

// The same from u = exp(x - max) and exp(-max): 1 / (1 + exp(-max) / u) = u / (u + exp(-max)).
__device__ __forceinline__ float sigmoid_shared(float u, float e_neg_max) {
  return __fmul_rn(u, __frcp_rn(__fadd_rn(u, e_neg_max)));
}

// Softmax probability of one eligible logit given the row's max, 1 / sum and saturation state.
__device__ __forceinline__ float softmax_prob(float x, float mx, float inv, bool sat, float pv) {
  return sat ? (x == mx ? pv : 0.0f) : __fmul_rn(expf(__fsub_rn(x, mx)), inv);
}

// Multiset top-2 / top-3 of unsigned keys (0 = empty).
__device__ __forceinline__ void top2(uint32_t& a1, uint32_t& a2, uint32_t k) {
  const uint32_t lo = min(a1, k);
  a1 = max(a1, k);
  a2 = max(a2, lo);
}
__device__ __forceinline__ void merge2(uint32_t& a1, uint32_t& a2, uint32_t b1, uint32_t b2) {
  const uint32_t n2 = max(min(a1, b1), max(a2, b2));
  a1 = max(a1, b1);
  a2 = n2;
}
__device__ __forceinline__ void top3(uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k) {
  const uint32_t l1 = min(c1, k);
  c1 = max(c1, k);
  const uint32_t l2 = min(c2, l1);
  c2 = max(c2, l1);
  c3 = max(c3, l2);
}

// order_key in two instructions (an arithmetic shift and one three-input logic op): the same keys.
__device__ __forceinline__ uint32_t order_key2(float f) {
  const uint32_t b = __float_as_uint(f);
  const uint32_t m = static_cast<uint32_t>(static_cast<int32_t>(b) >> 31);
  return b ^ (m | 0x80000000u);
}

// The group score key of a top-2 pair (the reference: the sum of the two best selection scores of
// the group's eligible experts, -inf when it has none).
__device__ __forceinline__ uint32_t group_key(uint32_t g1, uint32_t g2) {
  float gs;
  if (g1 == 0u)
    gs = -CUDART_INF_F;
  else if (g2 == 0u)
    gs = key_to_float(g1);
  else {
    gs = __fadd_rn(key_to_float(g1), key_to_float(g2));
    if (isnan(gs)) gs = -CUDART_INF_F;
  }
  return order_key2(gs);
}

// The legacy layout's group map, once per kernel (groups G > 1): lane l's elements j < jb belong to
// group gf, the others to gf + 1 (warp 0 writes them to s_lane_gf / s_lane_jb; the block synchronises
// before they are read); a lane without experts gets a group whose kept bit is always 0. any_straddle:
// some lane holds two groups; ncover: the most lanes one group spans. Warp-collective.
template <int V>
__device__ __forceinline__ void legacy_group_setup(const FwdParams& p, int lane, int warp, int* s_lane_gf,
                                                   int* s_lane_jb, bool& any_straddle, int& ncover) {
  const int E = p.E, G = p.G, per = p.per, e0 = lane * V;
  int gf = kMaxGroups + 1, jb = V;
  if (e0 < E) {
    gf = e0 / per;
    jb = (gf + 1) * per - e0;
  }
  if (warp == 0) {
    s_lane_gf[lane] = gf;
    s_lane_jb[lane] = jb;
  }
  any_straddle = __any_sync(kFull, e0 < E && jb < V && e0 + jb < E);
  const int cover = lane < G ? ((lane + 1) * per - 1) / V - (lane * per) / V + 1 : 0;
  ncover = static_cast<int>(__reduce_max_sync(kFull, static_cast<unsigned>(cover)));
}

// Group-limited selection in the legacy layout (one token per warp, lane l holding experts
// [l V, l V + V)): lane l's elements j < jb belong to group gf, the others to gf + 1 (part b, only
// where some lane straddles two groups); lane g merges group g's top-2 keys from the lanes that
// hold its experts, in lane order, ranks the groups as the reference's stable sort does and the
// keys of experts outside the group_topk best groups are cleared. Warp-collective.
template <int V>
__device__ __forceinline__ void legacy_group_mask(uint32_t (&ek)[V], const FwdParams& p, int lane, int gf, int jb,
                                                  bool any_straddle, int ncover) {
  const int G = p.G, per = p.per;
  const int g_first = (lane * per) / V, g_last = lane < G ? ((lane + 1) * per - 1) / V : -1;
  // Top-2 exact keys of each part of this lane (part b only where some lane straddles).
  uint32_t a1 = 0, a2 = 0, b1 = 0, b2 = 0;
  if (!any_straddle) {
#pragma unroll
    for (int j = 0; j < V; ++j) top2(a1, a2, ek[j]);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const bool in_b = j >= jb;
      top2(a1, a2, in_b ? 0u : ek[j]);
      top2(b1, b2, in_b ? ek[j] : 0u);
    }
  }
  // Lane g merges group g's parts from lanes g_first..g_last, in lane order.
  uint32_t g1 = 0, g2 = 0;
  for (int i = 0; i < ncover; ++i) {
    const int src = min(g_first + i, 31);
    const uint32_t sa1 = __shfl_sync(kFull, a1, src), sa2 = __shfl_sync(kFull, a2, src);
    const int sgf = __shfl_sync(kFull, gf, src);
    uint32_t sb1 = 0, sb2 = 0;
    if (any_straddle) {
      sb1 = __shfl_sync(kFull, b1, src);
      sb2 = __shfl_sync(kFull, b2, src);
    }
    if (lane < G && g_first + i <= g_last) {
      // src holds experts of group `lane`: as its first part, or else as its second.
      if (sgf == lane)
        merge2(g1, g2, sa1, sa2);
      else
        merge2(g1, g2, sb1, sb2);
    }
  }
  const uint32_t gk = lane < G ? group_key(g1, g2) : 0u;  // > 0: the key of a non-NaN float
  // Group g's place in the reference's stable sort: the groups with a higher score, and
  // those with an equal one and a lower index. The first group_topk places are kept.
  int rank = 0;
#pragma unroll
  for (int gi = 0; gi < kMaxGroups; ++gi) {
    if (gi >= G) break;
    const uint32_t other = __shfl_sync(kFull, gk, gi);
    rank += (other > gk || (other == gk && gi < lane)) ? 1 : 0;
  }
  const uint32_t kept = __ballot_sync(kFull, lane < G && rank < p.group_topk);  // bit g = group g
  const bool ka = (kept >> gf) & 1u, kb = (kept >> (gf + 1)) & 1u;
#pragma unroll
  for (int j = 0; j < V; ++j) ek[j] = ((j < jb) ? ka : kb) ? ek[j] : 0u;
}

// Exact top-k over the keys (0 = not a candidate): K rounds of (max key, then lowest lane, then
// lowest slot), the reference's stable order. Returns slot `lane`'s expert (-1 when none is left).
template <int V>
__device__ __forceinline__ int exact_topk(const uint32_t (&ek)[V], int K, int lane) {
  uint32_t taken = 0;
  int id = -1;
  for (int r = 0; r < K; ++r) {
    uint32_t bk = 0;
    int bj = 0;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const uint32_t k = ((taken >> j) & 1u) ? 0u : ek[j];
      if (k > bk) {
        bk = k;
        bj = j;
      }
    }
    const uint32_t m = __reduce_max_sync(kFull, bk);
    if (m == 0u) break;
    const int w = __ffs(__ballot_sync(kFull, bk == m)) - 1;
    const int jw = __shfl_sync(kFull, bj, w);
    if (lane == w) taken |= 1u << jw;
    if (lane == r) id = w * V + jw;
  }
  return id;
}

__device__ __forceinline__ void store_slot(const FwdParams& p, int64_t o, int id, float w) {
  if (p.idx64)
    static_cast<int64_t*>(p.topk_idx)[o] = id;
  else
    static_cast<int32_t*>(p.topk_idx)[o] = id;
  p.topk_w[o] = w;
}

// ---- route_forward ------------------------------------------------------------------------------

// The selection bias staged in shared memory for experts [0, n) (n >= E pads with 0). NaN behaves
// as -inf: score + NaN ranks as -inf in the reference, and score + -inf is -inf or, for an infinite
// logit, NaN, which ranks the same. Without a bias, + 0 is what the reference adds.
__device__ __forceinline__ void stage_bias(float* s_bias, const FwdParams& p, int n) {
  for (int e = threadIdx.x; e < n; e += kThreads) {
    float b = 0.0f;
    if (p.bias != nullptr && e < p.E) {
      b = __ldg(p.bias + e);
      if (isnan(b)) b = -CUDART_INF_F;
    }
    s_bias[e] = b;
  }
}

// Chunk c of the statistics: sequence s, its chunk jc, tokens [begin, end).
struct ChunkSpan {
  int64_t s, jc, begin, end;
};
__device__ __forceinline__ ChunkSpan chunk_span(const FwdParams& p, int64_t c) {
  const int64_t s = c / p.bps, jc = c - s * p.bps;
  return {s, jc, s * p.L + jc * p.C, s * p.L + min((jc + 1) * p.C, p.L)};
}

// Sums rows [first, first + n) of `src` (stride kMaxExperts) column by column in row order.
__device__ __forceinline__ void sum_rows(const float* src, int64_t first, int n, int E, float* dst) {
  for (int e = threadIdx.x; e < E; e += kThreads) {
    const float* p = src + first * kMaxExperts + e;
    float v = 0.0f;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      float b[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) b[u] = __ldcg(p + static_cast<int64_t>(i + u) * kMaxExperts);
#pragma unroll
      for (int u = 0; u < 8; ++u) v += b[u];
    }
    for (; i < n; ++i) v += __ldcg(p + static_cast<int64_t>(i) * kMaxExperts);
    dst[e] = v;
  }
}

// Chunk j of sequence s wrote its row to rows0[c]; the last of each fan-in group sums the group, and
// the last group of the sequence writes prob_sum[s]. Block-uniform control flow.
__device__ __forceinline__ void prob_tree(const FwdParams& p, int64_t s, int64_t j, int* s_flag) {
  const int E = p.E;
  const int64_t ngroups = (p.bps + kFanIn - 1) / kFanIn;
  const int64_t gi = j / kFanIn, j0 = gi * kFanIn;
  const int64_t gid = s * ngroups + gi;
  const int nchild = static_cast<int>(min(static_cast<int64_t>(kFanIn), p.bps - j0));
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned ticket = atomicAdd(p.cnt1 + gid, 1u);
    const int last = ticket == static_cast<unsigned>(nchild - 1);
    if (last) p.cnt1[gid] = 0u;  // every child has arrived: ready for the next launch
    *s_flag = last;
  }
  __syncthreads();
  if (!*s_flag) return;
  __threadfence();
  float* dst1 = ngroups == 1 ? p.prob_sum + s * E : p.rows1 + gid * kMaxExperts;
  sum_rows(p.rows0, s * p.bps + j0, nchild, E, dst1);
  if (ngroups == 1) return;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned ticket = atomicAdd(p.cnt2 + s, 1u);
    const int last = ticket == static_cast<unsigned>(ngroups - 1);
    if (last) p.cnt2[s] = 0u;
    *s_flag = last;
  }
  __syncthreads();
  if (!*s_flag) return;
  __threadfence();
  sum_rows(p.rows1, s * ngroups, static_cast<int>(ngroups), E, p.prob_sum + s * E);
}

template <int V>
struct FwdBounds {
  static constexpr int kMinBlocks = V >= 16 ? 2 : 3;
};

template <int V, class LT, int SF>
__global__ void __launch_bounds__(kThreads, FwdBounds<V>::kMinBlocks) route_forward_kernel(const __grid_constant__ FwdParams p) {
  begin_forward_after_previous_grid(p);
  static_assert(V == 1 || V == 2 || V == 4 || V == 8 || V == 16, "V must be a power of two <= 16");
  constexpr int IB = 5 + (V == 1 ? 0 : V == 2 ? 1 : V == 4 ? 2 : V == 8 ? 3 : 4);
  constexpr uint32_t IM = (1u << IB) - 1u;  // every expert index e < 32 * V fits in IB bits

  __shared__ __align__(16) float s_red[kWarps][32 * V];
  __shared__ __align__(16) float s_bias[32 * V];
  __shared__ float s_wlse[kWarps];
  __shared__ unsigned s_wcnt[kWarps];
  __shared__ unsigned long long s_n[kThreads];
  __shared__ int s_lane_gf[32], s_lane_jb[32];
  __shared__ float s_blk_lse;
  __shared__ unsigned long long s_blk_cnt;
  __shared__ int s_flag;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int E = p.E, K = p.K, G = p.G, per = p.per;
  const int e0 = lane * V;
  const bool want_prob = p.prob_sum != nullptr, want_scal = p.scalars != nullptr;
  const bool need_softmax =
      SF == kScoreSoftmax || want_scal || (SF == kScoreSoftmaxAfterTopk && want_prob);
  const LT* logits = static_cast<const LT*>(p.logits);

  // Bias for selection only, staged in shared memory (registers are the scarce resource).
  stage_bias(s_bias, p, 32 * V);
  __syncthreads();

  // Groups: lane l's elements j < jb[l] belong to group gf[l], the others to gf[l] + 1 (kept in
  // shared memory, read once per token, to spare registers). A lane without experts gets a group
  // whose kept bit is always 0. Lane g merges group g from lanes g_first..g_last.
  const bool grouped = G > 1;
  bool any_straddle = false;
  int ncover = 0;
  if (grouped) legacy_group_setup<V>(p, lane, warp, s_lane_gf, s_lane_jb, any_straddle, ncover);
  if (tid == 0) {
    s_blk_lse = 0.0f;
    s_blk_cnt = 0;
  }
  __syncthreads();

  for (int64_t c = blockIdx.x; c < p.nchunks; c += gridDim.x) {
    const ChunkSpan span = chunk_span(p, c);
    const int64_t s = span.s, jc = span.jc, t_begin = span.begin, t_end = span.end;

    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.0f;
    float w_lse = 0.0f;
    unsigned w_cnt = 0;

    int64_t t = t_begin + warp;
    RowRaw<V, LT> cur;
    if (t < t_end) load_row<V, LT>(cur, logits + t * E, e0, E, p.vec_ok);
    while (t < t_end) {  // warp-uniform
      const int64_t tn = t + kWarps;
      RowRaw<V, LT> nxt;
      if (tn < t_end) load_row<V, LT>(nxt, logits + tn * E, e0, E, p.vec_ok);  // in flight meanwhile

      float x[V];
      unpack_row<V, LT>(cur, x);
      uint32_t em = 0;
      float mx = -CUDART_INF_F;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        em |= (isnan(x[j]) ? 0u : 1u) << j;
        mx = fmaxf(mx, x[j]);  // fmaxf ignores NaN
      }
      const int64_t o = t * K + lane;  // this lane's output slot when lane < K
      if (!__any_sync(kFull, em != 0u)) {
        // No eligible expert: every slot masked, and the row is no token of the losses.
        if (lane < K) store_slot(p, o, -1, 0.0f);
      } else {
        mx = warp_max(mx);

        // Softmax over the eligible logits (limits for infinities), its logsumexp. In sigmoid mode
        // only the logsumexp is wanted and pr keeps the unnormalised exp(x - max) for the sigmoid.
        float pr[V];
        float inv = 0.0f, pv = 0.0f, lse = 0.0f;
        bool sat = false;
        if (need_softmax) {
          if (isinf(mx)) {  // warp-uniform
            unsigned cnt = 0;
#pragma unroll
            for (int j = 0; j < V; ++j) cnt += (((em >> j) & 1u) && x[j] == mx) ? 1u : 0u;
            const unsigned top = __reduce_add_sync(kFull, cnt);  // >= 1: mx is some eligible logit
            pv = 1.0f / static_cast<float>(top);
#pragma unroll
            for (int j = 0; j < V; ++j) pr[j] = (((em >> j) & 1u) && x[j] == mx) ? pv : 0.0f;
            lse = mx;
            sat = true;
          } else {
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < V; ++j) {
              const float ex = ((em >> j) & 1u) ? expf(__fsub_rn(x[j], mx)) : 0.0f;
              pr[j] = ex;
              sum += ex;
            }
            sum = warp_sum(sum);
            inv = 1.0f / sum;
            if constexpr (SF != kScoreSigmoid) {
#pragma unroll
              for (int j = 0; j < V; ++j) pr[j] = __fmul_rn(pr[j], inv);
            }
            lse = mx + logf(sum);
          }
        }

        // Sigmoid. When u = exp(x - max) is at hand, s = u / (u + exp(-max)) saves one exponential
        // per expert. Its error grows with x - max (that difference is rounded where -x is exact):
        // within 16 of the max it is <= ~10 ulp, so only such rows use it; others (a warp-uniform
        // choice) take 1 / (1 + exp(-x)) directly.
        float sg[V];
        float ssum = 0.0f, e_neg_max = 0.0f;
        bool sig_direct = true;
        if constexpr (SF == kScoreSigmoid) {
          if (need_softmax && !sat) {
            bool far = false;
#pragma unroll
            for (int j = 0; j < V; ++j) far = far || (((em >> j) & 1u) && __fsub_rn(x[j], mx) < -16.0f);
            sig_direct = __any_sync(kFull, far);
            if (!sig_direct) e_neg_max = expf(-mx);
          }
          if (sig_direct) {
#pragma unroll
            for (int j = 0; j < V; ++j) sg[j] = ((em >> j) & 1u) ? sigmoid_score(x[j]) : 0.0f;
          } else {
#pragma unroll
            for (int j = 0; j < V; ++j) sg[j] = ((em >> j) & 1u) ? sigmoid_shared(pr[j], e_neg_max) : 0.0f;
          }
#pragma unroll
          for (int j = 0; j < V; ++j) ssum += sg[j];
        }

        if (want_prob) {
          if constexpr (SF == kScoreSigmoid) {
            const float tot = warp_sum(ssum);
            const float is = tot > 0.0f ? 1.0f / tot : 0.0f;
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += sg[j] * is;
          } else {
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += pr[j];
          }
        }
        if (want_scal) {
          w_lse += lse * lse;
          ++w_cnt;
        }

        // Exact selection keys (0 = ineligible).
        uint32_t ek[V];
        float bias[V];
#pragma unroll
        for (int j = 0; j < V; ++j) bias[j] = s_bias[e0 + j];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          float sel;
          if constexpr (SF == kScoreSoftmax) {
            sel = __fadd_rn(pr[j], bias[j]);  // p in [0, 1], bias not NaN: never NaN, never -0
          } else if constexpr (SF == kScoreSigmoid) {
            sel = __fadd_rn(sg[j], bias[j]);
          } else {
            sel = __fadd_rn(__fadd_rn(x[j], bias[j]), 0.0f);  // -0 -> +0
            if (isnan(sel)) sel = -CUDART_INF_F;              // inf + -inf
          }
          ek[j] = ((em >> j) & 1u) ? order_key(sel) : 0u;
        }

        if (grouped) {
          legacy_group_mask<V>(ek, p, lane, s_lane_gf[lane], s_lane_jb[lane], any_straddle, ncover);
        }

        // Fast top-k on composite keys (see the file note).
        uint32_t c1 = 0, c2 = 0, c3 = 0;
        const uint32_t cbase = IM - static_cast<uint32_t>(e0);
#pragma unroll
        for (int j = 0; j < V; ++j) top3(c1, c2, c3, (ek[j] & ~IM) | (cbase - static_cast<uint32_t>(j)));
        // Composites <= IM come from non-candidates and lose to every real one.
        const bool more = c3 > IM;  // three real candidates cached: a fourth may exist
        uint32_t slot = 0;
#pragma unroll
        for (int r = 0; r <= kMaxTopk; ++r) {  // unrolled: lane == r compares with a constant
          if (r > K) break;
          const uint32_t m = __reduce_max_sync(kFull, c1);
          if (lane == r) slot = m;
          if (c1 == m && m > IM) {  // composites are unique: exactly one lane
            c1 = c2;
            c2 = c3;
            c3 = 0u;
          }
        }
        const uint32_t after = __shfl_down_sync(kFull, slot, 1);
        const bool collide = lane < K && after > IM && (slot >> IB) == (after >> IB);
        // A lane that popped all three cached candidates may have offered nothing where its fourth
        // belonged (conservatively also when that happened only in the last round).
        const bool exhausted = more && c1 == 0u;
        int id;
        if (!__any_sync(kFull, collide || exhausted))
          id = slot > IM ? static_cast<int>(IM - (slot & IM)) : -1;
        else
          id = exact_topk<V>(ek, K, lane);

        // Weights from the selected logits, recomputed by the slot lanes.
        const bool used = lane < K && id >= 0;
        const float xs = used ? load_elem(logits + t * E, id) : 0.0f;
        float q = 0.0f;
        if constexpr (SF == kScoreSoftmax) {
          if (used) q = softmax_prob(xs, mx, inv, sat, pv);
        } else if constexpr (SF == kScoreSigmoid) {
          if (used) q = sig_direct ? sigmoid_score(xs) : sigmoid_shared(expf(__fsub_rn(xs, mx)), e_neg_max);
        } else {
          // Softmax over the selected logits, with the same limits for infinities.
          // Lane 0's half holds the slots; its max decides for the whole warp (uniform branches).
          const float m2 = __shfl_sync(kFull, half_max(used ? xs : -CUDART_INF_F), 0);
          if (__any_sync(kFull, used)) {
            if (isinf(m2)) {
              const bool hit = used && xs == m2;
              const int top = __popc(__ballot_sync(kFull, hit) & 0xffffu);
              q = hit ? 1.0f / static_cast<float>(top) : 0.0f;
            } else {
              const float ex = used ? expf(__fsub_rn(xs, m2)) : 0.0f;
              const float s2 = half_sum(ex);
              q = lane < 16 ? ex / s2 : 0.0f;
            }
          }
        }
        const float Q = half_sum(q);
        const bool divide = p.normalize && Q > 0.0f;
        const float wgt = p.scale * (divide ? q / Q : q);
        if (lane < K) store_slot(p, o, used ? id : -1, used ? wgt : 0.0f);
      }

      cur = nxt;
      t = tn;
    }

    // Combine the warps of this chunk in warp order.
    if (want_prob) {
#pragma unroll
      for (int j = 0; j < V; ++j) s_red[warp][e0 + j] = acc[j];
    }
    if (want_scal && lane == 0) {
      s_wlse[warp] = w_lse;
      s_wcnt[warp] = w_cnt;
    }
    __syncthreads();
    if (want_scal && tid == 0) {
      // This block's chunks in order, each chunk's warps in order.
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        s_blk_lse += s_wlse[w];
        s_blk_cnt += s_wcnt[w];
      }
    }
    if (want_prob) {
      float* dst = p.bps == 1 ? p.prob_sum + s * E : p.rows0 + c * kMaxExperts;
      for (int e = tid; e < E; e += kThreads) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += s_red[w][e];
        dst[e] = v;
      }
      if (p.bps > 1) prob_tree(p, s, jc, &s_flag);
    }
    __syncthreads();  // s_red and s_flag are reused by the next chunk
  }

  if (want_scal) {
    if (tid == 0) {
      p.leaf_lse[blockIdx.x] = s_blk_lse;
      p.leaf_cnt[blockIdx.x] = s_blk_cnt;
      __threadfence();
      const unsigned ticket = atomicAdd(p.scal_ticket, 1u);
      const int last = ticket == gridDim.x - 1;
      if (last) *p.scal_ticket = 0u;
      s_flag = last;
    }
    __syncthreads();
    if (s_flag) {
      __threadfence();
      float v = 0.0f;
      unsigned long long n = 0;
      for (unsigned b = tid; b < gridDim.x; b += kThreads) {
        v += __ldcg(p.leaf_lse + b);
        n += __ldcg(p.leaf_cnt + b);
      }
      float* s_f = &s_red[0][0];  // >= kThreads floats
      s_f[tid] = v;
      s_n[tid] = n;
      __syncthreads();
      for (int off = kThreads / 2; off > 0; off >>= 1) {
        if (tid < off) {
          s_f[tid] += s_f[tid + off];
          s_n[tid] += s_n[tid + off];
        }
        __syncthreads();
      }
      if (tid == 0) {
        p.scalars[0] = s_f[0];
        p.scalars[1] = static_cast<float>(s_n[0]);
      }
    }
  }
}

// ---- route_backward -----------------------------------------------------------------------------

template <int V>
struct BwdBounds {
  static constexpr int kMinBlocks = V >= 16 ? 2 : 3;
};

template <int V, class LT>
__global__ void __launch_bounds__(kThreads, BwdBounds<V>::kMinBlocks) route_backward_kernel(const __grid_constant__ BwdParams p) {
  begin_after_previous_grid();
  __shared__ __align__(16) float s_g[kWarps][32 * V];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int E = p.E, K = p.K, sf = p.sf;
  const int e0 = lane * V;
  const LT* logits = static_cast<const LT*>(p.logits);
  LT* d_logits = static_cast<LT*>(p.d_logits);

  // The loss seeds folded with the stats, as the reference reads them (T = stats.scalars[1]).
  const float tokens = p.scalars != nullptr ? __ldg(p.scalars + 1) : 0.0f;
  float aux_scale = 0.0f;
  if (p.aux_mode == 1 && tokens > 0.0f) aux_scale = p.aux_base / (tokens * tokens);
  if (p.aux_mode == 2) aux_scale = p.aux_seq;
  const float z_scale = (p.z_base != 0.0f && tokens > 0.0f) ? p.z_base / tokens : 0.0f;
  const bool need_softmax =
      (sf == kScoreSoftmax && p.d_w != nullptr) || (aux_scale != 0.0f && sf != kScoreSigmoid) || z_scale != 0.0f;

  float nrow[V];  // aux_scale * counts[s, e] of the current sequence
  int64_t nrow_seq = -1;

  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + warp; t < p.T; t += stride) {
    RowRaw<V, LT> raw;
    load_row<V, LT>(raw, logits + t * E, e0, E, p.vec_ok);

    // Ids are checked on every row (the reference checks before anything else): an id outside
    // [-1, E) or a repeat within the row is masked and reported in the status word.
    int id = -1;
    if (lane < K) {
      const int64_t o = t * K + lane;
      int64_t v = p.idx64 ? static_cast<const int64_t*>(p.topk_idx)[o] : static_cast<const int32_t*>(p.topk_idx)[o];
      if (v < -1 || v >= E) {
        atomicOr(p.status, kStatusBadId);
        v = -1;
      }
      id = static_cast<int>(v);
    }
    bool dup = false;
    for (int r = 0; r + 1 < K; ++r) {
      const int other = __shfl_sync(kFull, id, r);
      dup = dup || (lane < K && lane > r && id >= 0 && other == id);
    }
    if (dup) {
      atomicOr(p.status, kStatusRepeatedId);
      id = -1;
    }

    float x[V];
    unpack_row<V, LT>(raw, x);
    uint32_t em = 0;
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      em |= (isnan(x[j]) ? 0u : 1u) << j;
      mx = fmaxf(mx, x[j]);
    }
    float d[V];
#pragma unroll
    for (int j = 0; j < V; ++j) d[j] = 0.0f;

    if (__any_sync(kFull, em != 0u)) {
      mx = warp_max(mx);
      float pr[V];
      float inv = 0.0f, pv = 0.0f, lse = 0.0f;
      bool sat = false;
      if (need_softmax) {
        if (isinf(mx)) {
          unsigned cnt = 0;
#pragma unroll
          for (int j = 0; j < V; ++j) cnt += (((em >> j) & 1u) && x[j] == mx) ? 1u : 0u;
          const unsigned top = __reduce_add_sync(kFull, cnt);
          pv = 1.0f / static_cast<float>(top);
#pragma unroll
          for (int j = 0; j < V; ++j) pr[j] = (((em >> j) & 1u) && x[j] == mx) ? pv : 0.0f;
          lse = mx;
          sat = true;
        } else {
          float sum = 0.0f;
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const float ex = ((em >> j) & 1u) ? expf(__fsub_rn(x[j], mx)) : 0.0f;
            pr[j] = ex;
            sum += ex;
          }
          sum = warp_sum(sum);
          inv = 1.0f / sum;
#pragma unroll
          for (int j = 0; j < V; ++j) pr[j] = __fmul_rn(pr[j], inv);
          lse = mx + logf(sum);
        }
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) pr[j] = 0.0f;
      }
      float sg[V];
      float ssum = 0.0f;
      if (sf == kScoreSigmoid) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          sg[j] = ((em >> j) & 1u) ? sigmoid_score(x[j]) : 0.0f;
          ssum += sg[j];
        }
        ssum = warp_sum(ssum);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) sg[j] = 0.0f;
      }

      // A slot naming an ineligible (NaN) expert is treated as masked.
      bool used = id >= 0;
      float xs = 0.0f;
      if (used) {
        xs = load_elem(logits + t * E, id);
        used = !isnan(xs);
      }

      // Through the weights.
      if (p.d_w != nullptr) {
        const float g = used ? p.d_w[t * K + lane] : 0.0f;
        float q = 0.0f;
        bool sel_sat = false;
        if (sf == kScoreSoftmax) {
          if (used) q = softmax_prob(xs, mx, inv, sat, pv);
        } else if (sf == kScoreSigmoid) {
          if (used) q = sigmoid_score(xs);
        } else {
          const float m2 = __shfl_sync(kFull, half_max(used ? xs : -CUDART_INF_F), 0);
          if (__any_sync(kFull, used)) {
            if (isinf(m2)) {
              const bool hit = used && xs == m2;
              const int top = __popc(__ballot_sync(kFull, hit) & 0xffffu);
              q = hit ? 1.0f / static_cast<float>(top) : 0.0f;
              sel_sat = true;
            } else {
              const float ex = used ? expf(__fsub_rn(xs, m2)) : 0.0f;
              const float s2 = half_sum(ex);
              q = lane < 16 ? ex / s2 : 0.0f;
            }
          }
        }
        const float Q = half_sum(q), gq = half_sum(g * q);
        const bool divide = p.normalize && Q > 0.0f;
        const float dq = used ? (divide ? p.scale * (g - gq / Q) / Q : p.scale * g) : 0.0f;

        // The Jacobian of the score is dense for softmax and sparse otherwise; either way the
        // per-slot values are scattered to the experts' owners through shared memory (ids are
        // distinct after the check above).
        bool scatter = false;
        float val = 0.0f, dot = 0.0f;
        if (sf == kScoreSoftmax) {
          if (!sat) {
            dot = half_sum(dq * q);  // q = p[e_k]
            val = dq;
            scatter = true;
          }
        } else if (sf == kScoreSigmoid) {
          val = (dq * q) * (1.0f - q);
          scatter = true;
        } else if (!sel_sat) {
          dot = half_sum(q * dq);
          val = q * (dq - dot);
          scatter = true;
        }
        dot = __shfl_sync(kFull, dot, 0);  // lanes >= 16 summed their own half
        if (scatter) {  // warp-uniform
#pragma unroll
          for (int j = 0; j < V; ++j) s_g[warp][e0 + j] = 0.0f;
          __syncwarp();
          if (used) s_g[warp][id] = val;
          __syncwarp();
          float gv[V];
#pragma unroll
          for (int j = 0; j < V; ++j) gv[j] = s_g[warp][e0 + j];
          __syncwarp();
          if (sf == kScoreSoftmax) {
#pragma unroll
            for (int j = 0; j < V; ++j) d[j] = pr[j] * (gv[j] - dot);
          } else {
#pragma unroll
            for (int j = 0; j < V; ++j) d[j] = gv[j];
          }
        }
      }

      // Aux loss: d/dl of sum_e c_e p_aux[e], c_e = aux_scale * n[s, e].
      if (aux_scale != 0.0f) {
        const int64_t sq = t / p.L;
        if (sq != nrow_seq) {
          nrow_seq = sq;
#pragma unroll
          for (int j = 0; j < V; ++j) nrow[j] = e0 + j < E ? aux_scale * __ldg(p.counts + sq * E + e0 + j) : 0.0f;
        }
        if (sf == kScoreSigmoid) {
          if (ssum > 0.0f) {
            float part = 0.0f;
#pragma unroll
            for (int j = 0; j < V; ++j) part += nrow[j] * (sg[j] / ssum);
            const float dot = warp_sum(part);
#pragma unroll
            for (int j = 0; j < V; ++j) d[j] += sg[j] * (1.0f - sg[j]) * (nrow[j] - dot) / ssum;
          }
        } else if (!sat) {
          float part = 0.0f;
#pragma unroll
          for (int j = 0; j < V; ++j) part += nrow[j] * pr[j];
          const float dot = warp_sum(part);
#pragma unroll
          for (int j = 0; j < V; ++j) d[j] += pr[j] * (nrow[j] - dot);
        }
      }

      // z loss: d (lse^2) / dl = 2 lse softmax(l).
      if (z_scale != 0.0f && !sat) {
        const float zl = z_scale * 2.0f * lse;
#pragma unroll
        for (int j = 0; j < V; ++j) d[j] += zl * pr[j];
      }
#pragma unroll
      for (int j = 0; j < V; ++j)
        if (!((em >> j) & 1u)) d[j] = 0.0f;
    }
    store_row<V, LT>(d_logits + t * E, e0, E, p.vec_ok, d);
  }
}

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

// Launches a router kernel of kThreads threads behind the stream's previous grid (dependent_launch.cuh:
// scheduled as that grid's blocks leave; the kernel waits for it before touching memory).
template <class Params>
void launch_router_kernel(void (*kernel)(Params), int grid, size_t smem, cudaStream_t s, const Params& p) {
  launch_after_previous("router kernel", kernel, dim3(grid), dim3(kThreads), smem, s, p);
}

}  // namespace epx::cuda::router_kernels
