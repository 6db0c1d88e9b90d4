// Dispatch on one GPU through shared memory and the bulk-copy (TMA) engine, sm_90+: the bf16/fp8
// copy (permute_bulk_kernel) and quantize-while-permuting (permute_quantize_kernel).
//
// Both run one warp per CTA, each warp walking tokens t = blockIdx.x, + gridDim.x, ... (grid sized
// to the resident CTAs), with shared-memory stages: the copy has two, so that one token is being
// filled while the previous one drains; the quantizer two or, by default, one (its x loads are in
// flight while the previous token drains, and one stage fits twice the warps on an SM):
// - the copy loads the x row (and scale row) of token t + stride into the free stage by one bulk
//   copy that completes an mbarrier, then lane k < K sends the current stage to its destination row
//   by one bulk store per tensor: the row is read from HBM once and written K times by the copy
//   engine, with no register round trip and one instruction per destination.
// - the quantizer reads the x row with 16-byte register loads (8 vectors per lane in flight, the
//   next 8 -- of this row or the next token's -- loading while these are quantized),
//   quantizes it block by block with the lane-group helpers of src/cuda/quant (bit-identical to
//   cuda::quantize and epx::ref::quantize), writes codes and scales into the stage, and sends it like
//   the copy; or, when the pointers do not allow bulk stores (or the kWarp tuning asks), the lanes
//   store the staged row to every destination themselves.
// Stage reuse: bulk stores are grouped per lane and token (a lane < K commits one group per token,
// possibly empty); before a stage is overwritten every lane waits until its groups that read that
// stage have finished reading (cp.async.bulk.wait_group.read), then the warp syncs. Everything is
// waited for before the padding rows are zeroed and before the CTA exits.
// A wait on an mbarrier that never completes (a bug, never a legal state) traps after ~10 s, so a
// launch fails with an error instead of hanging the stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/permute/permute_kernels.cuh"
#include "cuda/quant/quant_kernels.cuh"

namespace epx::cuda::permute {

namespace bulk {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

/// Orders this thread's generic-proxy shared-memory accesses (barrier init, staged codes) with the
/// async proxy (the bulk-copy engine) that reads or writes the same memory next.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

/// Arrives once on the barrier and adds `bytes` to the transaction count this phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

/// Waits for the phase of the given parity to complete (try_wait suspends between polls).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const long long start = clock64();
  while (!mbar_try_wait(bar, parity))
    if (clock64() - start > (1ll << 34)) __trap();  // ~10 s: the phase can never complete
}

/// Global -> shared bulk copy completing `bar`'s transaction count. 16-byte aligned addresses,
/// bytes a multiple of 16.
__device__ __forceinline__ void load_async(void* smem_dst, const void* gsrc, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(smem_dst)),
               "l"(gsrc), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

/// Shared -> global bulk copy in this thread's current bulk group. Same alignment rules.
__device__ __forceinline__ void store_async(void* gdst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gdst), "r"(smem_u32(smem_src)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

/// Until at most N of this thread's most recent bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

/// Until every bulk group of this thread has completed (its global writes done).
__device__ __forceinline__ void wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

}  // namespace bulk

/// Lanes store `bytes` of shared memory at src to rows[0..K) of dst_base (stride `stride`), vector V.
template <class V>
__device__ __forceinline__ void stage_to_rows(const unsigned char* src, int64_t bytes, char* dst_base, int64_t stride,
                                              const int32_t* rows, int K, int lane) {
  const V* s = reinterpret_cast<const V*>(src);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t v = lane; v < n; v += 32) {
    const V val = s[v];
    for (int k = 0; k < K; ++k) {
      const int32_t r = rows[k];
      if (r >= 0) reinterpret_cast<V*>(dst_base + r * stride)[v] = val;
    }
  }
}

/// The same with the widest of 16/8/4/1-byte vectors `align` allows (it divides bytes, stride and
/// dst_base; the stage itself is 16-byte aligned).
__device__ __forceinline__ void stage_to_rows(const unsigned char* src, int64_t bytes, char* dst_base, int64_t stride,
                                              const int32_t* rows, int K, int lane, int align) {
  if (align >= 16) stage_to_rows<uint4>(src, bytes, dst_base, stride, rows, K, lane);
  else if (align >= 8) stage_to_rows<uint2>(src, bytes, dst_base, stride, rows, K, lane);
  else if (align >= 4) stage_to_rows<uint32_t>(src, bytes, dst_base, stride, rows, K, lane);
  else stage_to_rows<uint8_t>(src, bytes, dst_base, stride, rows, K, lane);
}

// ---- copy ------------------------------------------------------------------------------------

struct BulkArgs {
  PermuteArgs p;
  uint32_t stage_bytes;  // one stage: the payload row, then (bulk_scales) the scale row at scale_off
  uint32_t scale_off;
  bool bulk_scales;      // scale rows by bulk copies (16-byte sizes and pointers), else lane copies
};

__global__ void __launch_bounds__(32) permute_bulk_kernel(BulkArgs a) {
  extern __shared__ __align__(128) unsigned char stage_mem[];
  __shared__ __align__(8) uint64_t full[2];
  __shared__ int32_t rows_s[32];
  const int lane = static_cast<int>(threadIdx.x);
  const PermuteArgs& p = a.p;
  const Layout& L = p.L;
  if (static_cast<int64_t>(L.offsets[L.Le]) > p.capacity) return;  // overflow: write nothing
  const int64_t nw = gridDim.x, gw = blockIdx.x;
  const uint32_t rb = static_cast<uint32_t>(p.row_bytes), sb = static_cast<uint32_t>(p.scale_bytes);
  if (lane == 0) {
    bulk::mbar_init(&full[0], 1);
    bulk::mbar_init(&full[1], 1);
    bulk::fence_proxy_async();  // the initialised barriers, visible to the copy engine
  }
  __syncwarp();
  // Lane 0 starts the copy of token t's rows into stage s.
  auto fetch = [&](int64_t t, int s) {
    unsigned char* st = stage_mem + s * a.stage_bytes;
    bulk::mbar_arrive_expect_tx(&full[s], rb + (a.bulk_scales ? sb : 0u));
    bulk::load_async(st, p.x + t * p.row_bytes, rb, &full[s]);
    if (a.bulk_scales) bulk::load_async(st + a.scale_off, p.x_scales + t * p.scale_bytes, sb, &full[s]);
  };
  Slot next;
  if (gw < L.T) {
    next = load_slot(p, gw, lane);
    if (lane == 0) fetch(gw, 0);
  }
  int i = 0;
  for (int64_t t = gw; t < L.T; t += nw, ++i) {
    const int s = i & 1;
    const Slot cur = next;
    const int64_t tn = t + nw;
    // The other stage fed the previous token's stores: once they have read it, refill it.
    bulk::wait_read<0>();
    __syncwarp();
    if (tn < L.T) {
      next = load_slot(p, tn, lane);
      if (lane == 0) fetch(tn, s ^ 1);
    }
    const int32_t row = publish_slot(p, t, lane, cur);
    bulk::mbar_wait(&full[s], (i >> 1) & 1);
    if (row >= 0) {
      const unsigned char* st = stage_mem + s * a.stage_bytes;
      bulk::fence_proxy_async();
      bulk::store_async(p.recv + row * p.row_bytes, st, rb);
      if (a.bulk_scales) bulk::store_async(p.recv_scales + row * p.scale_bytes, st + a.scale_off, sb);
    }
    bulk::commit();
    if (sb && !a.bulk_scales) {
      rows_s[lane] = row;
      __syncwarp();
      copy_short_to_rows<uint8_t>(p.x_scales + t * p.scale_bytes, p.scale_bytes, p.recv_scales, p.scale_bytes, rows_s,
                                  L.K, lane);
      __syncwarp();
    }
  }
  bulk::wait_all();
  const int64_t pad_items = static_cast<int64_t>(L.Le) * p.pad_chunks;
  for (int64_t q = nw - 1 - gw; q < pad_items; q += nw) zero_pad_item(p, q, p.row_bytes, 16, 1, lane);
}

// ---- quantize while permuting ----------------------------------------------------------------

struct QuantPermuteArgs {
  PermuteArgs p;          // x: the fp32/bf16/fp16 rows; recv: fp8 rows of H bytes; scale_bytes: one
                          // scale row of recv_scales (H/128 fp32 or H/32 e8m0)
  int64_t H;
  uint32_t stage_bytes;   // the fp8 row (H bytes, H % 32 == 0), then the scale row at offset H
  int payload_align;      // 0: bulk stores of the fp8 row; else lanes store with this many bytes
  int scale_align;        // 0: bulk stores of the scale row; else lanes store with this many bytes
  bool ceil_rounding;     // MX: E8M0Rounding::kCeil
};

/// Lane `lane`'s U vectors of batch `base` (vector v = base + u * 32 + lane) of x row t; zeros past
/// the row or the matrix.
template <class T, bool kAlignedX, int U>
__device__ __forceinline__ void load_x_batch(quant::Raw16 (&r)[U], const T* x, int64_t t, int64_t base, int lane,
                                             int64_t T_, int64_t H) {
  constexpr int kElems = quant::Vec<T>::kElems;
#pragma unroll
  for (int u = 0; u < U; ++u) r[u] = quant::load_vec<T, kAlignedX>(x, t, (base + u * 32 + lane) * kElems, T_, H);
}

/// Quantizes a batch into the stage: codes at byte kElems v, the block scales after the H code bytes.
/// A block is kGroup consecutive lanes (H is a whole number of blocks, so a group is wholly inside or
/// outside the row); every lane runs every step, as the group shuffles require.
template <class T, bool kMx, int U>
__device__ __forceinline__ void quantize_x_batch(const quant::Raw16 (&raw)[U], int64_t base, int lane, int64_t nvec,
                                                 int64_t H, unsigned char* st, bool ceil_rounding) {
  constexpr int kElems = quant::Vec<T>::kElems;  // 8 bf16/fp16, 4 fp32 per 16-byte vector
  constexpr int kBlock = kMx ? 32 : 128;
  constexpr int kGroup = kBlock / kElems;        // lanes per block
  constexpr int kCodeWords = kElems / 4;
  static_assert(32 % kGroup == 0, "a block's lanes stay inside the warp");
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t v = base + u * 32 + lane;
    float f[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) f[e] = quant::raw_elem<T>(raw[u], e);
    uint32_t codes[kCodeWords];
    const bool in_row = v < nvec, leader = in_row && (lane % kGroup) == 0;
    if constexpr (kMx) {
      const uint32_t bits = quant::quantize_mx_block_group<kGroup, kElems>(f, ceil_rounding, codes);
      if (leader) st[H + v / kGroup] = static_cast<uint8_t>(bits);
    } else {
      const float scale = quant::quantize_fp8_block_group<kGroup, kElems>(f, codes);
      if (leader) reinterpret_cast<float*>(st + H)[v / kGroup] = scale;
    }
    if (in_row) {
      if constexpr (kCodeWords == 2) *reinterpret_cast<uint2*>(st + v * kElems) = make_uint2(codes[0], codes[1]);
      else *reinterpret_cast<uint32_t*>(st + v * kElems) = codes[0];
    }
  }
}

/// x vectors a lane loads at once (a batch).
constexpr int kQuantBatch = 8;

/// Without kPipelined a batch of x loads when the warp gets to it; with it, the next batch (the rest
/// of this row, or the next token's first) loads while this one is quantized, so the warp keeps x in
/// flight across tokens too. kStages staged rows a warp: with 2, a token's codes go into the stage
/// the token before last used (its stores have read it, the previous token's may still be reading
/// the other); with 1, into the only stage once the previous token's stores have read it, at half
/// the shared memory a warp.
template <class T, bool kMx, bool kAlignedX, bool kPipelined, int kStages>
__global__ void __launch_bounds__(32) permute_quantize_kernel(QuantPermuteArgs a) {
  using quant::Raw16;
  constexpr int kElems = quant::Vec<T>::kElems;
  constexpr int U = kQuantBatch;
  static_assert(kStages == 1 || kStages == 2, "one or two staged rows a warp");
  extern __shared__ __align__(128) unsigned char stage_mem[];
  __shared__ int32_t rows_s[32];
  const int lane = static_cast<int>(threadIdx.x);
  const PermuteArgs& p = a.p;
  const Layout& L = p.L;
  if (static_cast<int64_t>(L.offsets[L.Le]) > p.capacity) return;  // overflow: write nothing
  const int64_t nw = gridDim.x, gw = blockIdx.x;
  const int64_t H = a.H, nvec = H / kElems;
  const T* x = reinterpret_cast<const T*>(p.x);
  const uint32_t sb = static_cast<uint32_t>(p.scale_bytes);
  const bool bulk_payload = a.payload_align == 0, bulk_scales = a.scale_align == 0;
  Slot next;
  if (gw < L.T) next = load_slot(p, gw, lane);
  Raw16 ahead[kPipelined ? U : 1];  // kPipelined: the batch after the one being quantized
  if constexpr (kPipelined) {
    if (gw < L.T) load_x_batch<T, kAlignedX, U>(ahead, x, gw, 0, lane, L.T, H);
  }
  int i = 0;
  for (int64_t t = gw; t < L.T; t += nw, ++i) {
    unsigned char* st = stage_mem + (kStages == 2 ? (i & 1) : 0) * a.stage_bytes;
    const Slot cur = next;
    if (t + nw < L.T) next = load_slot(p, t + nw, lane);
    bulk::wait_read<kStages - 1>();  // the stores that last read this stage have read it
    __syncwarp();
    const int32_t row = publish_slot(p, t, lane, cur);
    rows_s[lane] = row;
    for (int64_t base = 0; base < nvec; base += 32 * U) {
      Raw16 raw[U];
      if constexpr (kPipelined) {
#pragma unroll
        for (int u = 0; u < U; ++u) raw[u] = ahead[u];
        if (base + 32 * U < nvec) load_x_batch<T, kAlignedX, U>(ahead, x, t, base + 32 * U, lane, L.T, H);
        else if (t + nw < L.T) load_x_batch<T, kAlignedX, U>(ahead, x, t + nw, 0, lane, L.T, H);
      } else {
        load_x_batch<T, kAlignedX, U>(raw, x, t, base, lane, L.T, H);
      }
      quantize_x_batch<T, kMx, U>(raw, base, lane, nvec, H, st, a.ceil_rounding);
    }
    bulk::fence_proxy_async();  // the staged codes and scales, visible to the copy engine
    __syncwarp();
    if (bulk_payload) {
      if (row >= 0) {
        bulk::store_async(p.recv + row * H, st, static_cast<uint32_t>(H));
        if (bulk_scales) bulk::store_async(p.recv_scales + row * p.scale_bytes, st + H, sb);
      }
      bulk::commit();
    } else {
      stage_to_rows(st, H, p.recv, H, rows_s, L.K, lane, a.payload_align);
    }
    if (!bulk_scales) stage_to_rows(st + H, p.scale_bytes, p.recv_scales, p.scale_bytes, rows_s, L.K, lane, a.scale_align);
    __syncwarp();
  }
  bulk::wait_all();
  const int64_t pad_items = static_cast<int64_t>(L.Le) * p.pad_chunks;
  for (int64_t q = nw - 1 - gw; q < pad_items; q += nw)
    zero_pad_item(p, q, H, bulk_payload ? 16 : a.payload_align, bulk_scales ? 16 : a.scale_align, lane);
}

}  // namespace epx::cuda::permute
