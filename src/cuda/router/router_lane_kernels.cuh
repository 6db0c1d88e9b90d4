// route_forward, the lane kernel (EPX_ROUTER_KERNEL=lane; fp32 logits, E in {128, 256}, K <= 8,
// softmax or sigmoid scores, no groups). One token per lane instead of one per warp.
//
// Why: the warp-per-token kernels spend most of a token's instructions on cross-lane steps (a redux
// per pick, butterflies for the sums), each a few dozen cycles of latency, and Nsight Compute found
// the lean kernel latency-bound in that chain (0.48 instructions a cycle per scheduler). A token per
// lane has no cross-lane step at all: the lane walks its row in shared memory, keeps the K + 1 best
// selection keys in a sorted register list (2 (K + 1) - 1 integer min/max per element, independent
// of the data, so the whole warp stays converged) and sums its exponentials. Every instruction
// serves 32 tokens.
//
// Layout: a block holds kLaneTiles tiles of 32 rows (one row per token) in shared memory, padded by
// 16 bytes a row so that the lanes' 16-byte reads of their own rows do not collide on banks. Warps
// w and w + kLaneTiles share tile w: each lane takes half of its token's columns (column chunks h
// and h + 2 of four). Each warp copies its two chunks of the tile's rows with cp.async, coalesced
// (consecutive lanes on consecutive bytes of a row), one commit group a chunk, so it starts on its
// first chunk while the second is in flight. (One bulk copy per lane and chunk instead -- 512
// copies of 256 bytes a block -- took 25.8 us at softmax top-8, T = 16384, with DRAM 13% busy.) The
// second warp hands its keys and partial sums over through shared memory and the first merges
// them, checks the row, and writes the K slots. Statistics are a second, column-wise pass
// over the staged scores (each thread one expert, tokens in order), so they are deterministic run
// to run like every other kernel's.
//
// Numerics are the lean kernel's (router_lean_kernels.cuh): u = ex2.approx(x log2 e) without max
// subtraction while the row sum lies in [2^-30, 2^126], sigmoid u / (1 + u), keys of the score's
// bits (an order key with a bias) with the low byte replaced by 255 - e, and a row is handed to the
// exact per-token code (fast_route_token, through lean_exact_token) when its sum is out of range,
// the bias is not finite, or two consecutive picks among the K + 1 best agree on their truncated
// keys. With the whole row in one list there is no cache to run dry, so that is the only doubt.
// Selection and weights therefore agree with the lean kernel and the reference wherever the lean
// kernel's do; weights and statistics differ from lean's only in the order of their sums.
#pragma once

#include "cuda/router/router_lane.h"
#include "cuda/router/router_lean_kernels.cuh"

namespace epx::cuda::router_kernels {

constexpr int kLaneChunks = 4;  // column chunks of a row, an mbarrier each
static_assert(kThreads == 2 * 32 * kLaneTiles, "the lane kernel runs a warp pair per tile");

template <int E>
constexpr int lane_row_floats() {
  return E + 4;  // 16 bytes of padding: lane l's row starts 4 l banks on, so float4 reads do not collide
}
// Dynamic shared memory of a block: its tiles of staged rows.
template <int E>
constexpr int lane_smem_bytes() {
  return kLaneTiles * 32 * lane_row_floats<E>() * static_cast<int>(sizeof(float));
}

// Requirements (the launcher checks): E in {128, 256}, K <= 8, SF softmax or sigmoid, G == 1, rows
// 16-byte aligned, kBias == (a bias is given), chunks of whole rounds of kLaneRoundTokens tokens but
// the last of a sequence; lane_smem_bytes<E>() of dynamic shared memory.
template <int E, int SF, bool kBias>
__global__ void __launch_bounds__(kThreads, 1) route_forward_lane_kernel(const __grid_constant__ FwdParams p) {
  static_assert(E == 128 || E == 256, "E must be 128 or 256");
  static_assert(SF == kScoreSoftmax || SF == kScoreSigmoid, "softmax or sigmoid scores");
  constexpr int NS = kLaneSlots;
  constexpr int RS = lane_row_floats<E>();
  constexpr int CW = E / kLaneChunks;             // columns of a chunk
  constexpr int kRedRows = kThreads / E;          // threads per expert in the statistics pass
  constexpr int kTilesPerRed = kLaneTiles / kRedRows;
  // Softmax with a bias ranks p + b, so its keys wait for the row's sum; the others key as they go.
  constexpr bool kKeysAfterSum = SF == kScoreSoftmax && kBias;

  extern __shared__ __align__(16) float s_tiles[];  // [kLaneTiles][32][RS]: logits, then scores
  __shared__ __align__(16) float s_red[kRedRows][E];
  __shared__ __align__(16) float s_bias[E];
  __shared__ uint32_t s_keys[kLaneTiles][NS][32];  // the second warp's sorted keys, slot-major
  __shared__ float s_sum[kLaneTiles][2][32];       // each half's sum of u (softmax) or of sigmoids
  __shared__ float s_usum[kLaneTiles][2][32];      // sigmoid: each half's sum of u, for the range check
  __shared__ __align__(16) float s_fac[kLaneTiles][32];  // statistics factor of a token's scores (0: skip it)
  __shared__ uint32_t s_slow[kLaneTiles];          // tokens for the exact code
  __shared__ float s_wlse[kWarps];
  __shared__ unsigned s_wcnt[kWarps];
  __shared__ unsigned long long s_n[kThreads];
  __shared__ int s_lane_gf[32], s_lane_jb[32];  // the exact code's group layout (unused: no groups)
  __shared__ float s_blk_lse;
  __shared__ unsigned long long s_blk_cnt;
  __shared__ int s_flag;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tile = warp % kLaneTiles, half = warp / kLaneTiles;
  const int K = p.K;
  const bool want_prob = p.prob_sum != nullptr, want_scal = p.scalars != nullptr;
  const bool merged = stats_merged(p, want_prob, want_scal);
  const float* logits = static_cast<const float*>(p.logits);
  float* my_row = s_tiles + (tile * 32 + lane) * RS;

  if (tid == 0) {
    s_blk_lse = 0.0f;
    s_blk_cnt = 0;
  }

  // Each warp copies the two column chunks it reads (h and h + 2) of its tile's rows, 16 bytes a
  // lane with cp.async, consecutive lanes on consecutive bytes of a row; one commit group a chunk
  // (empty past the batch's end, so that the waits count the same in every round).
  auto issue = [&](int64_t base, int64_t end) {
    const int64_t tb = base + 32 * tile;
    const int rows = static_cast<int>(max(int64_t{0}, min(int64_t{32}, end - tb)));
    constexpr int kPieces = CW / 4;  // 16-byte pieces of a row's chunk
    float* tile_rows = s_tiles + tile * 32 * RS;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int q = half + 2 * k;
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        const int piece = i * 32 + lane, r = piece / kPieces, col = q * CW + 4 * (piece % kPieces);
        if (r < rows) lean_copy16(tile_rows + r * RS + col, logits + (tb + r) * E + col);
      }
      lean_commit();
    }
  };
  // The first round's rows go in flight before the bias is staged.
  if (blockIdx.x < p.nchunks) {
    const ChunkSpan first = chunk_span(p, blockIdx.x);
    issue(first.begin, first.end);
  }
  stage_bias(s_bias, p, E);  // thread e stages expert e, so it may check it without a barrier
  const bool bias_ok = __syncthreads_and(tid >= E || isfinite(s_bias[tid])) != 0;  // NaN was staged as -inf

  for (int64_t c = blockIdx.x; c < p.nchunks; c += gridDim.x) {
    const ChunkSpan span = chunk_span(p, c);
    for (int i = tid; i < kRedRows * E; i += kThreads) (&s_red[0][0])[i] = 0.0f;
    if (tid < kWarps) {
      s_wlse[tid] = 0.0f;
      s_wcnt[tid] = 0;
    }
    float acc = 0.0f;  // statistics: expert tid % E over this thread's tiles of the chunk
    float w_lse = 0.0f;
    unsigned w_cnt = 0;

    for (int64_t base = span.begin; base < span.end; base += kLaneRoundTokens) {
      if (c != blockIdx.x || base != span.begin) issue(base, span.end);
      const int64_t tb = base + 32 * tile;
      const int rows = static_cast<int>(max(int64_t{0}, min(int64_t{32}, span.end - tb)));
      const bool valid = lane < rows;
      const int64_t t = tb + lane;

      // Pass over this half's chunks: exponentials, the sums, the scores written back over the
      // logits (softmax: u, sigmoid: u / (1 + u)), and, unless they wait for the sum, the keys.
      // Two sorted lists, elements 0-1 and 2-3 of each quad, so that two insertion chains run side
      // by side (one chain left the warps waiting on their own results); merged before the hand-over.
      uint32_t keys[NS], keys2[NS];
#pragma unroll
      for (int r = 0; r < NS; ++r) keys[r] = keys2[r] = 0u;
      float sa = 0.0f, sb = 0.0f, ua = 0.0f, ub = 0.0f;
      if (rows > 0) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int q = half + 2 * k;
          if (k == 0)
            lean_wait<1>();  // this lane's pieces of chunk h have landed ...
          else
            lean_wait<0>();
          __syncwarp();  // ... and the other lanes'; they hold this lane's row
          float4* cp = reinterpret_cast<float4*>(my_row + q * CW);
#pragma unroll 4
          for (int j = 0; j < CW / 4; ++j) {
            const int e4 = q * CW + 4 * j;
            const float4 xv = cp[j];
            const float x[4] = {xv.x, xv.y, xv.z, xv.w};
            float b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if constexpr (kBias && !kKeysAfterSum) {
              const float4 bv = reinterpret_cast<const float4*>(s_bias)[e4 / 4];
              b[0] = bv.x, b[1] = bv.y, b[2] = bv.z, b[3] = bv.w;
            }
            // The ranks 255 - e of the four elements, one byte each.
            const uint32_t pack = 0xFCFDFEFFu - static_cast<uint32_t>(e4) * 0x01010101u;
            float v[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float u = lean_exp(x[i]);
              float sel;
              if constexpr (SF == kScoreSigmoid) {
                v[i] = lean_sigmoid(u);
                if (i & 1) ub += u, sb += v[i];
                else ua += u, sa += v[i];
                sel = kBias ? __fadd_rn(v[i], b[i]) : v[i];
              } else {
                v[i] = u;
                if (i & 1) sb += u;
                else sa += u;
                sel = u;  // p = u / S ranks as u does
              }
              if constexpr (!kKeysAfterSum) {
                const uint32_t kb = kBias ? order_key2(sel) : __float_as_uint(sel);
                uint32_t comp;
                asm("prmt.b32 %0, %1, %2, %3;" : "=r"(comp) : "r"(kb), "r"(pack), "r"(0x3214 + i));
                lean_insert<NS>(i < 2 ? keys : keys2, comp);
              }
            }
            cp[j] = make_float4(v[0], v[1], v[2], v[3]);
          }
        }
      }
      s_sum[tile][half][lane] = sa + sb;
      if constexpr (SF == kScoreSigmoid) s_usum[tile][half][lane] = ua + ub;
      if constexpr (kKeysAfterSum) {
        // Both halves need 1 / S before they can rank p + b.
        __syncthreads();
        const float S = s_sum[tile][0][lane] + s_sum[tile][1][lane];
        const float inv = rcp_rn_normal(S);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int q = half + 2 * k;
          const float4* cp = reinterpret_cast<const float4*>(my_row + q * CW);
#pragma unroll 4
          for (int j = 0; j < CW / 4; ++j) {
            const int e4 = q * CW + 4 * j;
            const float4 uv = cp[j];
            const float4 bv = reinterpret_cast<const float4*>(s_bias)[e4 / 4];
            const float u[4] = {uv.x, uv.y, uv.z, uv.w}, b[4] = {bv.x, bv.y, bv.z, bv.w};
            const uint32_t pack = 0xFCFDFEFFu - static_cast<uint32_t>(e4) * 0x01010101u;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              uint32_t comp;
              asm("prmt.b32 %0, %1, %2, %3;" : "=r"(comp) : "r"(order_key2(__fadd_rn(u[i] * inv, b[i]))), "r"(pack),
                  "r"(0x3214 + i));
              lean_insert<NS>(i < 2 ? keys : keys2, comp);
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < NS; ++r) lean_insert<NS>(keys, keys2[r]);
      if (half == 1) {
#pragma unroll
        for (int r = 0; r < NS; ++r) s_keys[tile][r][lane] = keys[r];
      }
      __syncthreads();

      // The first warp of the tile: merge, check, write the token's slots.
      if (half == 0) {
#pragma unroll
        for (int r = 0; r < NS; ++r) lean_insert<NS>(keys, s_keys[tile][r][lane]);
        const float S = s_sum[tile][0][lane] + s_sum[tile][1][lane];  // softmax: sum u; sigmoid: sum s
        const float U = SF == kScoreSigmoid ? s_usum[tile][0][lane] + s_usum[tile][1][lane] : S;
        bool slow = !(bias_ok && U >= kLeanSumMin && U <= kLeanSumMax);
        // Two consecutive picks (up to pick K, which only vouches for pick K - 1) that agree on the
        // truncated key could be in either order: the exact code decides.
#pragma unroll
        for (int r = 0; r + 1 < NS; ++r)
          if (r < K) slow = slow || (keys[r] != 0u && (keys[r] >> 8) == (keys[r + 1] >> 8));
        const float inv = rcp_rn_normal(S);  // normal on the fast path
        if (valid && !slow) {
          float q[NS - 1];
          float Q = 0.0f;
#pragma unroll
          for (int r = 0; r + 1 < NS; ++r) {
            const bool used = r < K && keys[r] != 0u;
            const int id = 255 - static_cast<int>(keys[r] & 255u);
            // Softmax u * (1 / S), sigmoid its score: the very values that selected the expert.
            q[r] = used ? (SF == kScoreSoftmax ? my_row[id] * inv : my_row[id]) : 0.0f;
            Q += q[r];
          }
          const bool divide = p.normalize && Q > 0.0f;
          const float rQ = divide ? rcp_approx(Q) : 1.0f;  // Q in (0, 8]
#pragma unroll
          for (int r = 0; r + 1 < NS; ++r) {
            if (r >= K) break;
            const bool used = keys[r] != 0u;
            const int id = used ? 255 - static_cast<int>(keys[r] & 255u) : -1;
            store_slot(p, t * K + r, id, used ? p.scale * (divide ? q[r] * rQ : q[r]) : 0.0f);
          }
          if (want_scal) {
            const float lse = lg2_approx(U) * kLn2;
            w_lse += lse * lse;
            ++w_cnt;
          }
        }
        // Softmax p = u / S; sigmoid's auxiliary probabilities s / sum s: both a score times 1 / S.
        s_fac[tile][lane] = valid && !slow ? inv : 0.0f;
        const uint32_t slow_mask = __ballot_sync(kFull, valid && slow);
        if (lane == 0) s_slow[tile] = slow_mask;
      }
      __syncthreads();

      // Statistics: thread tid adds expert tid % E over its tiles, four token streams (tt % 4) added
      // in a fixed order at the end, so that the adds do not wait on each other.
      if (want_prob) {
        const int e = tid % E, tile0 = (tid / E) * kTilesPerRed;
        float a4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
        for (int tl = tile0; tl < tile0 + kTilesPerRed; ++tl) {
          const float* col = s_tiles + tl * 32 * RS + e;
#pragma unroll
          for (int t4 = 0; t4 < 8; ++t4) {
            const float4 f4 = reinterpret_cast<const float4*>(&s_fac[tl][0])[t4];
            const float f[4] = {f4.x, f4.y, f4.z, f4.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float v = col[(4 * t4 + i) * RS];
              a4[i] = __fmaf_rn(f[i] != 0.0f ? v : 0.0f, f[i], a4[i]);  // a skipped row may hold inf or NaN
            }
          }
        }
        acc += (a4[0] + a4[1]) + (a4[2] + a4[3]);
      }
      // The round's doubtful rows through the exact code, by warp 0 in token order (their
      // statistics go straight to s_red's first row and to warp 0's leaves).
      if (warp == 0) {
        for (int tl = 0; tl < kLaneTiles; ++tl) {
          uint32_t m = s_slow[tl];
          while (m != 0u) {
            const int b = __ffs(static_cast<int>(m)) - 1;
            m &= m - 1u;
            lean_exact_token<E / 32, SF>(p, lane, warp, s_bias, s_lane_gf, s_lane_jb, base + 32 * tl + b,
                                         &s_red[0][0], &s_wlse[0], &s_wcnt[0]);
          }
        }
      }
      __syncthreads();  // the tiles are read before the next round's copies land
    }

    // This chunk's statistics: the column sums, and the token leaves folded into entry 0.
    if (want_prob) s_red[tid / E][tid % E] += acc;
    if (want_scal && half == 0) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        w_lse += __shfl_xor_sync(kFull, w_lse, off);
        w_cnt += __shfl_xor_sync(kFull, w_cnt, off);
      }
      if (lane == 0) {
        s_wlse[warp] += w_lse;
        s_wcnt[warp] += w_cnt;
      }
    }
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < kWarps; ++w) {
        s_wlse[0] += s_wlse[w];
        s_wcnt[0] += s_wcnt[w];
        s_wlse[w] = 0.0f;
        s_wcnt[w] = 0;
      }
    }
    commit_chunk_stats<kRedRows>(p, span.s, span.jc, &s_red[0][0], E, s_wlse, s_wcnt, s_blk_lse, s_blk_cnt, s_flag,
                                 s_n, want_prob, want_scal, merged);
    __syncthreads();  // s_red, s_wlse and s_flag are reused by the next chunk
  }
  lean_wait<0>();  // nothing is left in flight (the groups past the end were empty)
  finish_block_scalars(p, &s_red[0][0], s_n, s_blk_lse, s_blk_cnt, s_flag, want_scal && !merged);
}

}  // namespace epx::cuda::router_kernels
