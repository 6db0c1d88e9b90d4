// Device pieces every router kernel shares (router_legacy_kernels.cuh, router_backward_kernels.cuh,
// router_fast_kernels.cuh, router_wide_kernels.cuh, router_lean_kernels.cuh): the launch behind the
// previous grid, the limits and kernel parameters, row loads and stores, butterflies, selection keys, the
// legacy layout's group selection, a token's lanes and its exact top-k (the other kernels' exact
// fallback), and the statistics tree.
//
// Selection keys. The selection score s_e (+ bias) becomes a 32-bit key whose unsigned order is the
// float order (order_key); NaN ranks as -inf and -0 as +0, exactly the comparisons the reference's
// stable sort makes, and 0 is reserved for "not a candidate" (order_key(-inf) = 0x007FFFFF > 0).
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

#include "cuda/common/block_ticket.cuh"
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
enum StatusBits : unsigned { kStatusBadId = 1u, kStatusRepeatedId = 2u, kStatusStatsTimeout = 4u };

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
  // The fast, wide, lean and split kernels: prob_sum's counted fixed-point accumulators, rows (of kMaxExperts)
  // s * rep + r for replica r of sequence s, then row S * rep + s for sequence s, and each block's published
  // scalar leaf (all zero between launches); fixed_scale (a power of two, 2^32 unless a sequence is long) and
  // its inverse convert to and from the fixed point.
  unsigned long long* acc;
  unsigned long long* leaves;
  int rep;
  float fixed_scale, fixed_inv;
  unsigned* status;
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

// Softmax over the lane's eligible logits (bit j of em) given the token's max mx; warp-collective, with
// control flow uniform over the warp. Where mx is infinite, each eligible logit equal to it gets
// pv = 1 / their count and lse = mx (sat); otherwise pr = exp(x - mx), inv = 1 / their sum, pr is scaled
// by inv when `normalize`, and lse = mx + log(sum).
template <int V>
__device__ __forceinline__ void eligible_softmax(const float (&x)[V], uint32_t em, float mx, bool normalize,
                                                 float (&pr)[V], float& inv, float& pv, float& lse, bool& sat) {
  if (isinf(mx)) {
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
    if (normalize) {
#pragma unroll
      for (int j = 0; j < V; ++j) pr[j] = __fmul_rn(pr[j], inv);
    }
    lse = mx + logf(sum);
  }
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

// The lanes of one token: all 32 (TPW = 1) or one half-warp (TPW = 2; the half-warp masks are the
// ones cooperative_groups uses for its 16-thread tiles, including for redux).
template <int TPW>
struct TokenLanes {
  static constexpr int kLanes = 32 / TPW;
  unsigned mask;
  int base;  // first lane of this token's lanes
  int hl;    // lane within them
  __device__ __forceinline__ explicit TokenLanes(int lane) {
    if constexpr (TPW == 1) {
      mask = kFull;
      base = 0;
      hl = lane;
    } else {
      base = lane & 16;
      mask = 0xffffu << base;
      hl = lane & 15;
    }
  }
  __device__ __forceinline__ uint32_t max(uint32_t v) const { return __reduce_max_sync(mask, v); }
  __device__ __forceinline__ unsigned add(unsigned v) const { return __reduce_add_sync(mask, v); }
  __device__ __forceinline__ bool any(bool p) const { return __any_sync(mask, p); }
  __device__ __forceinline__ unsigned ballot(bool p) const { return (__ballot_sync(mask, p) & mask) >> base; }
};

// Exact top-k over the keys (0 = not a candidate) of one token's lanes: K rounds of (max key, then
// lowest lane, then lowest slot), the reference's stable order. Returns slot tl.hl's expert (-1 when
// none is left).
template <int V, int TPW>
__device__ __forceinline__ int exact_topk(const TokenLanes<TPW>& tl, const uint32_t (&ek)[V], int K) {
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
    const uint32_t m = tl.max(bk);
    if (m == 0u) break;
    const int w = __ffs(tl.ballot(bk == m)) - 1;
    const int jw = __shfl_sync(tl.mask, bj, tl.base + w);
    if (tl.hl == w) taken |= 1u << jw;
    if (tl.hl == r) id = w * V + jw;
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

// One bias value as stage_bias stages it (NaN as -inf, see below); the split kernel loads its bias
// before its tile and stages it after.
__device__ __forceinline__ float staged_bias(float b) { return isnan(b) ? -CUDART_INF_F : b; }
// The selection bias staged in shared memory for experts [0, n) (n >= E pads with 0). NaN behaves
// as -inf: score + NaN ranks as -inf in the reference, and score + -inf is -inf or, for an infinite
// logit, NaN, which ranks the same. Without a bias, + 0 is what the reference adds.
__device__ __forceinline__ void stage_bias(float* s_bias, const FwdParams& p, int n) {
  for (int e = threadIdx.x; e < n; e += kThreads) {
    float b = 0.0f;
    if (p.bias != nullptr && e < p.E) b = staged_bias(__ldg(p.bias + e));
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
  if (!arrive_last(p.cnt1 + gid, static_cast<unsigned>(nchild), *s_flag)) return;
  float* dst1 = ngroups == 1 ? p.prob_sum + s * E : p.rows1 + gid * kMaxExperts;
  sum_rows(p.rows0, s * p.bps + j0, nchild, E, dst1);
  if (ngroups == 1) return;
  if (!arrive_last(p.cnt2 + s, static_cast<unsigned>(ngroups), *s_flag)) return;
  sum_rows(p.rows1, s * ngroups, static_cast<int>(ngroups), E, p.prob_sum + s * E);
}

// Launches a router kernel of kThreads threads behind the stream's previous grid (dependent_launch.cuh:
// scheduled as that grid's blocks leave; the kernel waits for it before touching memory).
// A failed launch throws epx::Error naming `what` ("launch of <kernel>").
template <class Params>
void launch_router_kernel(const char* what, void (*kernel)(Params), int grid, size_t smem, cudaStream_t s,
                          const Params& p) {
  launch_after_previous(what, kernel, dim3(grid), dim3(kThreads), smem, s, p);
}

}  // namespace epx::cuda::router_kernels
