// route_backward: d logits from d topk_weights (through the score function and the normalisation) and
// from the aux-loss and z-loss seeds, one warp per token in the legacy layout (router_legacy_kernels.cuh);
// ids outside [-1, E) or repeated within a row are masked and reported in the status word.
#pragma once

#include "cuda/router/router_device.cuh"

namespace epx::cuda::router_kernels {

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
        eligible_softmax<V>(x, em, mx, true, pr, inv, pv, lse, sat);
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

}  // namespace epx::cuda::router_kernels
