// route_forward, the lean kernel (EPX_ROUTER_KERNEL=lean; fp32 logits, E = 32 V experts with V in
// {4, 8, 16}). One token per warp, lane l holding experts e = V l + i (the fast kernels' layout with
// one token per warp, so their exact per-token code is this kernel's fallback). It keeps the wide
// kernel's contract -- the reference's selection wherever scores are well separated, exact ties to
// the lower expert, weights within a few 1e-6 relative, statistics deterministic run to run -- and
// spends as few instructions as it can on rows that need nothing special:
//  - no max subtraction: u = exp(x) as ex2.approx(x log2 e). A row takes the fast path while the sum
//    S of its u lies in [2^-30, 2^126]: then no logit is NaN, infinite or above ~87, 1 / S is a
//    normal number, and an exponential that underflowed to 0 (x below ~-87) weighs under 2^-96 of
//    the row. Softmax p = u / S, logsumexp = log S, sigmoid = u / (1 + u) from the same exponential
//    (the reference's 1 / (1 + exp(-x)) within a few ulp);
//  - selection keys: a score's own bits where the ranked values are non-negative (no bias), an order
//    key otherwise, then the low byte (9 bits for E = 512) replaced by 255 - e, the expert's rank,
//    with one prmt. A larger key is a higher value, then a lower expert; 0 means no candidate;
//  - top-k: each lane keeps its D best keys (D = 3 for K <= 8, else 4; 2 D - 1 min/max per element),
//    a fixed 9 (D = 3) or 17 rounds take the warp's max with one redux each, at least the K + 1 the
//    top K and its certainty need; lane 0 files the picks in shared memory, lane r reads pick r;
//  - groups (E / G a multiple of V with a power-of-two lanes per group): the lane's top-2 selection
//    values with fminf/fmaxf, an xor butterfly over the group's lanes, the group score as their sum,
//    and group_topk + 1 redux rounds over (score key, group) composites.
// A row where some lane's D cached keys were all picked while its next key could still beat the last
// pick is routed again after its 64-token window with every key of a lane cached (D = V, the same keys
// and rounds, so the same picks the reference makes; not with groups: see kDeeperPass). Rows the fast
// path cannot vouch for go, whole, through fast_route_token (router_fast_kernels.cuh), the fast
// kernels' exact per-token code: S outside its range (NaN, infinities, extreme logits), a non-finite
// bias, picks K - 1 and K with equal truncated keys (which of them is in the top K could hang on the
// dropped bits: an exact tie or a near one), or two group scores on either side of the kept/dropped
// boundary that agree on the truncated key. Equal truncated keys inside the top K only order the
// slots: those rows keep the fast path, and their K slots are sorted again on the full keys (with
// sigmoid scores near 1 such ties sent ~1.5% of random DeepSeek-V3 rows to the exact code). The exact
// code costs several fast rows, and the warp that meets one finishes late: with one wave of blocks the
// busiest SM's slowest warp sets the kernel's time, so the common cases (dry caches: ~0.2% of random
// rows at E = 256, K = 8; ties inside the top K) take cheap ways. Which path a row takes depends on
// the row alone, so the outputs stay deterministic. Every path adds a routed token's probabilities to
// the warp's shared-memory row of the chunk, in token order within each 64-token window (the deeper
// rows after the window's fast ones, then the exact ones), and its lse^2 and count once, so no token
// is counted twice.
// Rows are staged through a per-warp ring of lean_stages<V>() rows in shared memory (cp.async, the
// first three in flight at once), so no registers hold a prefetched row and the weights re-read
// their logits from shared memory.
// Launch: 8 warps per block, 3 blocks per SM (<= 80 registers; 2 at V = 16), one chunk per block.
// At 64 registers (4 blocks) the fast path spilled: the exact fallback, inlined or called, raises
// the kernel's register demand to its own.
#pragma once

#include <cfloat>
#include <type_traits>

#include "cuda/router/router_approx_math.cuh"
#include "cuda/router/router_fast_kernels.cuh"

namespace epx::cuda::router_kernels {

template <int V>
struct LeanBounds {
  static constexpr int kMinBlocks = V >= 16 ? 2 : 3;
};

// What route_row did with a row.
enum LeanRowResult : int { kLeanRowDone = 0, kLeanRowDeeper = 1, kLeanRowExact = 2 };

constexpr float kLeanSumMin = 9.313225746154785e-10f;  // 2^-30
constexpr float kLeanSumMax = 8.507059173023462e37f;    // 2^126

// exp(x), the fast path's only exponential of a logit.
__device__ __forceinline__ float lean_exp(float x) { return ex2_approx(x * kLog2e); }
// sigmoid(x) from u = exp(x): u / (1 + u) (1 beyond u = 2^24, to an ulp).
__device__ __forceinline__ float lean_sigmoid(float u) { return u * rcp_approx(1.0f + u); }

// The expert ranks of a lane's elements i = 4 k .. 4 k + 3, one byte each: 255 - (e0 + i).
__device__ __forceinline__ uint32_t lean_rank_pack(int e0, int k) {
  const uint32_t r0 = 255u - static_cast<uint32_t>(e0 + 4 * k);
  return r0 | ((r0 - 1u) << 8) | ((r0 - 2u) << 16) | ((r0 - 3u) << 24);
}

// Composite of key and element i (a constant after unrolling): E <= 256, the key's top three bytes
// and the rank byte i % 4 of packs[i / 4] (one prmt); E = 512, the key above bit 9 and 511 - e.
template <int V>
__device__ __forceinline__ uint32_t lean_composite(uint32_t key, const uint32_t* packs, int e0, int i) {
  if constexpr (V <= 8) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(key), "r"(packs[i / 4]), "r"(0x3214 + (i % 4)));
    return d;
  } else {
    (void)packs;
    return (key & ~511u) | (511u - static_cast<uint32_t>(e0 + i));
  }
}

// Inserts v into the descending cache c[0] >= ... >= c[D - 1] (distinct keys; 0 = empty).
template <int D>
__device__ __forceinline__ void lean_insert(uint32_t (&c)[D], uint32_t v) {
#pragma unroll
  for (int k = D - 1; k > 0; --k) c[k] = max(c[k], min(c[k - 1], v));
  c[0] = max(c[0], v);
}

// Sorts the warp's 64-bit values in descending order across its lanes (lane 0 the largest): a bitonic
// network of 15 exchange steps. Rare path (picks that tie on their truncated keys), so no registers
// are spent on fewer steps.
__device__ __forceinline__ uint64_t lean_sort_desc(uint64_t v, int lane) {
#pragma unroll
  for (int k = 2; k <= 32; k <<= 1) {
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      const uint64_t o = __shfl_xor_sync(kFull, v, j);
      const bool keep_max = ((lane & j) == 0) == ((lane & k) == 0);  // blocks of k alternate direction
      v = keep_max ? (v > o ? v : o) : (v < o ? v : o);
    }
  }
  return v;
}

// A lane's 16 bytes of a row, global -> shared, asynchronously (cp.async, L2 only); groups of them
// are committed and waited for in order.
__device__ __forceinline__ void lean_copy16(float* dst, const float* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void lean_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void lean_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Rows in flight per warp (the ring of staged rows): deeper where a row is smaller.
template <int V>
constexpr int lean_stages() {
  return V >= 16 ? 2 : 4;
}
// Dynamic shared memory of a block: each warp's ring of rows.
template <int V>
constexpr int lean_smem_bytes() {
  return kWarps * lean_stages<V>() * 32 * V * static_cast<int>(sizeof(float));
}

// The fallback: the whole token t through the fast kernels' exact code (one token per warp), its
// statistics added to this warp's shared-memory row red (E floats) and to *wlse / *wcnt. Called after
// each window of the fast loop, not inside it, so that the registers live across the loop are not
// the ones this code needs (called from inside, or out of line, it spilled the loop at 64 registers).
// Its setup is rebuilt per call: the rows it serves are rare, registers are not.
template <int V, int SF>
__device__ __forceinline__ void lean_exact_token(const FwdParams& p, int lane, int warp, const float* s_bias,
                                                 int* s_lane_gf, int* s_lane_jb, int64_t t, float* red, float* wlse,
                                                 unsigned* wcnt) {
  const FastTokenSetup<1> ts = fast_token_setup<V, SF, 1>(p, lane, warp, s_bias, s_lane_gf, s_lane_jb);
  const float* row = static_cast<const float*>(p.logits) + t * p.E;
  RowRaw<V, float> raw;
  load_row<V, float>(raw, row, ts.e0, p.E, true);
  float x[V];
  unpack_row<V, float>(raw, x);
  float acc[V];
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] = 0.0f;
  float w_lse = 0.0f;
  unsigned w_cnt = 0;
  fast_route_token<V, float, SF, 1>(p, ts, row, t, x, acc, w_lse, w_cnt);
  if (ts.want_prob) {
#pragma unroll
    for (int i = 0; i < V; ++i) red[ts.e0 + i] += acc[i];
  }
  if (ts.want_scal && lane == 0) {
    *wlse += w_lse;
    *wcnt += w_cnt;
  }
}

// Requirements (the launcher checks): E == 32 V, K <= 16, rows 16-byte aligned, kBias == (a bias is
// given), kGroups == (G > 1) with E / G a multiple of V and (E / G) / V a power of two; D = 3 for
// K <= 8, else 4; lean_smem_bytes<V>() of dynamic shared memory.
template <int V, int SF, int D, bool kBias, bool kGroups>
__global__ void __launch_bounds__(kThreads, LeanBounds<V>::kMinBlocks)
    route_forward_lean_kernel(const __grid_constant__ FwdParams p) {
  static_assert(V == 4 || V == 8 || V == 16, "E must be 128, 256 or 512");
  static_assert(D == 3 || D == 4, "caches of 3 or 4 keys");
  constexpr int E = 32 * V;
  constexpr int IBK = V <= 8 ? 8 : 9;  // bits of the rank in a composite
  constexpr uint32_t IMK = (1u << IBK) - 1u;
  constexpr int NQ = V / 4;  // 16-byte quads per lane
  constexpr int R = lean_stages<V>();
  constexpr int kRounds = D == 3 ? 9 : 17;  // >= K + 1 for every K the cache depth serves
  // Keys from the ranked values' own bits: non-negative scores, no bias to add.
  constexpr bool kPositive = SF != kScoreSoftmaxAfterTopk && !kBias;
  // Softmax without a bias or groups ranks u itself (p = u / S for one S per row).
  constexpr bool kRankU = SF == kScoreSoftmax && !kBias && !kGroups;
  // Rows with a dry cache are routed again with deeper caches, or, with groups, by the exact code: the
  // second copy of the row code cost the group kernels spills in their fast loop (H200: DeepSeek-V3
  // 5% slower), and their slow rows are mostly ties, not dry caches.
  constexpr bool kDeeperPass = !kGroups;

  extern __shared__ __align__(16) float s_rows[];  // [kWarps][R][E]
  __shared__ __align__(16) float s_red[kWarps][E];
  __shared__ __align__(16) float s_bias[E];
  __shared__ float s_wlse[kWarps];
  __shared__ unsigned s_wcnt[kWarps];
  __shared__ unsigned long long s_n[kThreads];
  __shared__ uint32_t s_picks[kWarps][kRounds];
  __shared__ int s_lane_gf[32], s_lane_jb[32];  // the fallback's legacy group layout (unused: groups are aligned)
  __shared__ float s_blk_lse;
  __shared__ unsigned long long s_blk_cnt;
  __shared__ int s_flag;

  // What needs neither global memory nor the previous grid comes before the wait for that grid, so
  // that it overlaps the previous grid's last blocks: the block's indices, the first chunk's span and
  // the zeroed shared-memory accumulators.
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int e0 = V * lane;
  const int K = p.K;
  const bool want_prob = p.prob_sum != nullptr, want_scal = p.scalars != nullptr;
  const bool need_exp = SF != kScoreSoftmaxAfterTopk || want_prob || want_scal;
  const float* logits = static_cast<const float*>(p.logits);
  float* ring = s_rows + warp * R * E;  // this warp's staged rows
  float* red = &s_red[warp][0];         // this warp's prob_sum row of the chunk
  uint32_t packs[NQ];
#pragma unroll
  for (int k = 0; k < NQ; ++k) packs[k] = lean_rank_pack(e0, k);
  const int lpg = kGroups ? p.per / V : 32;  // lanes per group; group g = lanes [g lpg, (g + 1) lpg)
  const uint32_t my_group = kGroups ? static_cast<uint32_t>(lane / lpg) : 0u;
  ChunkSpan span = chunk_span(p, blockIdx.x);
  // A warp's accumulators of the chunk: zeroed here for the first chunk, after each commit for the next.
  auto zero_warp_stats = [&] {
#pragma unroll
    for (int k = 0; k < NQ; ++k) reinterpret_cast<float4*>(red + e0)[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (lane == 0) {
      s_wlse[warp] = 0.0f;
      s_wcnt[warp] = 0;
    }
  };
  zero_warp_stats();
  if (tid == 0) {
    s_blk_lse = 0.0f;
    s_blk_cnt = 0;
  }

  begin_forward_after_previous_grid(p);
  stage_bias(s_bias, p, E);
  __syncthreads();
  bool bias_finite = true;
#pragma unroll
  for (int i = 0; i < V; ++i) bias_finite = bias_finite && isfinite(s_bias[e0 + i]);
  const bool bias_ok = __all_sync(kFull, bias_finite);  // NaN was staged as -inf

  for (int64_t c = blockIdx.x; c < p.nchunks; c += gridDim.x) {
    if (c != blockIdx.x) span = chunk_span(p, c);
    const int64_t s = span.s, jc = span.jc, t_begin = span.begin, t_end = span.end;

    // The warp's tokens t_begin + warp + kWarps j; the first R - 1 rows go in flight at once (a
    // group is committed for every row slot, empty past the end, so the waits count uniformly).
    const int64_t t0 = t_begin + warp;
    const int n = t0 < t_end ? static_cast<int>((t_end - 1 - t0) / kWarps) + 1 : 0;
#pragma unroll
    for (int j = 0; j + 1 < R; ++j) {
      if (j < n) {
#pragma unroll
        for (int k = 0; k < NQ; ++k)
          lean_copy16(ring + j * E + e0 + 4 * k, logits + (t0 + kWarps * j) * E + e0 + 4 * k);
      }
      lean_commit();
    }
    float w_lse = 0.0f;
    unsigned w_cnt = 0;

    // The value the reference ranks an expert by, from its logit xv, exponential uv (softmax), score and
    // bias; and its full 32-bit key, whose unsigned order is that value's order. The lane caches and the
    // re-sort of tied picks both rank by these.
    auto sel_value = [&](float xv, float uv, float score, float b) -> float {
      if constexpr (SF == kScoreSoftmaxAfterTopk)
        return __fadd_rn(__fadd_rn(xv, b), 0.0f);  // -0 -> +0: the reference ties them
      else if constexpr (kBias)
        return __fadd_rn(score, b);
      else
        return kRankU ? uv : score;
    };
    auto full_key = [](float v) -> uint32_t { return kPositive ? __float_as_uint(v) : order_key2(v); };

    // Routes one row: t's logits in x (this lane's V), its caches DD keys deep. Writes the row's slots and
    // statistics and returns kLeanRowDone, or writes nothing and says which path must take the row:
    // kLeanRowDeeper where a lane's cache ran dry while its next key could still be picked (only deeper
    // caches are needed: DD = V cannot run dry), kLeanRowExact where the fast path cannot vouch for the
    // row at all. logit_of(used, id) gives a slot lane the logit of expert id (warp-collective).
    auto route_row = [&](auto depth, const float (&x)[V], int64_t t, const auto& logit_of) -> int {
      constexpr int DD = decltype(depth)::value;
      // Exponentials and the row's sums; sigmoid keeps its scores sv, softmax its u (p = u / S).
      float u[V], sv[V];
      float S = 0.0f, SS = 0.0f;
      bool fast = bias_ok;
      if constexpr (SF == kScoreSigmoid) {
        float su[2], ss[2];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          u[i] = lean_exp(x[i]);
          sv[i] = lean_sigmoid(u[i]);
          su[i & 1] = i < 2 ? u[i] : su[i & 1] + u[i];
          ss[i & 1] = i < 2 ? sv[i] : ss[i & 1] + sv[i];
        }
        S = su[0] + su[1];
        SS = ss[0] + ss[1];
        token_sum2(TokenLanes<1>(lane), S, 0.0f, SS, 0.0f);  // one butterfly for both sums
        fast = fast && S >= kLeanSumMin && S <= kLeanSumMax;
      } else if (need_exp) {
        float su[2];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          u[i] = lean_exp(x[i]);
          su[i & 1] = i < 2 ? u[i] : su[i & 1] + u[i];
        }
        S = warp_sum(su[0] + su[1]);
        fast = fast && S >= kLeanSumMin && S <= kLeanSumMax;
      } else {  // softmax after top-k without statistics: the logits only need to be finite
        float ax = 0.0f;
#pragma unroll
        for (int i = 0; i < V; ++i) ax += fabsf(x[i]);
        fast = fast && __all_sync(kFull, ax <= FLT_MAX);
      }
      bool slow = !fast;

      // 1 / S (softmax p and the statistics) or 1 / the sum of the sigmoid scores; normal where the
      // row is fast.
      const float inv = SF == kScoreSigmoid ? rcp_rn_normal(SS) : (need_exp ? rcp_rn_normal(S) : 0.0f);
      // Element i's score (softmax probability or sigmoid) and, once, its selection value: softmax
      // without a bias or groups ranks u itself (p = u / S for one S per row), the others the score
      // plus the bias, or the logit plus the bias after top-k.
      auto score_of = [&](int i) -> float {
        if constexpr (SF == kScoreSigmoid)
          return sv[i];
        else
          return u[i] * inv;
      };
      auto sel_of = [&](int i) -> float { return sel_value(x[i], u[i], score_of(i), s_bias[e0 + i]); };
      auto key_of = [&](int i) -> uint32_t { return lean_composite<V>(full_key(sel_of(i)), packs, e0, i); };
      // Each lane's D best composites; dth, the D-th, bounds what a refill would look at.
      uint32_t cache[DD];
#pragma unroll
      for (int k = 0; k < DD; ++k) cache[k] = 0u;
#pragma unroll
      for (int i = 0; i < V; ++i) lean_insert<DD>(cache, key_of(i));
      const uint32_t dth = cache[DD - 1];

      // Groups: the lane's top-2 selection values, merged over the group's lanes; the group score
      // is their sum (every expert is eligible here, and a group has >= V >= 4 of them).
      bool kept = true;
      if constexpr (kGroups) {
        float t1 = -CUDART_INF_F, t2 = -CUDART_INF_F;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float v = sel_of(i);
          t2 = fmaxf(t2, fminf(t1, v));
          t1 = fmaxf(t1, v);
        }
        for (int off = 1; off < lpg; off <<= 1) {
          const float b1 = __shfl_xor_sync(kFull, t1, off), b2 = __shfl_xor_sync(kFull, t2, off);
          t2 = fmaxf(fminf(t1, b1), fmaxf(t2, b2));
          t1 = fmaxf(t1, b1);
        }
        // (score key, 15 - group): a larger composite is a higher score, then a lower group. The
        // lanes of a group hold the same composite, so a round takes whole groups.
        uint32_t gk = (order_key2(__fadd_rn(t1, t2)) & ~15u) | (15u - my_group);
        uint32_t gl = 0;
        kept = false;
        for (int r = 0; r < p.group_topk; ++r) {
          gl = __reduce_max_sync(kFull, gk);
          const bool won = gk == gl;
          kept = kept || won;
          gk = won ? 0u : gk;
        }
        const uint32_t gn = __reduce_max_sync(kFull, gk);
        slow = slow || (gn != 0u && (gn >> 4) == (gl >> 4));  // the kept/dropped boundary could hang on dropped bits
        if (!kept) {
#pragma unroll
          for (int k = 0; k < DD; ++k) cache[k] = 0u;
        }
      }

      // kRounds >= K + 1 rounds: pick r is the warp's max head; its lane moves on to its next key.
      // Pick K only tells whether pick K - 1 is certain; picks past it are not used. Lane 0 files
      // the picks, lane r then reads pick r (and r + 1).
      uint32_t* picks = &s_picks[warp][0];
#pragma unroll
      for (int r = 0; r < kRounds; ++r) {
        const uint32_t m = __reduce_max_sync(kFull, cache[0]);
        if (lane == 0) picks[r] = m;
        if (r == kRounds - 1) break;  // the last pick's lane need not move on
        const bool won = cache[0] == m;
#pragma unroll
        for (int k = 0; k + 1 < DD; ++k) cache[k] = won ? cache[k + 1] : cache[k];
        cache[DD - 1] = won ? 0u : cache[DD - 1];
      }
      __syncwarp();
      const uint32_t slot = lane < kRounds ? picks[lane] : 0u;
      const uint32_t after = lane + 1 < kRounds ? picks[lane + 1] : 0u;
      const uint32_t last = picks[K];
      // Consecutive picks whose truncated keys agree: their order hangs on the dropped bits. Picks K - 1
      // and K decide which expert is in the top K (the exact code decides); ties among the top K only
      // order them, and are sorted again below on their full keys.
      const bool tie_next = lane < K && slot != 0u && (slot >> IBK) == (after >> IBK);
      const bool doubt = lane == K - 1 && tie_next;
      const bool reorder = __any_sync(kFull, lane < K - 1 && tie_next);
      // A lane that gave away its DD keys had its next one left out of the later rounds: harmless
      // unless that key beats the last pick. Rare (some lane holds DD of the top K + 1: ~5% of
      // random rows at E = 256, K = 8, DD = 3), so the next key is looked for only then.
      bool deeper = false;
      if constexpr (V > DD) {
        const bool emptied = kept && cache[0] == 0u;
        if (__any_sync(kFull, emptied)) {
          uint32_t next = 0;
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const uint32_t k = key_of(i);
            next = k < dth ? max(next, k) : next;
          }
          deeper = __any_sync(kFull, emptied && next > last);
        }
      }
      slow = slow || __any_sync(kFull, doubt);
      // A near tie (or a row outside the fast range) needs the exact code; a dry cache, only deeper
      // caches. Either way nothing of the row is written here.
      if (slow) return kLeanRowExact;
      if (deeper) return kDeeperPass ? kLeanRowDeeper : kLeanRowExact;
      // Weights: the slot lanes recompute their expert's score from its staged logit with the
      // functions that scored it, so an unnormalised weight is exactly the score that selected it.
      bool used = lane < K && slot != 0u;
      int id = used ? static_cast<int>(IMK - (slot & IMK)) : -1;
      if (reorder) {  // warp-uniform, rare: the top K by (full key, lower expert), recomputed from the logits
        const float xt = logit_of(used, id), ut = lean_exp(xt);
        const float st = SF == kScoreSigmoid ? lean_sigmoid(ut) : ut * inv;
        const uint32_t full = full_key(sel_value(xt, ut, st, s_bias[used ? id : 0]));
        const uint64_t key =
            used ? (static_cast<uint64_t>(full) << 32) | (0xffffffffu - static_cast<uint32_t>(id)) : 0ull;
        const uint64_t mine = lean_sort_desc(key, lane);
        used = lane < K && mine != 0ull;
        id = used ? static_cast<int>(0xffffffffu - static_cast<uint32_t>(mine)) : -1;
      }
      const float xs = logit_of(used, id);
      float w = 0.0f;
      if constexpr (SF == kScoreSoftmax) {
        w = used ? lean_exp(xs) * inv : 0.0f;
      } else if constexpr (SF == kScoreSigmoid) {
        w = used ? lean_sigmoid(lean_exp(xs)) : 0.0f;
      } else {  // softmax over the selected logits (the slots are lanes 0..15)
        const float m2 = half_max(used ? xs : -CUDART_INF_F);
        const float ex = used ? ex2_approx((xs - m2) * kLog2e) : 0.0f;
        const float s2 = half_sum(ex);  // >= 1 where a slot is used: the max contributes 1
        w = used ? ex * rcp_rn_normal(s2) : 0.0f;
      }
      const float W = half_sum(w);
      const bool divide = p.normalize && W > 0.0f;
      const float wgt = p.scale * (divide ? w * rcp_approx(W) : w);  // W in (0, 16]
      if (lane < K) store_slot(p, t * K + lane, id, used ? wgt : 0.0f);

      if (want_prob) {
#pragma unroll
        for (int k = 0; k < NQ; ++k) {
          float4& a = reinterpret_cast<float4*>(red + e0)[k];
          const float4 o = a;
          const float sc = SF == kScoreSigmoid ? inv : 1.0f;  // sigmoid: s / sum s
          a = make_float4(o.x + score_of(4 * k) * sc, o.y + score_of(4 * k + 1) * sc,
                          o.z + score_of(4 * k + 2) * sc, o.w + score_of(4 * k + 3) * sc);
        }
      }
      if (want_scal) {
        const float lse = lg2_approx(S) * kLn2;
        w_lse += lse * lse;
        ++w_cnt;
      }
      return kLeanRowDone;
    };

    // The fast path over windows of 64 tokens; a window's slow tokens (a bit each) go through the
    // exact code after it. A row is computed through to its picks without branching on whether it is
    // fast (a slow row's values are never written): the branches cost more than the rare slow row's
    // wasted work (H200: 4-7% of softmax top-8 at E = 128-512, level at DeepSeek-V3).
    for (int j0 = 0; j0 < n; j0 += 64) {
      const int jn = min(n, j0 + 64);
      uint64_t slow_tokens = 0, deeper_tokens = 0;
      for (int j = j0; j < jn; ++j) {  // warp-uniform
        if (j + R - 1 < n) {
          const int jr = j + R - 1;
          float* dst = ring + (jr % R) * E + e0;
          const float* src = logits + (t0 + static_cast<int64_t>(kWarps) * jr) * E + e0;
#pragma unroll
          for (int k = 0; k < NQ; ++k) lean_copy16(dst + 4 * k, src + 4 * k);
        }
        lean_commit();
        lean_wait<R - 1>();  // this lane's copies of row j have landed ...
        __syncwarp();        // ... and every lane's (the weights read other lanes' logits)
        const float* x_row = ring + (j % R) * E;
        float x[V];
#pragma unroll
        for (int k = 0; k < NQ; ++k) {
          const float4 v = reinterpret_cast<const float4*>(x_row + e0)[k];
          x[4 * k] = v.x;
          x[4 * k + 1] = v.y;
          x[4 * k + 2] = v.z;
          x[4 * k + 3] = v.w;
        }

        const int64_t t = t0 + static_cast<int64_t>(kWarps) * j;
        const int routed = route_row(std::integral_constant<int, D>{}, x, t,
                                     [&](bool used, int id) { return used ? x_row[id] : 0.0f; });
        if (routed == kLeanRowExact) slow_tokens |= 1ull << (j - j0);
        if (routed == kLeanRowDeeper) deeper_tokens |= 1ull << (j - j0);
        __syncwarp();  // every lane is done with this row before a later copy overwrites its slot
      }
      // A window's rows with a dry cache, again with every key of a lane cached (their logits reloaded:
      // the ring has moved on); those with a near tie join the exact ones.
      if constexpr (kDeeperPass) {
        while (deeper_tokens != 0) {
          const int b = __ffsll(static_cast<long long>(deeper_tokens)) - 1;
          deeper_tokens &= deeper_tokens - 1;
          const int64_t t = t0 + static_cast<int64_t>(kWarps) * (j0 + b);
          float xd[V];
#pragma unroll
          for (int k = 0; k < NQ; ++k) {
            const float4 v = __ldg(reinterpret_cast<const float4*>(logits + t * E + e0) + k);
            xd[4 * k] = v.x;
            xd[4 * k + 1] = v.y;
            xd[4 * k + 2] = v.z;
            xd[4 * k + 3] = v.w;
          }
          const auto shuffled_logit = [&](bool used, int id) {  // expert id's logit from the lane holding it
            const int src = used ? id / V : 0, i = used ? id % V : 0;
            float v = 0.0f;
#pragma unroll
            for (int k = 0; k < V; ++k) {
              const float o = __shfl_sync(kFull, xd[k], src);
              v = k == i ? o : v;
            }
            return used ? v : 0.0f;
          };
          if (route_row(std::integral_constant<int, V>{}, xd, t, shuffled_logit) != kLeanRowDone)
            slow_tokens |= 1ull << b;
        }
      }
      while (slow_tokens != 0) {
        const int b = __ffsll(static_cast<long long>(slow_tokens)) - 1;
        slow_tokens &= slow_tokens - 1;
        lean_exact_token<V, SF>(p, lane, warp, s_bias, s_lane_gf, s_lane_jb, t0 + kWarps * (j0 + b), red,
                                &s_wlse[warp], &s_wcnt[warp]);
      }
    }

    // This chunk's statistics: the warps in order (red holds the fallback's and the fast path's).
    if (want_scal && lane == 0) {
      s_wlse[warp] += w_lse;
      s_wcnt[warp] += w_cnt;
    }
    __syncthreads();
    allow_next_grid_before_stats(p);
    commit_chunk_stats<kWarps>(p, s, jc, &s_red[0][0], E, s_wlse, s_wcnt, s_blk_lse, s_blk_cnt, want_prob, want_scal);
    __syncthreads();  // s_red and s_wlse are reused by the next chunk
    zero_warp_stats();
  }
  lean_wait<0>();  // nothing is left in flight (the groups past the end were empty)
  finish_block_scalars(p, &s_red[0][0], s_n, s_blk_lse, s_blk_cnt, s_flag, want_scal);
}

}  // namespace epx::cuda::router_kernels
