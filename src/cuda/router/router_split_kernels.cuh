// route_forward, the split kernel (EPX_ROUTER_KERNEL=split; fp32 logits, E in {128, 256, 512}, K <= 8,
// softmax scores without a bias or groups, sigmoid scores with or without a bias, without groups or with
// groups of 32 or 64 experts). A token is split over Q = E / 64 consecutive lanes, lane q of a token
// holding experts [64 q, 64 q + 64): a warp routes 32 / Q tokens at once, and almost all of a token's
// work is each lane's own arithmetic over its 64 experts instead of warp-wide reductions:
//  - a warp's tile (32 / Q rows, 8 KB) is copied to shared memory with cp.async, each lane's 64 logits
//    as 16 quads XOR-swizzled by the lane (so 8 lanes reading quad j of their own slices hit 8
//    different bank groups), in four quarters that each start two blocks of 8 experts as they land
//    (an SM requests all its tiles at once: whole tiles landed together, at the end); the exponentials
//    and scores are the lean kernel's (router_lean_kernels.cuh): no max subtraction, the fast path while
//    S = sum exp(x) lies in [2^-30, 2^126]. Composite keys: a truncated key of the ranked value above
//    the rank bits (255 - e, 8 bits; 9 at E = 512) -- for softmax the top bits of u = exp(x) (lean's
//    keys), for sigmoid a fixed point over the selection values' range (see kFixedKey);
//  - top-k by sorting networks on the lane's registers (router_topk_network.cuh): blocks of 8 keys are
//    sorted and merged into a running top-8 that also keeps the largest key it let go (the 9th, which
//    says whether the 8th pick is certain); then the token's lanes merge their lists with xor
//    shuffles. No branch depends on the data, so the warp never diverges on the fast path;
//  - groups (32 or 64 experts: whole groups per lane): each group keeps a top-8 of its own and the top-2
//    of its selection values (the group score, as the reference sums them); the lanes exchange the
//    G group scores' keys, rank them (the lower group first among equal keys, as the reference's stable
//    sort) and drop the lists of the groups outside the best group_topk before merging;
//  - the scores the weights and statistics need (u = exp(x) for softmax, the sigmoid score) are written
//    back over the tile's logits, so the slot lanes read their picks' values and the statistics are a
//    column pass over the tile (lane c adds the quads of experts 4 (c + 32 h) .. + 3 of the tile's tokens,
//    in token order, scaled by each row's 1 / S, or 1 / sum of scores for sigmoid, to the warp's row of
//    the chunk).
// A tie of truncated keys between picks K - 1 and K, where pick K - 1 is the only pick with that key, is
// settled from the tile: the token's lanes scan their written-back values for the best candidate with the
// tied key by (full key, lower expert), which is pick K - 1. Rows the fast path cannot vouch for -- S out of
// range (NaN, infinities, extreme logits), a non-finite bias, a boundary tie that takes in more than one
// pick, fewer than K candidates -- get zeros in the column pass and go, whole, through the fast kernels'
// exact per-token code after their tile (lean's fallback). Ties of truncated keys inside the top K only
// order the slots: such rows sort their K picks again on the full keys. Which path a row takes depends on
// the row alone, so the outputs are deterministic run to run.
// Launch: 8 warps per block, one 8 KB tile per warp, 2 blocks per SM (<= 128 registers); one chunk of
// tokens per block.
#pragma once

#include <cstdint>

#include "cuda/router/router_lean_kernels.cuh"
#include "cuda/router/router_topk_network.cuh"

namespace epx::cuda::router_kernels {

constexpr int kSplitSpan = 64;               // experts per lane
constexpr int kSplitTile = 32 * kSplitSpan;  // floats of a warp's tile (8 KB)

template <int E>
struct SplitShape {
  static_assert(E == 128 || E == 256 || E == 512, "E must be 128, 256 or 512");
  static constexpr int Q = E / kSplitSpan;  // lanes per token
  static constexpr int TPT = 32 / Q;        // tokens per tile
  static constexpr int IBK = E <= 256 ? 8 : 9;
  static constexpr uint32_t IMK = (1u << IBK) - 1u;
};

// Two blocks an SM at every E: each holds 64 KB of tiles and ~12 KB of static arrays (16 KB of statistics
// rows at E = 512), so a third block would pass the SM's 228 KB (tried: the grid then ran in two waves).
constexpr int kSplitBlocksPerSm = 2;

// Dynamic shared memory of a block: each warp's tile.
constexpr int split_smem_bytes() { return kWarps * kSplitTile * static_cast<int>(sizeof(float)); }

// Where element i (0..63) of slice `owner` lives in a tile (or, with owner = q, in the swizzled bias).
__device__ __forceinline__ int split_slot(int owner, int i) {
  return owner * kSplitSpan + 4 * ((i >> 2) ^ (owner & 7)) + (i & 3);
}

// A 16-byte shared-memory load the compiler may not hoist out of the tile loop: the swizzled bias is the
// same for every tile, and hoisted it would hold up to 64 registers across the loop. (The spills this was
// written against came from interleaved blocks, see BPL below; plain loads change the code of six of
// the bias instantiations, which were not timed that way, so the volatile load stays.)
__device__ __forceinline__ float4 split_lds128(const float* p) {
  float4 v;
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a));
  return v;
}

// Puts a warp's tile in flight: nv of its 32 / Q rows, contiguous from src, as four cp.async groups, group c
// holding quads 4 c .. 4 c + 3 of every slice (slice o at split_slot(o, .)). Lane l copies quad 4 c + l % 4 of
// slices 8 r + l / 4 (r = 0..3); with x = (l / 4) % 8 that quad lands at 4 (c ^ (x / 4)) + (l % 4 ^ x % 4), i.e.
// c or c ^ 1 by lane, so the 16 copies are one global and two shared base addresses plus constant offsets (the
// generic split_slot arithmetic per copy cost ~200 instructions a tile).
template <int Q>
__device__ __forceinline__ void split_issue_tile(float* tile, const float* src, int lane, int nv) {
  constexpr int TPT = 32 / Q;
  const int slice = lane >> 2, l4 = lane & 3;
  const float* g = src + kSplitSpan * slice + 4 * l4;
  float* s = tile + kSplitSpan * slice + 4 * (l4 ^ (slice & 3));
  const int flip = 16 * ((slice >> 2) & 1);
  float* s_even = s + flip;  // quarters 0 and 2
  float* s_odd = s - flip;   // quarters 1 and 3
  if (nv == TPT) {  // two paths: predicated copies had their addresses recomputed one by one under the predicate
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int r = 0; r < 4; ++r)
        lean_copy16((c & 1 ? s_odd : s_even) + 8 * kSplitSpan * r + 16 * c, g + 8 * kSplitSpan * r + 16 * c);
      lean_commit();
    }
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int r = 0; r < 4; ++r)
        if ((8 * r + slice) / Q < nv)
          lean_copy16((c & 1 ? s_odd : s_even) + 8 * kSplitSpan * r + 16 * c, g + 8 * kSplitSpan * r + 16 * c);
      lean_commit();
    }
  }
}

// Element s (0..7, runtime) of a descending list in registers: the least of its first s + 1. (A chain
// of selects on i == s was turned into an indexed load from a local-memory copy of the list.)
__device__ __forceinline__ uint32_t split_pick(const uint32_t (&a)[8], int s) {
  uint32_t v = a[0];
#pragma unroll
  for (int i = 1; i < 8; ++i) v = min(v, i <= s ? a[i] : 0xffffffffu);
  return v;
}

// Requirements (the launcher checks): E == 64 Q, K <= 8, rows 16-byte aligned; softmax: no bias, no
// groups; sigmoid: GPT = 0 (no groups), 1 (groups of 64) or 2 (groups of 32) groups per lane;
// split_smem_bytes() of dynamic shared memory.
template <int E, int SF, bool kBias, int GPT>
__global__ void __launch_bounds__(kThreads, kSplitBlocksPerSm)
    route_forward_split_kernel(const __grid_constant__ FwdParams p) {
  using Sh = SplitShape<E>;
  constexpr int Q = Sh::Q, TPT = Sh::TPT, IBK = Sh::IBK;
  constexpr uint32_t IMK = Sh::IMK;
  constexpr int V = E / 32;   // experts per lane of the exact fallback (one token per warp)
  constexpr int CQ = E / 128;  // quads of column sums per lane
  constexpr int NL = GPT == 2 ? 2 : 1;  // running top-8 lists per lane
  static_assert(SF == kScoreSoftmax ? (!kBias && GPT == 0) : SF == kScoreSigmoid, "unsupported scores");
  static_assert(GPT >= 0 && GPT <= 2, "0, 1 or 2 groups per lane");
  // Full keys (the re-sort of tied picks) from the ranked values' own bits where they cannot be negative
  // (no bias), else their order keys.
  constexpr bool kPositive = !kBias;
  // Sigmoid selection values lie in [min b, 1 + max b] (0 and 1 without a bias): their truncated keys are
  // fixed point over that range (23 bits), which resolves scores near 1 ~2^6 times finer than a float's top
  // bits and makes ties of truncated keys (re-sorts, exact rows) that much rarer. Softmax ranks u = exp(x),
  // whose range is the float's.
  constexpr bool kFixedKey = SF == kScoreSigmoid;

  extern __shared__ __align__(16) float s_tiles[];  // [kWarps][kSplitTile]
  __shared__ __align__(16) float s_red[kWarps][E];
  __shared__ __align__(16) float s_bias[E];     // the exact fallback's layout
  __shared__ __align__(16) float s_bias_sw[E];  // slice q swizzled as split_slot(q, i)
  __shared__ float s_inv[kWarps][TPT];
  __shared__ float s_lse2[kWarps][TPT];
  __shared__ float s_wlse[kWarps];
  __shared__ unsigned s_wcnt[kWarps];
  __shared__ unsigned long long s_n[kThreads];
  __shared__ int s_lane_gf[32], s_lane_jb[32];  // the fallback's legacy group layout (unused: groups align)
  __shared__ float s_blk_lse;
  __shared__ unsigned long long s_blk_cnt;
  __shared__ int s_flag;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int q = lane & (Q - 1);  // this lane's slice of its token
  const int tt = lane / Q;       // its token in the tile
  const int lead = lane & ~(Q - 1);
  const int e0 = kSplitSpan * q;
  const int K = p.K;
  const bool want_prob = p.prob_sum != nullptr, want_scal = p.scalars != nullptr;
  const float* logits = static_cast<const float*>(p.logits);
  float* tile = s_tiles + warp * kSplitTile;
  float* red = &s_red[warp][0];
  ChunkSpan span = chunk_span(p, blockIdx.x);  // before the wait below: no global memory read yet
  auto tile_rows = [&](int k) {  // rows of the chunk's tile k (the chunk's last tile may be short)
    return static_cast<int>(min(static_cast<int64_t>(TPT), span.end - (span.begin + static_cast<int64_t>(k) * TPT)));
  };
  const bool has_first_tile = blockIdx.x < p.nchunks && span.begin + static_cast<int64_t>(warp) * TPT < span.end;
  auto zero_warp_stats = [&] {
#pragma unroll
    for (int h = 0; h < CQ; ++h) reinterpret_cast<float4*>(red)[lane + 32 * h] = make_float4(0.f, 0.f, 0.f, 0.f);
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
  // The warp's first tile goes in flight before anything else but the bias (at T = 16384 it is the warp's only
  // tile, and the kernel's time is mostly its arrival plus the work that follows it). The bias is requested
  // first: staged after the tiles' copies, its loads queued behind them and held up every warp at the barrier
  // below (DeepSeek-V3's route 1.1x slower).
  constexpr int kBiasPerThread = (E + kThreads - 1) / kThreads;
  float bias_raw[kBiasPerThread];
#pragma unroll
  for (int i = 0; i < kBiasPerThread; ++i) {
    const int e = tid + i * kThreads;
    bias_raw[i] = kBias && e < E ? __ldg(p.bias + e) : 0.0f;
  }
  if (has_first_tile) split_issue_tile<Q>(tile, logits + (span.begin + static_cast<int64_t>(warp) * TPT) * E, lane,
                                          tile_rows(warp));
#pragma unroll
  for (int i = 0; i < kBiasPerThread; ++i) {
    const int e = tid + i * kThreads;
    if (e < E) s_bias[e] = staged_bias(bias_raw[i]);
  }
  bool bias_ok = true;
  if constexpr (kBias) {
    __syncthreads();
    bool bias_finite = true;
    for (int e = tid; e < E; e += kThreads) {
      const float b = s_bias[e];
      bias_finite = bias_finite && isfinite(b);
      s_bias_sw[split_slot(e / kSplitSpan, e % kSplitSpan)] = b;
    }
    bias_ok = __syncthreads_and(bias_finite) != 0;  // NaN was staged as -inf
  } else {
    __syncthreads();  // the exact fallback reads the staged (zero) bias
  }
  const float* my_bias = s_bias_sw + e0;
  // The fixed-point map sel -> (sel - lo) * key_scale + 2^23 + 32, monotone in sel (sel >= lo): a float in
  // [2^23 + 32, 2^24 - 96], whose low 23 bits are the fixed point, rounded, and whose sign and exponent bits
  // leave the word when it is shifted left by IBK. That takes an add instead of a float-to-integer
  // conversion, which runs on the quarter-rate pipe beside each expert's exponential and reciprocal. Every
  // warp reduces the bias on its own (no barrier); a non-finite bias sends every row to the exact code anyway.
  constexpr float kKeyBase = 8388608.0f + 32.0f;
  float key_scale = 0.0f, key_lo = 0.0f;
  if constexpr (kFixedKey) {
    float lo = 0.0f, hi = 0.0f;
    if constexpr (kBias) {
      lo = CUDART_INF_F;
      hi = -CUDART_INF_F;
      for (int e = lane; e < E; e += 32) {
        lo = fminf(lo, s_bias[e]);
        hi = fmaxf(hi, s_bias[e]);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(kFull, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(kFull, hi, o));
      }
    }
    const float range = (hi + 1.0f) - lo;  // >= 1
    key_scale = bias_ok ? static_cast<float>((1u << 23) - 128u) / range : 0.0f;
    key_lo = lo;
  }
  const uint32_t rank_base = IMK - static_cast<uint32_t>(e0);
  // The composite key of element i (0..63) of this lane's slice: its truncated key above the rank bits. The
  // tile pass and the settling of a boundary tie (below) must compute it alike.
  auto composite_key = [&](float sel, int i) -> uint32_t {
    if constexpr (kFixedKey) {
      const float above_lo = kBias ? __fsub_rn(sel, key_lo) : sel;
      const uint32_t f = __float_as_uint(fmaf(above_lo, key_scale, kKeyBase));
      return (f << IBK) + (rank_base - static_cast<uint32_t>(i));
    } else {
      return (__float_as_uint(sel) | IMK) - static_cast<uint32_t>(e0 + i);
    }
  };

  for (int64_t c = blockIdx.x; c < p.nchunks; c += gridDim.x) {
    if (c != blockIdx.x) span = chunk_span(p, c);
    const int64_t s = span.s, jc = span.jc, t_begin = span.begin, t_end = span.end;
    const int ntiles = static_cast<int>((t_end - t_begin + TPT - 1) / TPT);
    float w_lse = 0.0f;
    unsigned w_cnt = 0;

    for (int k = warp; k < ntiles; k += kWarps) {  // warp-uniform
      const int64_t t_first = t_begin + static_cast<int64_t>(k) * TPT;
      const int nv = tile_rows(k);
      // Blocks 2 c and 2 c + 1 start as soon as quarter c has landed, while the later quarters (requested after
      // it) are still on their way. The chunk's first tile was put in flight before the prologue.
      if (c != blockIdx.x || k != warp) split_issue_tile<Q>(tile, logits + t_first * E, lane, nv);

      // This lane's 64 experts in blocks of 8: exponentials, scores, sums, keys, running top-8 lists,
      // the group top-2; the value the weights and statistics need goes back over the logit.
      const bool valid = tt < nv;
      float* mine = tile + lane * kSplitSpan;
      Top8<uint32_t> top[NL];
      float su[2] = {0.0f, 0.0f}, ss[2] = {0.0f, 0.0f};
      float g1[GPT > 0 ? GPT : 1], g2[GPT > 0 ? GPT : 1];
#pragma unroll
      for (int g = 0; g < (GPT > 0 ? GPT : 1); ++g) g1[g] = g2[g] = -CUDART_INF_F;
      // Block b of 8 experts into the keys k; g1 / g2 are the top-2 selection values of its group.
      auto score_block = [&](int b, uint32_t(&key)[8], float& t1, float& t2) {
        if (b % 2 == 0) {  // quarter b / 2 of every slice has landed (other lanes copied parts of this one)
          switch (b / 2) {
            case 0: lean_wait<3>(); break;
            case 1: lean_wait<2>(); break;
            case 2: lean_wait<1>(); break;
            default: lean_wait<0>(); break;
          }
          __syncwarp();
        }
        float x[8], bb[8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float4 v = *reinterpret_cast<const float4*>(mine + 4 * ((2 * b + h) ^ (lane & 7)));
          x[4 * h] = v.x, x[4 * h + 1] = v.y, x[4 * h + 2] = v.z, x[4 * h + 3] = v.w;
          if constexpr (kBias) {
            const float4 w = split_lds128(my_bias + 4 * ((2 * b + h) ^ (q & 7)));
            bb[4 * h] = w.x, bb[4 * h + 1] = w.y, bb[4 * h + 2] = w.z, bb[4 * h + 3] = w.w;
          }
        }
        float val[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float u = lean_exp(x[i]);
          float sel;
          if constexpr (SF == kScoreSigmoid) {
            const float sc = lean_sigmoid(u);
            su[i & 1] += u;
            ss[i & 1] += sc;
            sel = kBias ? __fadd_rn(sc, bb[i]) : sc;
            val[i] = sc;
          } else {
            su[i & 1] += u;
            sel = u;
            val[i] = u;
          }
          key[i] = composite_key(sel, 8 * b + i);
          if constexpr (GPT > 0) {
            t2 = fmaxf(t2, fminf(t1, sel));
            t1 = fmaxf(t1, sel);
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<float4*>(mine + 4 * ((2 * b + h) ^ (lane & 7))) =
              make_float4(val[4 * h], val[4 * h + 1], val[4 * h + 2], val[4 * h + 3]);
      };
      // One list per group of 32 (GPT = 2), else one for the lane's 64. The blocks after a list's first
      // stay a loop: unrolled, the compiler interleaved them and spilled the group kernels at 80 registers.
      constexpr int BPL = 8 / NL;  // blocks per list
      constexpr int kBlockUnroll = GPT == 0 ? 8 : 2;
#pragma unroll
      for (int li = 0; li < NL; ++li) {
        uint32_t key[8];
        score_block(BPL * li, key, g1[li], g2[li]);
        top8_init8(top[li], key);
#pragma unroll kBlockUnroll
        for (int b = BPL * li + 1; b < BPL * (li + 1); ++b) {
          score_block(b, key, g1[li], g2[li]);
          top8_add8(top[li], key);
        }
      }

      __syncwarp();  // the written-back values of the token's other lanes, read by the slot lanes below

      // The row's sums over its lanes (a butterfly: every lane of the token gets the same bits).
      float S = su[0] + su[1], SS = ss[0] + ss[1];
#pragma unroll
      for (int o = 1; o < Q; o <<= 1) {
        S += __shfl_xor_sync(kFull, S, o);
        if constexpr (SF == kScoreSigmoid) SS += __shfl_xor_sync(kFull, SS, o);
      }
      bool fast = valid && bias_ok && S >= kLeanSumMin && S <= kLeanSumMax;

      // Groups: ranked by their scores' full keys, the lower group first among equal ones (the reference's
      // stable order), so a group's rank is the number of groups before it and no boundary is left open.
      bool kept[GPT > 0 ? GPT : 1] = {true};
      if constexpr (GPT > 0) {
        uint32_t gk[GPT];
        int rank[GPT];
#pragma unroll
        for (int m = 0; m < GPT; ++m) {
          gk[m] = order_key2(__fadd_rn(g1[m], g2[m]));
          rank[m] = 0;
        }
#pragma unroll
        for (int r = 0; r < Q; ++r)
#pragma unroll
          for (int m2 = 0; m2 < GPT; ++m2) {
            const uint32_t o = __shfl_sync(kFull, gk[m2], lead + r);
#pragma unroll
            for (int m = 0; m < GPT; ++m) rank[m] += o > gk[m] || (o == gk[m] && GPT * r + m2 < GPT * q + m) ? 1 : 0;
          }
#pragma unroll
        for (int m = 0; m < GPT; ++m) {
          kept[m] = rank[m] < p.group_topk;
          top8_keep_if(top[NL == 2 ? m : 0], kept[m]);  // a dropped group's list: empty
        }
        if constexpr (NL == 2) top8_merge(top[0], top[1].a, top[1].a9);
      }

      // The token's lists merged over its lanes: every lane ends with the token's top 8 and 9th.
      Top8<uint32_t>& L = top[0];
#pragma unroll
      for (int o = 1; o < Q; o <<= 1) {
        uint32_t other[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) other[i] = __shfl_xor_sync(kFull, L.a[i], o);
        const uint32_t other9 = __shfl_xor_sync(kFull, L.a9, o);
        top8_merge(L, other, other9);
      }
      // Picks K - 1 and K with equal truncated keys: which one is in the top K hangs on the dropped bits.
      // Where pick K - 1 is the only pick with that truncated key, the K - 1 picks above it are certain and it
      // is the best of the row's candidates with that key by (full key, lower expert): the token's lanes find
      // it in their written-back values. With more tied picks the exact code decides. Equal truncated keys
      // inside the top K only order the slots.
      uint32_t last = 0xffffffffu, next = K == 8 ? L.a9 : 0u;  // picks K - 1 and K, by min / max (see split_pick)
      bool reorder = false;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t after = i < 7 ? L.a[i + 1] : L.a9;
        last = min(last, i < K ? L.a[i] : 0xffffffffu);
        next = max(next, i >= K ? L.a[i] : 0u);
        reorder = reorder || (i < K - 1 && (L.a[i] >> IBK) == (after >> IBK));
      }
      const uint32_t tied_key = last >> IBK;
      int tied_picks = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) tied_picks += i < K && (L.a[i] >> IBK) == tied_key ? 1 : 0;
      const bool boundary_tie = next != 0u && (next >> IBK) == tied_key;
      fast = fast && last != 0u && (!boundary_tie || tied_picks == 1);
      if (fast && boundary_tie) {  // rare, and the same for the token's lanes: only they take part
        const unsigned token_lanes = ((1u << Q) - 1u) << lead;
        uint64_t best = 0;  // (full key, ~expert) of the best candidate with the tied truncated key
#pragma unroll 1
        for (int j = 0; j < kSplitSpan / 4; ++j) {
          const float4 v4 = *reinterpret_cast<const float4*>(mine + 4 * (j ^ (lane & 7)));
          const float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int i = 4 * j + r;
            const float sel = kBias ? __fadd_rn(v[r], s_bias[e0 + i]) : v[r];
            const bool candidate = GPT == 2 && i >= kSplitSpan / 2 ? kept[GPT - 1] : kept[0];
            if (candidate && (composite_key(sel, i) >> IBK) == tied_key) {
              const uint32_t fk = kPositive ? __float_as_uint(sel) : order_key2(sel);
              best = max(best, (static_cast<uint64_t>(fk) << 32) | (0xffffffffu - static_cast<uint32_t>(e0 + i)));
            }
          }
        }
#pragma unroll
        for (int o = 1; o < Q; o <<= 1) best = max(best, __shfl_xor_sync(token_lanes, best, o));
        const uint32_t settled = (tied_key << IBK) | (IMK - (0xffffffffu - static_cast<uint32_t>(best)));
#pragma unroll
        for (int i = 0; i < 8; ++i) L.a[i] = i == K - 1 ? settled : L.a[i];
      }

      if (fast && reorder) {  // rare: the K picks by (full key, lower expert), from the written-back values
        uint64_t full[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const uint32_t id = IMK - (L.a[i] & IMK);
          const float v = tile[split_slot(tt * Q + static_cast<int>(id) / kSplitSpan, id % kSplitSpan)];
          const float sel = kBias ? __fadd_rn(v, s_bias[id]) : v;
          const uint32_t fk = kPositive ? __float_as_uint(sel) : order_key2(sel);
          full[i] = i < K ? (static_cast<uint64_t>(fk) << 32) | (0xffffffffu - id) : 0ull;
        }
        sort8_desc(full);
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // still descending (split_pick relies on it): 8 - i above the rank bits
          const uint32_t id = 0xffffffffu - static_cast<uint32_t>(full[i]);
          L.a[i] = i < K ? (static_cast<uint32_t>(8 - i) << IBK) | (IMK - id) : 0u;
        }
      }

      // Weights: lane q of the token writes slots q, q + Q, ...; the normalising sum over the K slots is
      // taken over the token's lanes.
      const float inv = rcp_rn_normal(S);
      constexpr int SPL = (8 + Q - 1) / Q;  // slots per lane
      float w[SPL];
      int ids[SPL];
      float wsum = 0.0f;
#pragma unroll
      for (int m = 0; m < SPL; ++m) {
        const int slot = q + Q * m;
        const bool used = slot < K;
        const int id = static_cast<int>(IMK - (split_pick(L.a, used ? slot : 0) & IMK));
        const float v = tile[split_slot(tt * Q + id / kSplitSpan, id % kSplitSpan)];
        w[m] = used ? (SF == kScoreSoftmax ? v * inv : v) : 0.0f;
        ids[m] = id;
        wsum += w[m];
      }
#pragma unroll
      for (int o = 1; o < Q; o <<= 1) wsum += __shfl_xor_sync(kFull, wsum, o);
      const bool divide = p.normalize && wsum > 0.0f;
      const float rw = divide ? rcp_approx(wsum) : 1.0f;
      if (fast) {
        const int64_t t = t_first + tt;
#pragma unroll
        for (int m = 0; m < SPL; ++m) {
          const int slot = q + Q * m;
          if (slot < K) store_slot(p, t * K + slot, ids[m], p.scale * (divide ? w[m] * rw : w[m]));
        }
      }

      // Statistics: a row the fast path does not take (or past the chunk) adds zeros to the column pass.
      if (!fast) {
#pragma unroll
        for (int j = 0; j < 16; ++j) reinterpret_cast<float4*>(mine)[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
      if (q == 0) {
        const float lse = lg2_approx(S) * kLn2;
        s_inv[warp][tt] = fast ? (SF == kScoreSigmoid ? rcp_rn_normal(SS) : inv) : 0.0f;
        s_lse2[warp][tt] = fast ? lse * lse : 0.0f;
      }
      const unsigned fast_lanes = __ballot_sync(kFull, q == 0 && fast);
      unsigned slow_lanes = __ballot_sync(kFull, q == 0 && valid && !fast);
      __syncwarp();
      if (want_prob) {  // into red, which no other lane writes until the exact rows below
        // Lane l adds the quads g = l + 32 h (experts 4 g .. 4 g + 3), 16 bytes a load: 8 lanes read 8
        // different quads of one slice, which the swizzle puts in 8 different bank groups.
        float4 acc[CQ];
        float4* red4 = reinterpret_cast<float4*>(red);
#pragma unroll
        for (int h = 0; h < CQ; ++h) acc[h] = red4[lane + 32 * h];
#pragma unroll
        for (int r = 0; r < TPT; ++r) {
          const float ir = s_inv[warp][r];
#pragma unroll
          for (int h = 0; h < CQ; ++h) {
            const int g = lane + 32 * h, o = r * Q + g / 16;
            const float4 v = *reinterpret_cast<const float4*>(tile + o * kSplitSpan + 4 * ((g & 15) ^ (o & 7)));
            acc[h] = make_float4(fmaf(v.x, ir, acc[h].x), fmaf(v.y, ir, acc[h].y), fmaf(v.z, ir, acc[h].z),
                                 fmaf(v.w, ir, acc[h].w));
          }
        }
#pragma unroll
        for (int h = 0; h < CQ; ++h) red4[lane + 32 * h] = acc[h];
        if (slow_lanes != 0u) __syncwarp();  // before the exact rows add to other lanes' columns
      }
      if (want_scal) {
#pragma unroll
        for (int r = 0; r < TPT; ++r) w_lse += s_lse2[warp][r];
        w_cnt += __popc(fast_lanes);
      }
      while (slow_lanes != 0u) {  // warp-uniform
        const int b = __ffs(slow_lanes) - 1;
        slow_lanes &= slow_lanes - 1;
        lean_exact_token<V, SF>(p, lane, warp, s_bias, s_lane_gf, s_lane_jb, t_first + b / Q, red, &s_wlse[warp],
                                &s_wcnt[warp]);
      }
      __syncwarp();  // every lane is done with the tile before the next copy overwrites it
    }

    // This chunk's statistics: the warps in order.
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
  finish_block_scalars(p, &s_red[0][0], s_n, s_blk_lse, s_blk_cnt, s_flag, want_scal);
}

}  // namespace epx::cuda::router_kernels
