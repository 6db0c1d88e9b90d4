// route_forward, the legacy kernel (EPX_ROUTER_KERNEL=legacy, kept for comparisons; the fast kernels keep
// its layout): the CUDA twin of src/ref/router.cpp (semantics in include/epx/router.h).
//
// Layout. One warp per token. Lane l owns the V = 2^ceil(log2(E/32)) CONTIGUOUS experts
// [l*V, l*V + V) in registers (V in {1, 2, 4, 8, 16}); slots at or past E read as NaN, which the
// contract already treats as "ineligible", so padding needs no special case. Rows are loaded with
// 16-byte vector loads where alignment allows.
//
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
// Statistics: router_device.cuh.
#pragma once

#include "cuda/router/router_device.cuh"

namespace epx::cuda::router_kernels {

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
        if (need_softmax) eligible_softmax<V>(x, em, mx, SF != kScoreSigmoid, pr, inv, pv, lse, sat);

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
          id = exact_topk<V, 1>(TokenLanes<1>(lane), ek, K);

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
    }
    if (arrive_last(p.scal_ticket, gridDim.x, s_flag)) {
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

}  // namespace epx::cuda::router_kernels
