// route_forward, the fast kernel (the default; EPX_ROUTER_KERNEL=fast1 forces one token per warp,
// EPX_ROUTER_KERNEL=legacy selects route_forward_kernel of router_legacy_kernels.cuh, whose notes on keys
// and the top-k apply here unchanged). Per token it computes exactly what the legacy kernel
// computes -- same expressions, same summation orders, same selection -- so topk_idx and
// topk_weights are the same bits; it issues far fewer instructions and waits less:
//  - two tokens per warp where the shape allows (E <= 256, K <= 15, groups on whole lanes): a
//    half-warp per token, each lane holding the experts of two legacy lanes; the legacy sums are
//    reproduced bit for bit (two partial sums per lane, the butterfly's first four steps on half
//    the lanes, then a + b), so the per-token arithmetic stays the same while every warp-wide step
//    (max, sums, the K + 1 selection rounds, the weights) serves two tokens;
//  - the row max is one redux.max over order keys (the lane's fmaxf, then its key) instead of a
//    5-step shuffle butterfly, and the same redux tells a fully masked row (key 0) apart;
//  - expf / sigmoid are evaluated for every element and the ineligible (NaN) ones selected away,
//    so the per-element code is straight-line (the legacy kernel branched around each exponential);
//  - the sigmoid's correctly rounded reciprocals take their fast path inline when the token's
//    range guarantees it (the same bits; __frcp_rn otherwise);
//  - the sigmoid "far from the max" test is one fminf per element and one compare per lane
//    (rounding is monotonic, so min(x) - max < -16 iff some x - max < -16);
//  - in sigmoid mode the two sums (of exp, for the logsumexp, and of the scores, for the
//    statistics) share one butterfly;
//  - grouped selection with groups aligned to lanes (E/G a multiple of V, a power-of-two number of
//    lanes per group: DeepSeek-V3's 8 groups of 32) merges each group's top-2 with an xor
//    butterfly and ranks the groups with G shuffles; other shapes take the legacy code (one token
//    per warp);
//  - 64-bit address arithmetic is hoisted out of the token loop; the bias is read with vector
//    loads from shared memory.
// Launch: 8 warps per block; 4 blocks per SM at 64 registers, 2 at 128 (two tokens per warp with
// 16 experts per lane, or 16 with one).
//
// Statistics, deterministically and without a reduction tree. A block sums its token streams'
// registers in order (warp, then half-warp) into one row per chunk; a chunk that is a whole
// sequence writes prob_sum itself. Otherwise the row is rounded to fixed point (2^-32 units while the
// sequence is shorter than 2^21 rows, int64) and added with integer atomics into acc[s], each word
// counting its arrivals in its top bits: integer addition is associative, so the order in which chunks
// arrive cannot change a bit, and the chunk whose add completes an expert's count converts that sum to
// fp32 and clears the word for the next launch (commit_chunk_stats). The result differs from the legacy
// tree's by the fixed-point rounding (below 2^-33 per chunk and expert) and the fp32 rounding order; it
// is bit-identical run to run. lse^2 and the token count go through per-block leaves that carry their
// own ready bit, summed in block order by the last block (finish_block_scalars).
#pragma once

#include "cuda/common/gpu_scope_access.cuh"
#include "cuda/router/router_device.cuh"

namespace epx::cuda::router_kernels {

// Registers: one token per warp fits 64 per thread (4 blocks of 8 warps per SM) up to V = 8;
// two tokens per warp hold twice the elements per lane and take 128 (2 blocks per SM).
template <int V, int TPW>
struct FastBounds {
  static constexpr int kMinBlocks = (TPW == 2 && V >= 8) || V >= 16 ? 2 : 4;
};

// __frcp_rn(d) for d in [2^-126, 2^126): the fast path of the correctly rounded reciprocal
// (MUFU.RCP, one Newton step), without the range test and the call of its slow path. IEEE's
// round-to-nearest reciprocal is unique, so the bits are __frcp_rn's; callers guarantee the range.
__device__ __forceinline__ float rcp_rn_normal(float d) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float e = __fmaf_rn(d, r, -1.0f);
  return __fmaf_rn(r, -e, r);
}

// The warp sum of the legacy kernel (one lane per V/TPW consecutive experts, sequential sums, then a
// butterfly over 32 lanes) reproduced bit for bit: with two tokens per warp a lane holds the
// partial sums a, b of two legacy lanes (2 hl and 2 hl + 1), the legacy steps xor 16, 8, 4, 2 are
// the half-warp steps xor 8, 4, 2, 1 on both, and xor 1 is a + b (float addition commutes).
template <int TPW>
__device__ __forceinline__ float token_sum(const TokenLanes<TPW>& tl, float a, float b) {
  if constexpr (TPW == 1) {
    (void)b;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(tl.mask, a, o);
    return a;
  } else {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
      const float x = __shfl_xor_sync(tl.mask, a, o), y = __shfl_xor_sync(tl.mask, b, o);
      a += x;
      b += y;
    }
    return a + b;
  }
}

// Two such sums at once (interleaved shuffles).
template <int TPW>
__device__ __forceinline__ void token_sum2(const TokenLanes<TPW>& tl, float& a0, float b0, float& a1, float b1) {
  if constexpr (TPW == 1) {
    (void)b0;
    (void)b1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float x = __shfl_xor_sync(tl.mask, a0, o), y = __shfl_xor_sync(tl.mask, a1, o);
      a0 += x;
      a1 += y;
    }
  } else {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
      const float x0 = __shfl_xor_sync(tl.mask, a0, o), y0 = __shfl_xor_sync(tl.mask, b0, o);
      const float x1 = __shfl_xor_sync(tl.mask, a1, o), y1 = __shfl_xor_sync(tl.mask, b1, o);
      a0 += x0;
      b0 += y0;
      a1 += x1;
      b1 += y1;
    }
    a0 = a0 + b0;
    a1 = a1 + b1;
  }
}

// Over the token's first 16 lanes (the K <= 16 slots), as half_max / half_sum.
template <int TPW>
__device__ __forceinline__ float slots_max(const TokenLanes<TPW>& tl, float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(tl.mask, v, o));
  return v;
}
template <int TPW>
__device__ __forceinline__ float slots_sum(const TokenLanes<TPW>& tl, float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(tl.mask, v, o);
  return v;
}

template <int V>
__device__ __forceinline__ void load_bias(float (&bias)[V], const float* s_bias, int e0) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int i = 0; i < V / 4; ++i) {
      const float4 b4 = reinterpret_cast<const float4*>(s_bias + e0)[i];
      bias[4 * i] = b4.x;
      bias[4 * i + 1] = b4.y;
      bias[4 * i + 2] = b4.z;
      bias[4 * i + 3] = b4.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) bias[j] = s_bias[e0 + j];
  }
}

// Statistics leave a block in words that carry their own arrival, so that the last block's tail is two
// L2 round trips for prob_sum (its replica, then its sequence) and two for the scalars, with no fence:
//  - prob_sum (several chunks a sequence): an accumulator word counts arrivals in its top bits (from
//    kAccCountShift) and holds a fixed-point sum below them; an atomic add of (1 << kAccCountShift) + a value
//    returns the old word, so the add that completes the count has the whole sum. Chunk j of sequence s adds
//    its value for expert e to replica j % rep of (s, e) (rep <= 8 replicas spread the chunks' atomics over
//    more L2 lines); the add that completes a replica clears it for the next launch and adds the replica's sum
//    to the sequence's word, and the add that completes that one writes prob_sum[s][e] and clears it. Integer
//    addition is associative, so the order in which chunks arrive cannot change a bit.
//  - lse^2 and the token count: each block stores its leaf, kLeafReady | count << 32 | the bits of its lse^2
//    sum, then takes a ticket; the last block waits for every leaf's ready bit (stored before its block's
//    ticket, so at most a round trip behind), sums them in block order and clears them.
constexpr int kAccReplicas = 8;
constexpr int kAccCountShift = 54;  // bps <= kMaxChunks < 2^10 arrivals; the sum below 2^53 (fixed_scale)
constexpr unsigned long long kAccArrival = 1ull << kAccCountShift;
constexpr unsigned long long kAccValueMask = kAccArrival - 1ull;
constexpr unsigned long long kLeafReady = 1ull << 63;
constexpr long long kLeafWaitCycles = 1ll << 32;  // ~2 s: a leaf is never expected to take more than microseconds
static_assert(kMaxChunks < (1 << (64 - kAccCountShift)), "the arrival count must fit above the sum");

// Block b's leaf once it is ready; after kLeafWaitCycles the status records the timeout and the leaf counts
// as empty (the stream goes on).
__device__ __forceinline__ unsigned long long await_leaf(const FwdParams& p, unsigned b) {
  unsigned long long v = load_relaxed_gpu(p.leaves + b);
  if (v & kLeafReady) return v;
  const long long start = clock64();
  while (!((v = load_relaxed_gpu(p.leaves + b)) & kLeafReady))
    if (clock64() - start > kLeafWaitCycles) {
      atomicOr(p.status, kStatusStatsTimeout);
      return 0ull;
    }
  return v;
}

// lse^2 and the token count of the leaves this thread reads, b = tid and tid + kThreads (then cleared).
struct ScalarLeaves {
  float lse = 0.0f;
  unsigned long long cnt = 0;
};
__device__ __forceinline__ ScalarLeaves take_scalar_leaves(const FwdParams& p) {
  static_assert(kMaxChunks <= 2 * kThreads, "two leaves per thread");
  ScalarLeaves v;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const unsigned b = threadIdx.x + i * kThreads;
    if (b >= gridDim.x) continue;
    const unsigned long long w = await_leaf(p, b);
    v.lse += __uint_as_float(static_cast<unsigned>(w));
    v.cnt += (w & ~kLeafReady) >> 32;
    __stcg(p.leaves + b, 0ull);
  }
  return v;
}
// ... and their sum over the block: a butterfly per warp, then the warps in order (s_f, s_n: one
// entry per warp). Block-uniform.
__device__ __forceinline__ void finish_scalars(const FwdParams& p, ScalarLeaves v, float* s_f,
                                               unsigned long long* s_n) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    v.lse += __shfl_xor_sync(kFull, v.lse, off);
    v.cnt += __shfl_xor_sync(kFull, v.cnt, off);
  }
  if (lane == 0) {
    s_f[warp] = v.lse;
    s_n[warp] = v.cnt;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float f = 0.0f;
    unsigned long long n = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      f += s_f[w];
      n += s_n[w];
    }
    p.scalars[0] = f;
    p.scalars[1] = static_cast<float>(n);
  }
}

// The tail of a chunk, shared by the fast kernels: the block's token streams wrote their rows of
// prob sums (red[row * stride + e], rows in token-stream order) and their lse^2 / token-count leaves
// (wlse, wcnt) and synchronised. Adds the rows in row order and either writes prob_sum (a chunk that
// is a whole sequence) or adds the fixed-point row to the chunk's replica of the sequence's counted
// accumulators (above); the scalars go to the block's blk_lse / blk_cnt. Chunk jc of sequence s.
// Block-uniform; the caller synchronises before red is reused.
template <int kRows>
__device__ __forceinline__ void commit_chunk_stats(const FwdParams& p, int64_t s, int64_t jc, const float* red,
                                                   int stride, const float* wlse, const unsigned* wcnt, float& blk_lse,
                                                   unsigned long long& blk_cnt, bool want_prob, bool want_scal) {
  const int tid = threadIdx.x, E = p.E;
  if (want_scal && tid == 0) {
#pragma unroll
    for (int w = 0; w < kRows; ++w) {
      blk_lse += wlse[w];
      blk_cnt += wcnt[w];
    }
  }
  if (!want_prob) return;
  const int rep = p.rep, r = static_cast<int>(jc % rep);
  unsigned long long* rep_row = p.acc + (s * rep + r) * kMaxExperts;
  unsigned long long* seq_row = p.acc + (p.nchunks / p.bps * rep + s) * kMaxExperts;
  // The arrivals before the last one: at replica r, the sequence's chunks j = r (mod rep); at the sequence's word,
  // its replicas.
  const unsigned long long rep_last = static_cast<unsigned long long>((p.bps - 1 - r) / rep) << kAccCountShift;
  const unsigned long long seq_last = static_cast<unsigned long long>(rep - 1) << kAccCountShift;
  for (int e = tid; e < E; e += kThreads) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kRows; ++w) v += red[w * stride + e];
    if (p.bps == 1) {
      p.prob_sum[s * E + e] = v;
      continue;
    }
    const unsigned long long add = kAccArrival + static_cast<unsigned long long>(__float2ll_rn(v * p.fixed_scale));
    const unsigned long long old = atomicAdd(rep_row + e, add);
    if ((old & ~kAccValueMask) != rep_last) continue;
    __stcg(rep_row + e, 0ull);  // this chunk completed replica r
    const unsigned long long part = kAccArrival + ((old + add) & kAccValueMask);
    const unsigned long long old_seq = atomicAdd(seq_row + e, part);
    if ((old_seq & ~kAccValueMask) != seq_last) continue;
    __stcg(seq_row + e, 0ull);  // ... and the sequence
    p.prob_sum[s * E + e] = __ll2float_rn(static_cast<long long>((old_seq + part) & kAccValueMask)) * p.fixed_inv;
  }
}

// After the block's last chunk: its scalar leaf (the count fits the 31 bits between the ready bit and the lse^2
// bits: a block sees far fewer than 2^31 rows), its ticket, and for the last block every block's leaf summed
// (red: >= kWarps floats of scratch). Block-uniform.
__device__ __forceinline__ void finish_block_scalars(const FwdParams& p, float* red, unsigned long long* s_n,
                                                     float blk_lse, unsigned long long blk_cnt, int& flag, bool wanted) {
  if (!wanted) return;
  if (threadIdx.x == 0) {
    store_relaxed_gpu(p.leaves + blockIdx.x, kLeafReady | (blk_cnt << 32) | __float_as_uint(blk_lse));
    const unsigned ticket = atomicAdd(p.scal_ticket, 1u);  // no fence: the leaves carry their ready bit
    flag = ticket == gridDim.x - 1u;
    if (flag) *p.scal_ticket = 0u;
  }
  __syncthreads();
  if (flag) finish_scalars(p, take_scalar_leaves(p), red, s_n);
}

// The per-token work of the fast kernels: route one token held in x (this lane's experts e0 .. e0 + V
// of row t), write its K slots and add its statistics to acc / w_lse / w_cnt. Also the exact fallback
// of the lean kernel (router_lean_kernels.cuh), which calls it with TPW = 1 for the rows its fast path
// does not take.
template <int TPW>
struct FastTokenSetup {
  TokenLanes<TPW> tl;
  int lane, e0, my_group, lpg, ncover;
  bool grouped, aligned, any_straddle, want_prob, want_scal, need_softmax;
  const float* s_bias;     // [EP] the expert bias (zeros without one)
  const int* s_lane_gf;    // the legacy group layout (grouped, not aligned, TPW = 1)
  const int* s_lane_jb;
};

template <int V, class LT, int SF, int TPW>
__device__ __forceinline__ void fast_route_token(const FwdParams& p, const FastTokenSetup<TPW>& ts, const LT* row,
                                                 int64_t t, const float (&x)[V], float (&acc)[V], float& w_lse,
                                                 unsigned& w_cnt) {
  constexpr int LPT = 32 / TPW;
  constexpr int EP = LPT * V;
  constexpr int IB = EP == 32 ? 5 : EP == 64 ? 6 : EP == 128 ? 7 : EP == 256 ? 8 : 9;
  constexpr uint32_t IM = (1u << IB) - 1u;
  constexpr int VH = TPW == 1 ? V : V / 2;
  const TokenLanes<TPW>& tl = ts.tl;
  const int lane = ts.lane, hl = tl.hl, e0 = ts.e0;
  const int K = p.K, G = p.G, per = p.per;
  const bool grouped = ts.grouped, aligned = ts.aligned, any_straddle = ts.any_straddle;
  const bool want_prob = ts.want_prob, want_scal = ts.want_scal, need_softmax = ts.need_softmax;
  const int lpg = ts.lpg, my_group = ts.my_group, ncover = ts.ncover;
  const float* s_bias = ts.s_bias;
  const int* s_lane_gf = ts.s_lane_gf;
  const int* s_lane_jb = ts.s_lane_jb;

  // The lane's max over eligible logits: fmaxf ignores NaN, and stays NaN only when every
  // element of the lane is NaN. One redux gives the row max as an order key, 0 when no lane
  // of the token has an eligible expert.
  float lmx = __uint_as_float(0x7fc00000u);
#pragma unroll
  for (int j = 0; j < V; ++j) lmx = fmaxf(lmx, x[j]);
  const uint32_t mkey = tl.max(isnan(lmx) ? 0u : order_key2(lmx));
  const int64_t o = t * K + hl;
  if (mkey == 0u) {
    if (hl < K) store_slot(p, o, -1, 0.0f);
  } else {
    const float mx = key_to_float(mkey);

    // pr: softmax probabilities (sigmoid mode: exp(x - max)), NaN exactly where the logit is
    // NaN (ineligible); sums and statistics add fmaxf(v, 0), which is v for the others.
    float pr[V];
    float inv = 0.0f, pv = 0.0f, lse = 0.0f;
    float suma = 0.0f, sumb = 0.0f;
    bool sat = false;
    if (need_softmax) {
      if (isinf(mx)) {  // uniform over the token
        unsigned cnt = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) cnt += x[j] == mx ? 1u : 0u;
        const unsigned top = tl.add(cnt);
        pv = 1.0f / static_cast<float>(top);
#pragma unroll
        for (int j = 0; j < V; ++j) pr[j] = isnan(x[j]) ? x[j] : (x[j] == mx ? pv : 0.0f);
        lse = mx;
        sat = true;
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) {
          pr[j] = expf(__fsub_rn(x[j], mx));  // finite max: NaN iff x is NaN
          if (j < VH)
            suma += fmaxf(pr[j], 0.0f);
          else
            sumb += fmaxf(pr[j], 0.0f);
        }
        if constexpr (SF != kScoreSigmoid) {
          const float sum = token_sum(tl, suma, sumb);
          inv = 1.0f / sum;
#pragma unroll
          for (int j = 0; j < V; ++j) pr[j] = __fmul_rn(pr[j], inv);
          if (want_scal) lse = mx + logf(sum);
        }
      }
    }

    float sg[V];
    float ssum = 0.0f, e_neg_max = 0.0f;
    bool sig_direct = true;
    if constexpr (SF == kScoreSigmoid) {
      float lmn = __uint_as_float(0x7fc00000u);  // the lane's min over eligible logits
#pragma unroll
      for (int j = 0; j < V; ++j) lmn = fminf(lmn, x[j]);
      if (need_softmax && !sat) {
        // Rounding is monotonic: min(x) - max < -16 iff some x - max < -16 (NaN never is).
        sig_direct = tl.any(__fsub_rn(lmn, mx) < -16.0f);
        if (!sig_direct) e_neg_max = expf(-mx);
      }
      // The reciprocals' fast path where the denominators are in range for the whole token:
      // 1 + exp(-x) < 2^126 when x > -80; u + exp(-max) is in [e^-16, 2^126) when max > -80.
      // Otherwise the same expressions with __frcp_rn. NaN in, NaN out either way.
      float ssa = 0.0f, ssb = 0.0f;
      if (sig_direct) {
        if (!tl.any(lmn <= -80.0f)) {
#pragma unroll
          for (int j = 0; j < V; ++j) sg[j] = rcp_rn_normal(__fadd_rn(1.0f, expf(-x[j])));
        } else {
#pragma unroll
          for (int j = 0; j < V; ++j) sg[j] = sigmoid_score(x[j]);
        }
      } else if (mx > -80.0f) {
#pragma unroll
        for (int j = 0; j < V; ++j) sg[j] = __fmul_rn(pr[j], rcp_rn_normal(__fadd_rn(pr[j], e_neg_max)));
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) sg[j] = sigmoid_shared(pr[j], e_neg_max);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (j < VH)
          ssa += fmaxf(sg[j], 0.0f);
        else
          ssb += fmaxf(sg[j], 0.0f);
      }
      // The logsumexp's sum and the scores' sum share one butterfly.
      if (need_softmax && !sat) {
        if (want_prob) {
          token_sum2(tl, suma, sumb, ssa, ssb);
          ssum = ssa;
        } else {
          suma = token_sum(tl, suma, sumb);
        }
        if (want_scal) lse = mx + logf(suma);
      } else if (want_prob) {
        ssum = token_sum(tl, ssa, ssb);
      }
    }

    if (want_prob) {
      if constexpr (SF == kScoreSigmoid) {
        const float is = ssum > 0.0f ? 1.0f / ssum : 0.0f;
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += fmaxf(sg[j], 0.0f) * is;
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += fmaxf(pr[j], 0.0f);
      }
    }
    if (want_scal) {
      w_lse += lse * lse;
      ++w_cnt;
    }

    // Exact selection keys (0 = ineligible). Scores are finite where eligible and the bias is
    // never NaN, so the sum is NaN exactly for the ineligible ones.
    uint32_t ek[V];
    {
      float bias[V];
      load_bias<V>(bias, s_bias, e0);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if constexpr (SF == kScoreSoftmax) {
          const float sel = __fadd_rn(pr[j], bias[j]);
          ek[j] = isnan(sel) ? 0u : order_key2(sel);
        } else if constexpr (SF == kScoreSigmoid) {
          const float sel = __fadd_rn(sg[j], bias[j]);
          ek[j] = isnan(sel) ? 0u : order_key2(sel);
        } else {
          float sel = __fadd_rn(__fadd_rn(x[j], bias[j]), 0.0f);  // -0 -> +0
          if (isnan(sel)) sel = -CUDART_INF_F;                      // inf + -inf
          ek[j] = isnan(x[j]) ? 0u : order_key2(sel);
        }
      }
    }

    if (grouped) {
      if (TPW == 2 || aligned) {
        // The group's top-2 keys: each lane's, then an xor butterfly over the group's lanes
        // (the top-2 of a multiset does not depend on the merge order).
        uint32_t g1 = 0, g2 = 0;
#pragma unroll
        for (int j = 0; j < V; ++j) top2(g1, g2, ek[j]);
        for (int off = 1; off < lpg; off <<= 1) {
          const uint32_t b1 = __shfl_xor_sync(tl.mask, g1, off), b2 = __shfl_xor_sync(tl.mask, g2, off);
          merge2(g1, g2, b1, b2);
        }
        const uint32_t gk = group_key(g1, g2);
        int rank = 0;
#pragma unroll
        for (int gi = 0; gi < kMaxGroups; ++gi) {
          if (gi >= G) break;
          const uint32_t other = __shfl_sync(tl.mask, gk, tl.base + gi * lpg);
          rank += (other > gk || (other == gk && gi < my_group)) ? 1 : 0;
        }
        const bool kept = my_group < G && rank < p.group_topk;
#pragma unroll
        for (int j = 0; j < V; ++j) ek[j] = kept ? ek[j] : 0u;
      } else if constexpr (TPW == 1) {
        legacy_group_mask<V>(ek, p, lane, s_lane_gf[lane], s_lane_jb[lane], any_straddle, ncover);
      }
    }

    // Fast top-k on composite keys, exact fallback (route_forward_kernel's file note). A pick
    // <= IM (no candidate left anywhere) may shift a lane's cache: later picks are <= IM too,
    // and those only ever give -1.
    uint32_t c1 = 0, c2 = 0, c3 = 0;
    const uint32_t cbase = IM - static_cast<uint32_t>(e0);
#pragma unroll
    for (int j = 0; j < V; ++j) top3(c1, c2, c3, (ek[j] & ~IM) | (cbase - static_cast<uint32_t>(j)));
    const bool more = c3 > IM;
    uint32_t slot = 0;
#pragma unroll
    for (int r = 0; r <= kMaxTopk; ++r) {
      if (r > K) break;
      const uint32_t m = tl.max(c1);
      if (hl == r) slot = m;
      const bool won = c1 == m;
      c1 = won ? c2 : c1;
      c2 = won ? c3 : c2;
      c3 = won ? 0u : c3;
    }
    const uint32_t after = __shfl_down_sync(tl.mask, slot, 1, LPT);  // the token's last lane keeps its own
    const bool collide = hl < K && after > IM && (slot >> IB) == (after >> IB);
    const bool exhausted = more && c1 == 0u;
    int id;
    if (!tl.any(collide || exhausted))
      id = slot > IM ? static_cast<int>(IM - (slot & IM)) : -1;
    else
      id = exact_topk<V, TPW>(tl, ek, K);

    // Weights from the selected logits, recomputed by the slot lanes.
    const bool used = hl < K && id >= 0;
    const float xs = used ? load_elem(row, id) : 0.0f;
    float q = 0.0f;
    if constexpr (SF == kScoreSoftmax) {
      if (used) q = softmax_prob(xs, mx, inv, sat, pv);
    } else if constexpr (SF == kScoreSigmoid) {
      if (used) q = sig_direct ? sigmoid_score(xs) : sigmoid_shared(expf(__fsub_rn(xs, mx)), e_neg_max);
    } else {
      const float m2 = __shfl_sync(tl.mask, slots_max(tl, used ? xs : -CUDART_INF_F), tl.base);
      if (tl.any(used)) {
        if (isinf(m2)) {
          const bool hit = used && xs == m2;
          const int top = __popc(tl.ballot(hit) & 0xffffu);
          q = hit ? 1.0f / static_cast<float>(top) : 0.0f;
        } else {
          const float ex = used ? expf(__fsub_rn(xs, m2)) : 0.0f;
          const float s2 = slots_sum(tl, ex);
          q = hl < 16 ? ex / s2 : 0.0f;
        }
      }
    }
    const float Q = slots_sum(tl, q);
    const bool divide = p.normalize && Q > 0.0f;
    const float wgt = p.scale * (divide ? q / Q : q);
    if (hl < K) store_slot(p, o, used ? id : -1, used ? wgt : 0.0f);
  }
}

// The per-kernel part of FastTokenSetup. Groups: aligned, group g is the token's lanes
// [g * lpg, (g + 1) * lpg); otherwise (one token per warp only) the legacy layout: lane l's elements
// j < jb[l] belong to group gf[l], the others to gf[l] + 1 (warp 0 writes s_lane_gf / s_lane_jb, so
// the block synchronises before the first token). Warp-collective.
template <int V, int SF, int TPW>
__device__ __forceinline__ FastTokenSetup<TPW> fast_token_setup(const FwdParams& p, int lane, int warp,
                                                                const float* s_bias, int* s_lane_gf, int* s_lane_jb) {
  FastTokenSetup<TPW> ts{TokenLanes<TPW>(lane)};
  const int G = p.G, per = p.per;
  ts.lane = lane;
  ts.e0 = ts.tl.hl * V;
  ts.want_prob = p.prob_sum != nullptr;
  ts.want_scal = p.scalars != nullptr;
  ts.need_softmax = SF == kScoreSoftmax || ts.want_scal || (SF == kScoreSoftmaxAfterTopk && ts.want_prob);
  ts.s_bias = s_bias;
  ts.s_lane_gf = s_lane_gf;
  ts.s_lane_jb = s_lane_jb;
  ts.grouped = G > 1;
  ts.lpg = ts.grouped && per % V == 0 ? per / V : 0;
  ts.aligned = ts.lpg > 0 && (ts.lpg & (ts.lpg - 1)) == 0;
  ts.any_straddle = false;
  ts.ncover = 0;
  if constexpr (TPW == 1) {
    if (ts.grouped && !ts.aligned)
      legacy_group_setup<V>(p, lane, warp, s_lane_gf, s_lane_jb, ts.any_straddle, ts.ncover);
  }
  ts.my_group = ts.grouped ? ts.e0 / per : 0;  // aligned layout: this lane's group (>= G: no experts)
  return ts;
}

// V: experts per lane; TPW: tokens per warp (2: a half-warp per token; then K <= 15, E <= 16 V,
// and groups, if any, aligned to lanes -- the launcher checks).
template <int V, class LT, int SF, int TPW>
__global__ void __launch_bounds__(kThreads, FastBounds<V, TPW>::kMinBlocks)
    route_forward_fast_kernel(const __grid_constant__ FwdParams p) {
  begin_forward_after_previous_grid(p);
  static_assert(V == 1 || V == 2 || V == 4 || V == 8 || V == 16, "V must be a power of two <= 16");
  static_assert(TPW == 1 || (TPW == 2 && V >= 2), "two tokens per warp pair the legacy lanes");
  constexpr int LPT = 32 / TPW;  // lanes per token
  constexpr int EP = LPT * V;    // experts per token, padded
  constexpr int kRows = kWarps * TPW;  // statistics rows of a block (one per token stream)

  __shared__ __align__(16) float s_red[kRows][EP];
  __shared__ __align__(16) float s_bias[EP];
  __shared__ float s_wlse[kRows];
  __shared__ unsigned s_wcnt[kRows];
  __shared__ unsigned long long s_n[kThreads];
  __shared__ int s_lane_gf[32], s_lane_jb[32];
  __shared__ float s_blk_lse;
  __shared__ unsigned long long s_blk_cnt;
  __shared__ int s_flag;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int E = p.E;
  const LT* logits = static_cast<const LT*>(p.logits);

  stage_bias(s_bias, p, EP);
  const FastTokenSetup<TPW> ts = fast_token_setup<V, SF, TPW>(p, lane, warp, s_bias, s_lane_gf, s_lane_jb);
  const int hl = ts.tl.hl, e0 = ts.e0, stream = warp * TPW + (lane >> 4) * (TPW - 1);
  const bool want_prob = ts.want_prob, want_scal = ts.want_scal;
  if (tid == 0) {
    s_blk_lse = 0.0f;
    s_blk_cnt = 0;
  }
  __syncthreads();

  const int64_t step = static_cast<int64_t>(kWarps) * TPW;
  for (int64_t c = blockIdx.x; c < p.nchunks; c += gridDim.x) {
    const ChunkSpan span = chunk_span(p, c);
    const int64_t s = span.s, jc = span.jc, t_begin = span.begin, t_end = span.end;

    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.0f;
    float w_lse = 0.0f;
    unsigned w_cnt = 0;

    int64_t t = t_begin + stream;
    const LT* row = logits + t * E;
    const int64_t row_step = step * E;
    RowRaw<V, LT> cur;
    if (t < t_end) load_row<V, LT>(cur, row, e0, E, p.vec_ok);
    while (t < t_end) {  // uniform over the token's lanes
      RowRaw<V, LT> nxt;
      if (t + step < t_end) load_row<V, LT>(nxt, row + row_step, e0, E, p.vec_ok);

      float x[V];
      unpack_row<V, LT>(cur, x);
      fast_route_token<V, LT, SF, TPW>(p, ts, row, t, x, acc, w_lse, w_cnt);

      cur = nxt;
      t += step;
      row += row_step;
    }

    // This chunk's statistics: the token streams in order (warp, then half-warp).
    if (want_prob) {
#pragma unroll
      for (int j = 0; j < V; ++j) s_red[stream][e0 + j] = acc[j];
    }
    if (want_scal && hl == 0) {
      s_wlse[stream] = w_lse;
      s_wcnt[stream] = w_cnt;
    }
    __syncthreads();
    allow_next_grid_before_stats(p);
    commit_chunk_stats<kRows>(p, s, jc, &s_red[0][0], EP, s_wlse, s_wcnt, s_blk_lse, s_blk_cnt, want_prob, want_scal);
    __syncthreads();  // s_red is reused by the next chunk
  }
  finish_block_scalars(p, &s_red[0][0], s_n, s_blk_lse, s_blk_cnt, s_flag, want_scal);
}

}  // namespace epx::cuda::router_kernels
