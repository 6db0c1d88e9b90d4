// route_forward, the tile kernel (the default for fp32 logits with E in {128, 256}; EPX_ROUTER_KERNEL=tile).
// The warp-per-token kernels spend most of their instructions on warp-wide steps (a shuffle or
// redux per selection round, per reduction, per group merge), each serving one or two tokens; that
// is what kept them instruction-bound at 20-30 us for T = 16384, E = 256 (NOTES.md). Here a token
// belongs to two lanes (lane 2t holds experts [0, E/2), lane 2t+1 the rest), so almost every
// instruction is per-element work, and the per-token scalar work (row max, sums, group ranking,
// the top-k) costs a lane-pair's instructions instead of a warp's:
//  - a warp stages a tile of 16 rows in shared memory with cp.async (row stride E + 8 floats, the
//    second half at E/2 + 4: the 8 lanes of a 16-byte load phase hit distinct banks), then makes a
//    few passes over its half: the max, the scores (stored back over the logits, except for
//    softmax-after-top-k, whose selection reads the logits), the selection keys;
//  - top-k by a threshold: while scanning the keys each lane keeps the max of every 8 experts (a
//    segment). The K-th largest segment max over the token's kept segments, tau, is a key that K
//    distinct experts reach, so every expert of the exact top K has a key >= tau. Only the experts at
//    or above tau (about K + 2 per token on random rows) become candidates, appended to a per-lane
//    list; each lane sorts its candidates into a K-entry list (higher key, then lower expert), and the
//    lane pair merges its two lists. The selection is exact for any row; a lane with more candidates
//    than its list holds (ties at tau, e.g. equal rows) rescans its half instead;
//  - groups: every lane keeps the top-2 of its groups' keys; each pair ranks the groups from shared
//    memory and drops the segments of the groups it does not keep before tau is taken;
//  - statistics: after a tile's scores are in shared memory, lane l adds the scores of experts
//    l, l + 32, ... of the 16 tokens in token order into registers (fp32, fixed order), and a chunk's
//    rows are committed by commit_chunk_stats (fixed point, bit-identical run to run).
// Scores, keys and weights use the wide kernel's functions (router_wide_kernels.cuh: ex2.approx based
// exponentials and sigmoid, the same keys, a weight is the stored score that selected it), so the
// contract is the wide kernel's: the reference's selection on well-separated scores, weights within a
// few 1e-6 relative, NaN/inf and ties as the reference treats them; deterministic run to run.
// Launch: 8 warps per block (one chunk of tokens at a time), dynamic shared memory (TileLayout).
#pragma once

#include "cuda/router/router_wide_kernels.cuh"

namespace epx::cuda::router_kernels {

constexpr int kTileTokens = 16;      // tokens of one warp's tile (two lanes each)
constexpr int kTileCandidates = 16;  // candidate slots per lane
constexpr int kSegment = 8;          // experts per segment max

template <int E>
struct TileLayout {
  static constexpr int kHalf = E / 2;         // experts per lane
  static constexpr int kRowStride = E + 8;    // floats; the second half starts at kHalf + 4
  static constexpr int kSegs = kHalf / kSegment;
  static constexpr int kTileBytes = kTileTokens * kRowStride * 4;
  static constexpr int kSegBytes = kSegs * 32 * 4;
  static constexpr int kCandBytes = kTileCandidates * 32 * 2;
  static constexpr int kGroupBytes = kTileTokens * kMaxGroups * 4;
  static constexpr int kWarpBytes = kTileBytes + kSegBytes + kCandBytes + kGroupBytes;
  // Block: the warps' regions, the statistics rows [kWarps][E], the bias [E].
  static constexpr int kBlockBytes = kWarps * kWarpBytes + kWarps * E * 4 + E * 4;
  static_assert(kWarpBytes % 16 == 0, "16-byte aligned warp regions");
};

// Shared-memory offset (floats) of expert e in a staged row.
template <int E>
__device__ __forceinline__ int tile_pos(int e) {
  return e + (e >= E / 2 ? 4 : 0);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

// Sorted (descending) list of K <= KMAX (key, expert) pairs; inserting with `>` keeps the earlier of
// equal keys first, so inserting in ascending expert order ranks ties by the lower expert.
template <int KMAX>
struct TopList {
  uint32_t k[KMAX];
  int e[KMAX];
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < KMAX; ++i) {
      k[i] = 0u;
      e[i] = -1;
    }
  }
  __device__ __forceinline__ void insert(uint32_t key, int ex) {
#pragma unroll
    for (int i = 0; i < KMAX; ++i) {
      const bool gt = key > k[i];
      const uint32_t tk = gt ? k[i] : key;
      const int te = gt ? e[i] : ex;
      k[i] = gt ? key : k[i];
      e[i] = gt ? ex : e[i];
      key = tk;
      ex = te;
    }
  }
};

// Sorted (descending) multiset of the KMAX largest keys.
template <int KMAX>
__device__ __forceinline__ void insert_key(uint32_t (&l)[KMAX], uint32_t v) {
#pragma unroll
  for (int i = 0; i < KMAX; ++i) {
    const uint32_t hi = max(l[i], v);
    v = min(l[i], v);
    l[i] = hi;
  }
}

// E: 128 or 256 (fp32 logits); SF the score function; KMAX >= K (8 or 16).
template <int E, int SF, int KMAX>
__global__ void __launch_bounds__(kThreads, 1) route_forward_tile_kernel(const __grid_constant__ FwdParams p) {
  using Lay = TileLayout<E>;
  constexpr int NH = Lay::kHalf, RS = Lay::kRowStride, NSEG = Lay::kSegs;
  constexpr int NQ = NH / 4;         // float4 quads per lane
  constexpr int NA = E / 32;         // statistics experts per lane
  constexpr int CAP = kTileCandidates;
  static_assert(E == 128 || E == 256, "the tile kernel takes E = 128 or 256");

  extern __shared__ __align__(16) unsigned char tile_smem[];
  __shared__ float s_wlse[kWarps];
  __shared__ unsigned s_wcnt[kWarps];
  __shared__ unsigned long long s_n[kThreads];
  __shared__ float s_blk_lse;
  __shared__ unsigned long long s_blk_cnt;
  __shared__ int s_flag;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tok = lane >> 1, h = lane & 1;
  unsigned char* wbase = tile_smem + warp * Lay::kWarpBytes;
  float* tile = reinterpret_cast<float*>(wbase);
  uint32_t* s_seg = reinterpret_cast<uint32_t*>(wbase + Lay::kTileBytes);                    // [NSEG][32]
  uint16_t* s_cand = reinterpret_cast<uint16_t*>(wbase + Lay::kTileBytes + Lay::kSegBytes);  // [CAP][32]
  uint32_t* s_gk =
      reinterpret_cast<uint32_t*>(wbase + Lay::kTileBytes + Lay::kSegBytes + Lay::kCandBytes);  // [16][kMaxGroups]
  float* s_red = reinterpret_cast<float*>(tile_smem + kWarps * Lay::kWarpBytes);              // [kWarps][E]
  float* s_bias = s_red + kWarps * E;                                                         // [E]

  const int K = p.K, G = p.G;
  const bool want_prob = p.prob_sum != nullptr, want_scal = p.scalars != nullptr;
  const bool need_softmax = SF == kScoreSoftmax || want_scal || (SF == kScoreSoftmaxAfterTopk && want_prob);
  const bool grouped = G > 1;
  const bool has_bias = p.bias != nullptr;
  // Softmax keys rank the probability (plus bias) once groups or a bias need it; otherwise exp(x - max).
  const bool keys_need_inv = SF == kScoreSoftmax && (has_bias || grouped);
  const float* logits = static_cast<const float*>(p.logits);
  const int gpl = grouped ? G / 2 : 1;                            // groups per lane
  const int seg_shift = grouped ? __ffs(p.per / kSegment) - 1 : 30;  // segment -> own group
  const int e0 = h * NH;                                          // first expert of this lane

  stage_bias(s_bias, p, E);
  const bool merged = stats_merged(p, want_prob, want_scal);
  if (tid == 0) {
    s_blk_lse = 0.0f;
    s_blk_cnt = 0;
  }
  __syncthreads();

  for (int64_t c = blockIdx.x; c < p.nchunks; c += gridDim.x) {
    const ChunkSpan span = chunk_span(p, c);
    float acc[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) acc[i] = 0.0f;
    float w_lse = 0.0f;
    unsigned w_cnt = 0;

    for (int64_t tb = span.begin + warp * kTileTokens; tb < span.end; tb += kWarps * kTileTokens) {
      // Stage the tile's rows (rows past the chunk stay stale; their lanes are inactive).
      const int rows = static_cast<int>(min(static_cast<int64_t>(kTileTokens), span.end - tb));
      const float* src = logits + tb * E;
#pragma unroll
      for (int it = 0; it < kTileTokens * E / 4 / 32; ++it) {
        const int i = 32 * it + lane, r = i / (E / 4), q = i % (E / 4);
        if (r < rows) cp_async16(tile + r * RS + 4 * q + (q >= NQ ? 4 : 0), src + 4 * i);
      }
      cp_async_wait_all();
      __syncwarp();

      const int64_t t = tb + tok;
      const bool active = tok < rows;
      float* row = tile + tok * RS + h * (NH + 4);
      float4* row4 = reinterpret_cast<float4*>(row);
      const float4* bias4 = reinterpret_cast<const float4*>(s_bias + e0);

      // Pass 1: the row max (its key; 0: no eligible expert, or no token here).
      float m4[4] = {__uint_as_float(0x7fc00000u), __uint_as_float(0x7fc00000u), __uint_as_float(0x7fc00000u),
                     __uint_as_float(0x7fc00000u)};
#pragma unroll
      for (int j = 0; j < NQ; ++j) {
        const float4 v = row4[j];
        m4[0] = fmaxf(m4[0], v.x);
        m4[1] = fmaxf(m4[1], v.y);
        m4[2] = fmaxf(m4[2], v.z);
        m4[3] = fmaxf(m4[3], v.w);
      }
      const float lmx = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
      uint32_t mkey = active && !isnan(lmx) ? order_key2(lmx) : 0u;
      mkey = max(mkey, __shfl_xor_sync(kFull, mkey, 1));
      const bool valid = mkey != 0u;
      const float mx = valid ? key_to_float(mkey) : 0.0f;
      const bool sat = isinf(mx);
      const float ml = mx * kLog2e;

      // Pass 2: scores (stored over the logits except for softmax-after-top-k) and their sums; the
      // keys too where they do not need 1 / sum.
      float lsum = 0.0f, ssum = 0.0f;
      const bool any_sat = __any_sync(kFull, sat);
      uint32_t g1 = 0u, g2 = 0u, smax = 0u;
      float inv = 0.0f;
      auto key_of = [&](float x, float sc, float b) -> uint32_t {
        const float s = keys_need_inv ? __fmul_rn(sc, inv) : sc;
        return wide_key<SF>(x, s, b, valid);
      };
      // One key in scan order: the segment max, the group top-2, committed at segment / group ends.
      auto scan_key = [&](uint32_t k, int el) {
        smax = max(smax, k);
        if (grouped) top2(g1, g2, k);
        if ((el & (kSegment - 1)) == kSegment - 1) {
          const int sg = el / kSegment;
          s_seg[sg * 32 + lane] = smax;
          smax = 0u;
          if (grouped && ((sg + 1) & ((1 << seg_shift) - 1)) == 0) {
            s_gk[tok * kMaxGroups + h * gpl + (sg >> seg_shift)] = group_key(g1, g2);
            g1 = g2 = 0u;
          }
        }
      };
#pragma unroll
      for (int j = 0; j < NQ; ++j) {
        const float4 v = row4[j];
        const float x[4] = {v.x, v.y, v.z, v.w};
        float sc[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          float u = 0.0f;
          if (need_softmax) {
            u = any_sat ? shifted_exp(x[r], mx, ml, sat) : exp_shifted(x[r], ml);
            lsum += fmaxf(u, 0.0f);
          }
          if constexpr (SF == kScoreSigmoid) {
            sc[r] = sigmoid_fast(x[r]);
            ssum += fmaxf(sc[r], 0.0f);
          } else {
            sc[r] = SF == kScoreSoftmax ? u : x[r];
          }
        }
        if (SF != kScoreSoftmaxAfterTopk) row4[j] = make_float4(sc[0], sc[1], sc[2], sc[3]);
        if (!keys_need_inv) {
          const float4 b = has_bias ? bias4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
          const float bq[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
          for (int r = 0; r < 4; ++r) scan_key(key_of(x[r], sc[r], bq[r]), 4 * j + r);
        }
      }
      float lse = 0.0f, norm = 0.0f;  // norm: the statistics' factor (1 / sum of probabilities or scores)
      if (need_softmax) {
        lsum += __shfl_xor_sync(kFull, lsum, 1);
        inv = valid ? rcp_rn_normal(lsum) : 0.0f;  // lsum >= 1 for a valid row
        if (want_scal && valid) lse = sat ? mx : fmaf(lg2_approx(lsum), 1.0f / kLog2e, mx);
        norm = inv;
      }
      if constexpr (SF == kScoreSigmoid) {
        ssum += __shfl_xor_sync(kFull, ssum, 1);
        norm = valid && ssum > 0.0f ? 1.0f / ssum : 0.0f;
      }
      if (keys_need_inv) {  // softmax with a bias or groups: keys of the probabilities
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
          const float4 v = row4[j];
          const float4 b = has_bias ? bias4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
          scan_key(key_of(0.0f, v.x, b.x), 4 * j);
          scan_key(key_of(0.0f, v.y, b.y), 4 * j + 1);
          scan_key(key_of(0.0f, v.z, b.z), 4 * j + 2);
          scan_key(key_of(0.0f, v.w, b.w), 4 * j + 3);
        }
      }
      __syncwarp();

      // Groups: each lane ranks its own groups among the token's G (higher score, then lower group).
      uint32_t kept = 0xffffffffu;
      if (grouped) {
        kept = 0u;
        const uint32_t* gk = s_gk + tok * kMaxGroups;
        for (int gl = 0; gl < gpl; ++gl) {
          const int g = h * gpl + gl;
          const uint32_t own = gk[g];
          int rank = 0;
          for (int o = 0; o < G; ++o) {
            const uint32_t ok = gk[o];
            rank += ok > own || (ok == own && o < g) ? 1 : 0;
          }
          if (rank < p.group_topk) kept |= 1u << gl;
        }
      }
      auto seg_kept = [&](int sg) { return ((kept >> (sg >> seg_shift)) & 1u) != 0u; };

      // tau: the K-th largest kept segment max of the token (both lanes).
      uint32_t tl[KMAX];
#pragma unroll
      for (int i = 0; i < KMAX; ++i) tl[i] = 0u;
#pragma unroll
      for (int sg = 0; sg < NSEG; ++sg) insert_key<KMAX>(tl, seg_kept(sg) ? s_seg[sg * 32 + lane] : 0u);
#pragma unroll
      for (int i = 0; i < KMAX; ++i) {
        const uint32_t o = __shfl_xor_sync(kFull, tl[i], 1);
        insert_key<KMAX>(tl, o);
      }
      uint32_t tau = 0xffffffffu;  // tl[K - 1] as the min of the first K (an index would put tl in local memory)
#pragma unroll
      for (int i = 0; i < KMAX; ++i) tau = i < K ? min(tau, tl[i]) : tau;
      const uint32_t thr = max(tau, 1u);

      // The key of own element el, from the staged row (scores, or logits for softmax-after-top-k).
      auto elem_key = [&](int el) -> uint32_t {
        const float v = row[el];
        const float b = s_bias[e0 + el];
        return key_of(v, v, b);
      };

      // Pass 3: the candidates (key >= tau in a kept group), in ascending expert order.
      int cnt = 0;
#pragma unroll
      for (int j = 0; j < NQ; ++j) {
        const float4 v = row4[j];
        const float4 b = has_bias ? bias4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
        const float vq[4] = {v.x, v.y, v.z, v.w}, bq[4] = {b.x, b.y, b.z, b.w};
        const bool segk = seg_kept((4 * j) / kSegment);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const bool cand = segk && key_of(vq[r], vq[r], bq[r]) >= thr;
          if (cand && cnt < CAP) s_cand[cnt * 32 + lane] = static_cast<uint16_t>(4 * j + r);
          cnt += cand ? 1 : 0;
        }
      }

      // Statistics of this tile: lane l adds experts l, l + 32, ... of each valid token, in token order.
      const unsigned vmask = __ballot_sync(kFull, valid && h == 0);
      if (want_prob) {
        float txm = 0.0f, txl = 0.0f;
        bool tsat = false;
#pragma unroll
        for (int tt = 0; tt < kTileTokens; ++tt) {
          const float nt = __shfl_sync(kFull, norm, 2 * tt);
          if constexpr (SF == kScoreSoftmaxAfterTopk) {
            txm = __shfl_sync(kFull, mx, 2 * tt);
            txl = __shfl_sync(kFull, ml, 2 * tt);
            tsat = isinf(txm);
          }
          if ((vmask >> (2 * tt)) & 1u) {
            const float* trow = tile + tt * RS;
#pragma unroll
            for (int i = 0; i < NA; ++i) {
              const int e = lane + 32 * i;
              float v = trow[e + (32 * i >= NH ? 4 : 0)];
              if constexpr (SF == kScoreSoftmaxAfterTopk) v = shifted_exp(v, txm, txl, tsat);
              acc[i] = fmaf(fmaxf(v, 0.0f), nt, acc[i]);
            }
          }
        }
      }
      if (want_scal && valid && h == 0) {
        w_lse += lse * lse;
        ++w_cnt;
      }

      // Exact top-K of each half from its candidates (or a rescan when they overflowed), then lane
      // 2t merges lane 2t+1's list (higher experts: `>` keeps ties on the lower one).
      TopList<KMAX> top;
      top.clear();
      const int nc = min(cnt, CAP);
      for (int ci = 0; ci < nc; ++ci) {
        const int el = s_cand[ci * 32 + lane];
        top.insert(elem_key(el), e0 + el);
      }
      if (__any_sync(kFull, cnt > CAP)) {
        if (cnt > CAP) {
          top.clear();
          for (int el = 0; el < NH; ++el) {
            const uint32_t k = elem_key(el);
            if (seg_kept(el / kSegment) && k >= thr) top.insert(k, e0 + el);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < KMAX; ++i) {
        const uint32_t ok = __shfl_xor_sync(kFull, top.k[i], 1);
        const int oe = __shfl_xor_sync(kFull, top.e[i], 1);
        if (h == 0) top.insert(ok, oe);
      }

      // Weights from the staged scores (softmax-after-top-k: a softmax over the selected logits).
      if (active && h == 0) {
        const float* trow = tile + tok * RS;
        float q[KMAX];
        float m2 = -CUDART_INF_F;
#pragma unroll
        for (int i = 0; i < KMAX; ++i) {
          const bool used = valid && i < K && top.k[i] != 0u;
          q[i] = used ? trow[tile_pos<E>(top.e[i])] : 0.0f;
          if (SF == kScoreSoftmaxAfterTopk && used) m2 = fmaxf(m2, q[i]);
        }
        if constexpr (SF == kScoreSoftmaxAfterTopk) {
          const bool sat2 = isinf(m2);
          float s2 = 0.0f;
#pragma unroll
          for (int i = 0; i < KMAX; ++i) {
            const bool used = valid && i < K && top.k[i] != 0u;
            q[i] = used ? shifted_exp(q[i], m2, m2 * kLog2e, sat2) : 0.0f;
            s2 += q[i];
          }
#pragma unroll
          for (int i = 0; i < KMAX; ++i) q[i] = q[i] / s2;
        } else if constexpr (SF == kScoreSoftmax) {
#pragma unroll
          for (int i = 0; i < KMAX; ++i) q[i] *= inv;
        }
        float Q = 0.0f;
#pragma unroll
        for (int i = 0; i < KMAX; ++i) Q += i < K ? q[i] : 0.0f;
        const bool divide = p.normalize && Q > 0.0f;
#pragma unroll
        for (int i = 0; i < KMAX; ++i) {
          if (i >= K) break;
          const bool used = valid && top.k[i] != 0u;
          const float wgt = p.scale * (divide ? q[i] / Q : q[i]);
          store_slot(p, t * K + i, used ? top.e[i] : -1, used ? wgt : 0.0f);
        }
      }
      __syncwarp();  // the tile, segments and candidates are rewritten by the next tile
    }

    // This chunk's statistics: the warps' rows in warp order.
    if (want_prob) {
#pragma unroll
      for (int i = 0; i < NA; ++i) s_red[warp * E + lane + 32 * i] = acc[i];
    }
    if (want_scal) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        w_lse += __shfl_xor_sync(kFull, w_lse, o);
        w_cnt += __shfl_xor_sync(kFull, w_cnt, o);
      }
      if (lane == 0) {
        s_wlse[warp] = w_lse;
        s_wcnt[warp] = w_cnt;
      }
    }
    __syncthreads();
    commit_chunk_stats<kWarps>(p, span.s, span.jc, s_red, E, s_wlse, s_wcnt, s_blk_lse, s_blk_cnt, s_flag, s_n,
                               want_prob, want_scal, merged);
    __syncthreads();
  }
  finish_block_scalars(p, s_red, s_n, s_blk_lse, s_blk_cnt, s_flag, want_scal && !merged);
}

}  // namespace epx::cuda::router_kernels
