// route_forward, the wide kernel (the default where the shape allows it; EPX_ROUTER_KERNEL=wide).
// The fast kernels (router_fast_kernels.cuh) reproduce the legacy kernel's arithmetic bit for bit
// and pay ~690 warp instructions per token at E = 256 for it (measured: precise expf/logf, one token
// per warp so every warp-wide step serves one token). This kernel keeps the contract -- the same
// selection rules, ties, NaN/inf semantics and statistics, deterministic run to run -- but not the
// legacy bits, and spends its instructions where the work is:
//  - two tokens per warp, a half-warp (16 lanes) per token, E / 16 experts per lane in quads
//    e = 64 j + 4 l + r (lane l, quad j, r < 4), so each quad is one 16-byte load (8 bytes for bf16)
//    and the 16 lanes of a token read whole 256-byte lines;
//  - exponentials as ex2.approx of one FMA (x log2 e - max log2 e: the product is rounded once, so
//    the result is within ~2e-6 relative of exp(x - max) for x - max > -20), the sigmoid as
//    rcp.approx(1 + ex2.approx(-x log2 e)) (a sigmoid below 2^-126, logits under about -87, flushes
//    to zero), logsumexp's log as lg2.approx: the reference's scores within a few 1e-6 relative,
//    which is what the tests' well-separated rows allow for;
//  - top-k: each lane keeps its four best composite keys (route_forward_kernel's file note: the
//    key's high bits, then IM - e), K + 1 picks are K + 1 unrolled half-warp maxima; if a lane gave
//    away all four while it holds more candidates, the warp redoes the picks with three-entry caches
//    that refill from the keys below their last pick, so the picks are always the exact top K + 1
//    composites. Only consecutive picks that agree on
//    the truncated high bits (then the dropped bits could reorder them) send the warp through the
//    exact path (K rounds of max key, lowest expert), so results never depend on the fast path;
//  - groups (E / G a multiple of 32, G <= 8): each lane's per-quad top-2, merged over the 8 or 16
//    lanes holding a group with an xor butterfly, every lane then ranks all G groups itself;
//  - weights recomputed by the slot lanes from a reload of the selected logit with the same
//    functions as the scores, so a weight is exactly the score that selected it;
//  - statistics in registers per token stream, then commit_chunk_stats (router_fast_kernels.cuh):
//    fixed-point integer atomics, so prob_sum is bit-identical run to run in any block order.
// Launch: 8 warps per block, 2 blocks per SM (<= 128 registers), one chunk of tokens per block;
// the next row pair is loaded while the current one is processed.
#pragma once

#include "cuda/router/router_approx_math.cuh"
#include "cuda/router/router_fast_kernels.cuh"

namespace epx::cuda::router_kernels {

constexpr int kWideLanes = 16;     // lanes per token
constexpr int kWideStreams = 2 * kWarps;  // token streams of a block (a half-warp each)
constexpr int kWideMinBlocks = 2;

// exp(x - m) given ml = m * log2(e); NaN in, NaN out; -inf gives 0.
__device__ __forceinline__ float exp_shifted(float x, float ml) { return ex2_approx(fmaf(x, kLog2e, -ml)); }
// 1 / (1 + exp(-x)): NaN in, NaN out; +inf gives 1, -inf gives 0.
__device__ __forceinline__ float sigmoid_fast(float x) { return rcp_approx(1.0f + ex2_approx(-x * kLog2e)); }

// The token's exp(x - max) for one element: the saturated case (the max is infinite) gives 1 for
// the elements equal to it and 0 for the others (NaN stays NaN), as the reference's limit does.
__device__ __forceinline__ float shifted_exp(float x, float mx, float ml, bool sat) {
  if (sat) return x == mx ? 1.0f : (isnan(x) ? x : 0.0f);
  return exp_shifted(x, ml);
}

// Per-half-warp max / min of unsigned values, both halves at once: two full-warp redux with the
// other half neutral. (A redux.sync on a half-warp mask compiles to a serialised collective loop.)
__device__ __forceinline__ uint32_t half_max_u32(uint32_t v, int half) {
  const uint32_t m0 = __reduce_max_sync(kFull, half ? 0u : v);
  const uint32_t m1 = __reduce_max_sync(kFull, half ? v : 0u);
  return half ? m1 : m0;
}
__device__ __forceinline__ uint32_t half_min_u32(uint32_t v, int half) {
  const uint32_t m0 = __reduce_min_sync(kFull, half ? 0xffffffffu : v);
  const uint32_t m1 = __reduce_min_sync(kFull, half ? v : 0xffffffffu);
  return half ? m1 : m0;
}

template <int NV, class LT>
struct WideRow {
  static constexpr int kWords = NV * static_cast<int>(sizeof(LT)) / 4;
  uint32_t w[kWords];
};

template <int NV, class LT>
__device__ __forceinline__ void wide_load(WideRow<NV, LT>& r, const LT* row, int hl) {
#pragma unroll
  for (int j = 0; j < NV / 4; ++j) {
    const LT* q = row + 64 * j + 4 * hl;
    if constexpr (sizeof(LT) == 4) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(q));
      r.w[4 * j] = v.x;
      r.w[4 * j + 1] = v.y;
      r.w[4 * j + 2] = v.z;
      r.w[4 * j + 3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(q));
      r.w[2 * j] = v.x;
      r.w[2 * j + 1] = v.y;
    }
  }
}

template <int NV, class LT>
__device__ __forceinline__ void wide_unpack(const WideRow<NV, LT>& r, float (&x)[NV]) {
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    if constexpr (sizeof(LT) == 4)
      x[i] = __uint_as_float(r.w[i]);
    else
      x[i] = __uint_as_float((i & 1) ? (r.w[i >> 1] & 0xffff0000u) : (r.w[i >> 1] << 16));
  }
}

// Expert of lane hl's element i.
__device__ __forceinline__ int wide_expert(int hl, int i) { return 64 * (i >> 2) + 4 * hl + (i & 3); }

// Exact selection key of one element (0 = ineligible: NaN logit, or a masked / idle token, whose
// caches then hold no candidate and can trigger neither a refill nor the exact path).
template <int SF>
__device__ __forceinline__ uint32_t wide_key(float x, float score, float bias, bool valid) {
  uint32_t k;
  if constexpr (SF == kScoreSoftmaxAfterTopk) {
    float sel = __fadd_rn(__fadd_rn(x, bias), 0.0f);  // -0 -> +0
    if (isnan(sel)) sel = -CUDART_INF_F;             // inf + -inf
    k = isnan(x) ? 0u : order_key2(sel);
  } else {
    const float sel = __fadd_rn(score, bias);  // scores are never -0: adding +0 changes nothing
    k = isnan(sel) ? 0u : order_key2(sel);
  }
  return valid ? k : 0u;
}

// Composite of lane hl's element i: the key's high bits, then IM - e (unique per expert, and a larger
// composite means a higher key, then a lower expert).
template <int IB>
__device__ __forceinline__ uint32_t wide_composite(uint32_t key, int hl, int i) {
  constexpr uint32_t IM = (1u << IB) - 1u;
  return (key & ~IM) | (IM - static_cast<uint32_t>(wide_expert(hl, i)));
}

// Lane's three best composites (key high bits, then IM - e), with kBelow only those strictly below
// `below` (a refill).
template <int NV, int IB, bool kBelow>
__device__ __forceinline__ void wide_fill(const uint32_t (&ek)[NV], int hl, uint32_t below, uint32_t& c1, uint32_t& c2,
                                          uint32_t& c3) {
  c1 = c2 = c3 = 0;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const uint32_t c = wide_composite<IB>(ek[i], hl, i);
    top3(c1, c2, c3, !kBelow || c < below ? c : 0u);
  }
}

// Lane's four best composites (the first fill of the unrolled rounds).
template <int NV, int IB>
__device__ __forceinline__ void wide_fill4(const uint32_t (&ek)[NV], int hl, uint32_t& c1, uint32_t& c2, uint32_t& c3,
                                           uint32_t& c4) {
  c1 = c2 = c3 = c4 = 0;
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const uint32_t c = wide_composite<IB>(ek[i], hl, i);
    const uint32_t l1 = min(c1, c);
    c1 = max(c1, c);
    const uint32_t l2 = min(c2, l1);
    c2 = max(c2, l1);
    const uint32_t l3 = min(c3, l2);
    c3 = max(c3, l2);
    c4 = max(c4, l3);
  }
}

// Exact top-k over the half-warp's keys (0 = not a candidate): K rounds of (max key, lowest
// expert). Returns the expert of slot hl (-1 when none is left).
template <int NV>
__device__ __forceinline__ int wide_exact_topk(const uint32_t (&ek)[NV], int K, int hl, int half) {
  uint32_t taken = 0;
  int id = -1;
  for (int r = 0; r < K; ++r) {
    uint32_t bk = 0;
#pragma unroll
    for (int i = 0; i < NV; ++i) bk = max(bk, ((taken >> i) & 1u) ? 0u : ek[i]);
    const uint32_t m = half_max_u32(bk, half);
    unsigned le = 0xffffffffu;
#pragma unroll
    for (int i = 0; i < NV; ++i)
      if (!((taken >> i) & 1u) && ek[i] == m) le = min(le, static_cast<unsigned>(wide_expert(hl, i)));
    const unsigned we = half_min_u32(le, half);
    if (m != 0u) {
      if (((we >> 2) & 15u) == static_cast<unsigned>(hl)) taken |= 1u << (((we >> 6) << 2) | (we & 3u));
      if (hl == r) id = static_cast<int>(we);
    }
  }
  return id;
}

// Group-limited selection (G > 1, per = E / G in {32, 64, 128}): clears the keys of the experts
// outside the group_topk best groups (higher score first, ties to the lower group). Warp-collective;
// each half-warp is one token.
template <int NV>
__device__ __forceinline__ void wide_group_mask(uint32_t (&ek)[NV], const FwdParams& p, int hl, int half) {
  constexpr int NJ = NV / 4;
  const int per = p.per, G = p.G;
  uint32_t g1[NJ], g2[NJ];
  const int span = per == 32 ? 8 : 16;  // lanes holding one group's part of a quad column
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    g1[j] = g2[j] = 0u;
#pragma unroll
    for (int r = 0; r < 4; ++r) top2(g1[j], g2[j], ek[4 * j + r]);
    for (int off = 1; off < span; off <<= 1) {
      const uint32_t b1 = __shfl_xor_sync(kFull, g1[j], off), b2 = __shfl_xor_sync(kFull, g2[j], off);
      merge2(g1[j], g2[j], b1, b2);
    }
  }
  // Every lane gets all G group keys (compile-time indices only).
  uint32_t gk[8];
#pragma unroll
  for (int g = 0; g < 8; ++g) gk[g] = 0u;
  if (per == 32) {
    const int base = 16 * half;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      const uint32_t k = group_key(g1[j], g2[j]);
      gk[2 * j] = __shfl_sync(kFull, k, base);
      gk[2 * j + 1] = __shfl_sync(kFull, k, base + 8);
    }
  } else if (per == 64) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) gk[j] = group_key(g1[j], g2[j]);
  } else {  // 128: two quad columns per group
#pragma unroll
    for (int j = 0; j + 1 < NJ; j += 2) {
      merge2(g1[j], g2[j], g1[j + 1], g2[j + 1]);
      gk[j / 2] = group_key(g1[j], g2[j]);
    }
  }
  // Lane hl < G ranks group hl; one ballot gives the kept groups of both tokens.
  uint32_t own = gk[0];
#pragma unroll
  for (int g = 1; g < 8; ++g) own = hl == g ? gk[g] : own;
  int rank = 0;
#pragma unroll
  for (int g = 0; g < 8; ++g)
    rank += g < G && (gk[g] > own || (gk[g] == own && g < hl)) ? 1 : 0;
  const unsigned kept = (__ballot_sync(kFull, hl < G && rank < p.group_topk) >> (16 * half)) & 0xffffu;
  const int shift = __ffs(per) - 1;
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    const bool keep = (kept >> ((64 * j + 4 * hl) >> shift)) & 1u;
#pragma unroll
    for (int r = 0; r < 4; ++r) ek[4 * j + r] = keep ? ek[4 * j + r] : 0u;
  }
}

// V = NV experts per lane (E = 16 NV); SF the score function. Requirements (the launcher checks):
// E == 16 NV, K <= 16, rows 16-byte aligned, and G == 1 or (E / G) % 32 == 0 with G <= 8.
template <int NV, class LT, int SF>
__global__ void __launch_bounds__(kThreads, kWideMinBlocks) route_forward_wide_kernel(const __grid_constant__ FwdParams p) {
  begin_forward_after_previous_grid(p);
  static_assert(NV == 4 || NV == 8 || NV == 16, "E must be 64, 128 or 256");
  constexpr int E = 16 * NV;
  constexpr int IB = NV == 4 ? 6 : NV == 8 ? 7 : 8;
  constexpr uint32_t IM = (1u << IB) - 1u;
  constexpr int NJ = NV / 4;

  __shared__ __align__(16) float s_red[kWideStreams][E];
  __shared__ __align__(16) float s_bias[E];
  __shared__ float s_wlse[kWideStreams];
  __shared__ unsigned s_wcnt[kWideStreams];
  __shared__ unsigned long long s_n[kThreads];
  __shared__ float s_blk_lse;
  __shared__ unsigned long long s_blk_cnt;
  __shared__ int s_flag;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int half = lane >> 4, hl = lane & 15;
  const int stream = warp * 2 + half;
  const int K = p.K, G = p.G;
  const bool want_prob = p.prob_sum != nullptr, want_scal = p.scalars != nullptr;
  const bool need_softmax = SF == kScoreSoftmax || want_scal || (SF == kScoreSoftmaxAfterTopk && want_prob);
  const LT* logits = static_cast<const LT*>(p.logits);
  // Groups: per is a multiple of 32, so a quad lies in one group ((64 j + 4 l) / per).
  const bool grouped = G > 1;
  const bool has_bias = p.bias != nullptr;

  stage_bias(s_bias, p, E);
  if (tid == 0) {
    s_blk_lse = 0.0f;
    s_blk_cnt = 0;
  }
  __syncthreads();

  for (int64_t c = blockIdx.x; c < p.nchunks; c += gridDim.x) {
    const ChunkSpan span = chunk_span(p, c);
    const int64_t s = span.s, jc = span.jc, t_begin = span.begin, t_end = span.end;

    float acc[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) acc[i] = 0.0f;
    float w_lse = 0.0f;
    unsigned w_cnt = 0;

    // The warp's token pair (warp-uniform loop; a half-warp past the end idles).
    int64_t t = t_begin + stream;
    const int64_t step = kWideStreams;
    WideRow<NV, LT> cur, nxt;
    if (t < t_end) wide_load<NV, LT>(cur, logits + t * E, hl);
    for (int64_t tw = t_begin + 2 * warp; tw < t_end; tw += step, t += step) {
      const bool active = t < t_end;
      if (t + step < t_end) wide_load<NV, LT>(nxt, logits + (t + step) * E, hl);
      const LT* row = logits + t * E;

      float x[NV];
      wide_unpack<NV, LT>(cur, x);
      float lmx = __uint_as_float(0x7fc00000u);
#pragma unroll
      for (int i = 0; i < NV; ++i) lmx = fmaxf(lmx, x[i]);
      // 0: no eligible expert in the row (or no token here).
      const uint32_t mkey = half_max_u32(active && !isnan(lmx) ? order_key2(lmx) : 0u, half);
      const bool valid = mkey != 0u;
      const float mx = valid ? key_to_float(mkey) : 0.0f;
      const bool sat = isinf(mx);
      const float ml = mx * kLog2e;

      // Scores. u: exp(x - max) (softmax and logsumexp), NaN exactly where x is NaN.
      float sc[NV];
      float inv = 0.0f, lse = 0.0f;
      if (need_softmax) {
        float lsum = 0.0f;
        if (__any_sync(kFull, sat)) {
#pragma unroll
          for (int i = 0; i < NV; ++i) {
            sc[i] = shifted_exp(x[i], mx, ml, sat);
            lsum += fmaxf(sc[i], 0.0f);
          }
        } else {
#pragma unroll
          for (int i = 0; i < NV; ++i) {
            sc[i] = exp_shifted(x[i], ml);
            lsum += fmaxf(sc[i], 0.0f);
          }
        }
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) lsum += __shfl_xor_sync(kFull, lsum, o);
        // lsum >= 1 (the max contributes 1) for a valid row.
        inv = valid ? rcp_rn_normal(lsum) : 0.0f;
        if (want_scal && valid) lse = sat ? mx : fmaf(lg2_approx(lsum), 1.0f / kLog2e, mx);
      }
      float is = 0.0f;  // sigmoid: 1 / sum of the scores (statistics)
      if constexpr (SF == kScoreSigmoid) {
        float ssum = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          sc[i] = sigmoid_fast(x[i]);
          ssum += fmaxf(sc[i], 0.0f);
        }
        if (want_prob) {
#pragma unroll
          for (int o = 8; o > 0; o >>= 1) ssum += __shfl_xor_sync(kFull, ssum, o);
          is = valid && ssum > 0.0f ? 1.0f / ssum : 0.0f;
          if (valid) {  // an idle half-warp's registers hold stale values
#pragma unroll
            for (int i = 0; i < NV; ++i) acc[i] = fmaf(fmaxf(sc[i], 0.0f), is, acc[i]);
          }
        }
      } else {
        if (want_prob && valid) {
#pragma unroll
          for (int i = 0; i < NV; ++i) acc[i] = fmaf(fmaxf(sc[i], 0.0f), inv, acc[i]);
        }
        // Without a bias or groups the selection can rank exp(x - max) itself: 1 / sum is one
        // positive factor of the whole row (the weights are recomputed from the logits anyway).
        if (SF == kScoreSoftmax && (has_bias || grouped)) {
#pragma unroll
          for (int i = 0; i < NV; ++i) sc[i] *= inv;
        }
      }
      if (want_scal && valid) {
        w_lse += lse * lse;
        ++w_cnt;
      }

      // Exact selection keys (0 = ineligible: NaN logit; all 0 for a masked or idle token, whose
      // caches then hold no candidate and can trigger neither a refill nor the exact path).
      uint32_t ek[NV];
      if (has_bias) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          const float4 b4 = *reinterpret_cast<const float4*>(s_bias + 64 * j + 4 * hl);
          const float bq[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
          for (int r = 0; r < 4; ++r) ek[4 * j + r] = wide_key<SF>(x[4 * j + r], sc[4 * j + r], bq[r], valid);
        }
      } else {
#pragma unroll
        for (int i = 0; i < NV; ++i) ek[i] = wide_key<SF>(x[i], sc[i], 0.0f, valid);
      }

      if (grouped) wide_group_mask<NV>(ek, p, hl, half);

      // Top-k: K + 1 rounds of half-warp maxima over the lanes' four best composites, unrolled. A
      // lane that gives away all four while it holds more candidates could have owed a later pick:
      // then (rarely: a lane of 16 holding 5 of a token's K + 1 best) the warp redoes the rounds
      // with three-entry caches that refill below their last pick.
      uint32_t c1, c2, c3, c4;
      wide_fill4<NV, IB>(ek, hl, c1, c2, c3, c4);
      const bool more4 = c4 > IM;
      uint32_t slot = 0, prev = 0;
      bool collide = false;
#pragma unroll
      for (int r = 0; r <= kMaxTopk; ++r) {
        if (r > K) break;
        const uint32_t m = half_max_u32(c1, half);
        if (hl == r) slot = m;
        if (r > 0) collide = collide || (m > IM && (prev >> IB) == (m >> IB));
        prev = m;
        const bool won = c1 == m && m > IM;
        c1 = won ? c2 : c1;
        c2 = won ? c3 : c2;
        c3 = won ? c4 : c3;
        c4 = won ? 0u : c4;
      }
      if (__any_sync(kFull, more4 && c1 <= IM)) {
        wide_fill<NV, IB, false>(ek, hl, 0u, c1, c2, c3);
        bool more = c3 > IM;
        slot = prev = 0;
        collide = false;
#pragma unroll 1
        for (int r = 0; r <= K; ++r) {
          const uint32_t m = half_max_u32(c1, half);
          if (hl == r) slot = m;
          collide = collide || (r > 0 && m > IM && (prev >> IB) == (m >> IB));
          prev = m;
          const bool won = c1 == m && m > IM;
          if (won) {
            c1 = c2;
            c2 = c3;
            c3 = 0u;
          }
          const bool refill = won && more && c1 <= IM;
          if (__any_sync(kFull, refill)) {
            if (refill) {
              wide_fill<NV, IB, true>(ek, hl, m, c1, c2, c3);
              more = c3 > IM;
            }
          }
        }
      }
      int id;
      if (__any_sync(kFull, collide))
        id = wide_exact_topk<NV>(ek, K, hl, half);
      else
        id = slot > IM ? static_cast<int>(IM - (slot & IM)) : -1;

      // Weights from the selected logits, by the slot lanes, with the functions that scored them.
      const bool used = valid && hl < K && id >= 0;
      const float xs = used ? load_elem(row, id) : 0.0f;
      float q = 0.0f;
      if constexpr (SF == kScoreSoftmax) {
        if (used) q = shifted_exp(xs, mx, ml, sat) * inv;
      } else if constexpr (SF == kScoreSigmoid) {
        if (used) q = sigmoid_fast(xs);
      } else {
        float m2 = used ? xs : -CUDART_INF_F;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) m2 = fmaxf(m2, __shfl_xor_sync(kFull, m2, o));
        const bool sat2 = isinf(m2);
        if (used) q = shifted_exp(xs, m2, m2 * kLog2e, sat2);
        float s2 = q;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) s2 += __shfl_xor_sync(kFull, s2, o);
        if (used) q = q / s2;
      }
      float Q = q;
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) Q += __shfl_xor_sync(kFull, Q, o);
      const bool divide = p.normalize && Q > 0.0f;
      const float wgt = p.scale * (divide ? q / Q : q);
      if (active && hl < K) store_slot(p, t * K + hl, used ? id : -1, used ? wgt : 0.0f);
      cur = nxt;
    }

    // This chunk's statistics: the token streams in order (warp, then half-warp).
    if (want_prob) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
        *reinterpret_cast<float4*>(&s_red[stream][64 * j + 4 * hl]) =
            make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    }
    if (want_scal && hl == 0) {
      s_wlse[stream] = w_lse;
      s_wcnt[stream] = w_cnt;
    }
    __syncthreads();
    allow_next_grid_before_stats(p);
    commit_chunk_stats<kWideStreams>(p, s, jc, &s_red[0][0], E, s_wlse, s_wcnt, s_blk_lse, s_blk_cnt, want_prob,
                                     want_scal);
    __syncthreads();  // s_red is reused by the next chunk
  }
  finish_block_scalars(p, &s_red[0][0], s_n, s_blk_lse, s_blk_cnt, s_flag, want_scal);
}

}  // namespace epx::cuda::router_kernels
