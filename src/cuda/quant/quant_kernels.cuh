// Device code of the FP8 block and MXFP8 quantization (semantics: include/epx/quant.h; oracle:
// src/ref/quant.cpp). Every kernel reproduces the reference bit for bit:
// - amax is the max of |x| over FINITE elements. Within a thread it is an fmaxf chain (maxNum
//   ignores NaN; a lane that met an infinity recomputes without it); across threads it is an
//   integer max of the fp32 bit patterns (for non-negative floats the integer order is the float
//   order). max is exact and order-independent, so a shuffle tree gives the same amax as the
//   reference's sequential loop.
// - FP8 blocks: a = max(amax, 1e-4f); r = __fdiv_rn(448, a) once per block; each element
//   cvt.rn.satfinite.e4m3(__fmul_rn(x, r)). The intrinsics pin IEEE division and a lone multiply:
//   nothing can be contracted into an fma or replaced by a reciprocal. The stored scale RN(a / 448)
//   is computed by a multiply and an fma correction that is exact for this fixed divisor over the
//   whole range of a (see fp8_block_scale).
// - MXFP8: the E8M0 bits come straight from amax's exponent field (floor: E - 8; ceil: one more when
//   the mantissa exceeds 1.75), clamped at 0; a subnormal or zero amax gives 0. The element is
//   x * 2^(127 - bits), a multiply by a normal power of two (bits <= 247 for any finite fp32 amax),
//   exact unless the product falls under fp32's normal range, where it is far below e4m3's smallest
//   half-step and rounds to +-0 either way (see the header).
// - NaN: the PTX cvt may keep a NaN's sign (0xFF); the reference writes 0x7F for every NaN, so the
//   sign bit of every NaN code is cleared after the conversion. Satfinite never produces 0x7F/0xFF
//   from a non-NaN input (the largest finite code is 0x7E), so the fix touches NaNs only.
// - Subnormals are never flushed: the library is built without fast-math or -ftz.
//
// Memory access: x is read with 16-byte loads (8 bf16/fp16 or 4 fp32 elements per thread) when the
// base pointers are aligned and N is a multiple of the vector; otherwise the same kernels run an
// element-wise variant (kAligned = false) with per-element bounds checks. Every thread of a launched
// warp takes part in the shuffles (no early exit before them); out-of-range elements enter as +0.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/dtype_cuda.cuh"

namespace epx::cuda::quant {

constexpr int kThreads = 256;  // every kernel here runs 256-thread CTAs
constexpr float kE4M3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;

// ================================================================================================
// Scalar pieces of the two recipes (shared by the kernels below and by fused callers).
// ================================================================================================

/// |v| as fp32 bits if v is finite, else 0: an integer max over these is the finite amax.
__device__ __forceinline__ uint32_t finite_abs_bits(float v) {
  const uint32_t a = __float_as_uint(v) & 0x7fffffffu;
  return a < 0x7f800000u ? a : 0u;
}

/// This lane's finite amax over v[] as fp32 bits. fmaxf is IEEE maxNum: a NaN operand never
/// wins, so the common path is one FMNMX (with the |.| modifier) per element; only an infinity
/// can win, and then (rarely, lane-local, no shuffles) the max is taken again without it.
template <int kVec>
__device__ __forceinline__ uint32_t lane_finite_amax_bits(const float (&v)[kVec]) {
  float m = 0.0f;
#pragma unroll
  for (int e = 0; e < kVec; ++e) m = fmaxf(m, fabsf(v[e]));
  if (m == __uint_as_float(0x7f800000u)) {
    m = 0.0f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float a = fabsf(v[e]);
      if (a < __uint_as_float(0x7f800000u)) m = fmaxf(m, a);  // false for +inf and NaN
    }
  }
  return __float_as_uint(m);  // +0 or a positive finite float: its bits order like its value
}

/// Max over the kGroup consecutive lanes of an aligned lane group (kGroup a power of two <= 32).
/// Every lane of the warp must call it (full-mask shuffles); xor offsets below kGroup never leave
/// the group.
template <int kGroup>
__device__ __forceinline__ uint32_t group_max(uint32_t v) {
  static_assert(kGroup >= 1 && kGroup <= 32 && (kGroup & (kGroup - 1)) == 0, "kGroup: a power of two <= 32");
#pragma unroll
  for (int off = kGroup / 2; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

/// FP8 block multiplier 448 / max(amax, 1e-4): one IEEE fp32 division.
__device__ __forceinline__ float fp8_block_multiplier(uint32_t amax_bits) {
  return __fdiv_rn(kE4M3Max, fmaxf(__uint_as_float(amax_bits), kAmaxFloor));
}
/// FP8 block scale max(amax, 1e-4) / 448 as stored (not 1 / multiplier), correctly rounded
/// without a division: q = a * RN(1/448), then one fma residual correction. For a divisor fixed
/// at 448 this returns exactly RN(a / 448) for EVERY fp32 a in [1e-4, FLT_MAX] (checked
/// exhaustively on the host: 1,185,827,049 values, no difference); a = max(amax, 1e-4) never
/// leaves that range, so the result is bit-identical to the reference's division.
__device__ __forceinline__ float fp8_block_scale(uint32_t amax_bits) {
  constexpr float kInv448 = 0x1.24924ap-9f;  // RN(1 / 448)
  const float a = fmaxf(__uint_as_float(amax_bits), kAmaxFloor);
  const float q = __fmul_rn(a, kInv448);
  return __fmaf_rn(__fmaf_rn(-q, kE4M3Max, a), kInv448, q);
}

/// MXFP8 E8M0 bits from the finite amax's bit pattern (< 0x7f800000).
__device__ __forceinline__ uint32_t mx_scale_bits(uint32_t amax_bits, bool ceil_rounding) {
  const int e = static_cast<int>(amax_bits >> 23);  // biased exponent, 0..254
  if (e == 0) return 0u;  // zero or subnormal amax: floor(log2 amax) <= -127, the bits clamp to 0
  // amax = 1.f * 2^(e - 127): floor gives 2^(e - 127 - 8), i.e. bits e - 8. Ceil needs one more
  // power when 1.f > 1.75, i.e. the mantissa field above 0.75 * 2^23: exact, no log2.
  const int k = e - 8 + ((ceil_rounding && (amax_bits & 0x7fffffu) > 0x600000u) ? 1 : 0);
  return k < 0 ? 0u : static_cast<uint32_t>(k);  // e <= 254 gives k <= 247: the 254 clamp never binds
}

/// 2^(127 - bits) for bits in [0, 247]: a normal fp32 (exponent field 254 - bits in [7, 254]).
__device__ __forceinline__ float mx_inv_scale(uint32_t bits) { return __uint_as_float((254u - bits) << 23); }

/// E8M0 bits to fp32: 0xFF is NaN, 0 is 2^-127 (an fp32 subnormal, kept).
__device__ __forceinline__ float e8m0_to_float(uint32_t bits) {
  if (bits == 0xffu) return __uint_as_float(0x7fffffffu);
  if (bits == 0u) return __uint_as_float(0x00400000u);
  return __uint_as_float(bits << 23);
}

/// Two e4m3 codes (saturating RNE) in the low 16 bits, lo in the low byte.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float lo, float hi) {
  uint16_t r;
  // PTX puts the conversion of the first source in the upper byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

/// Clears the sign of every NaN code (S.1111.111) in four packed e4m3 bytes: the reference's NaN is
/// 0x7F whatever the input's sign. (b & 0x7F) + 1 carries into bit 7 exactly when b's low 7 bits
/// are all ones, and cannot carry into the next byte.
__device__ __forceinline__ uint32_t canonical_nan_e4m3x4(uint32_t w) {
  const uint32_t nan_bytes = ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
  return w & ~nan_bytes;
}

/// Four values times `mul` (one fp32 multiply each), converted and packed, element a in the low byte.
__device__ __forceinline__ uint32_t encode_e4m3x4(float a, float b, float c, float d, float mul) {
  const uint32_t lo = cvt_e4m3x2(__fmul_rn(a, mul), __fmul_rn(b, mul));
  const uint32_t hi = cvt_e4m3x2(__fmul_rn(c, mul), __fmul_rn(d, mul));
  return canonical_nan_e4m3x4(lo | (hi << 16));
}

/// Same with one multiplier per element (MX colwise: one scale per column).
__device__ __forceinline__ uint32_t encode_e4m3x4(float a, float b, float c, float d, float ma, float mb, float mc,
                                                  float md) {
  const uint32_t lo = cvt_e4m3x2(__fmul_rn(a, ma), __fmul_rn(b, mb));
  const uint32_t hi = cvt_e4m3x2(__fmul_rn(c, mc), __fmul_rn(d, md));
  return canonical_nan_e4m3x4(lo | (hi << 16));
}

// ================================================================================================
// Block quantizers for a lane group: the fusable entry points ("quantize while permuting").
//
// Contract (both functions):
// - A group is kGroup consecutive lanes of one warp starting at a lane that is a multiple of kGroup
//   (kGroup a power of two, 1..32). Together they hold ONE block of the recipe, in element order:
//   lane g of the group holds elements [g * kVec, (g + 1) * kVec) of the block in v[0..kVec).
//   So kGroup * kVec = 128 for the 1x128 recipe and 32 for MX rowwise (e.g. bf16 rows read as
//   16-byte vectors: kVec = 8, kGroup = 16 / 4; a whole warp per 128-block: kGroup = 32, kVec = 4).
// - Elements past the end of a partial block (or a lane with no block at all) must be passed as
//   +0.0f: +0 never raises amax. Their codes come back as 0x00 and must simply not be stored.
// - All 32 lanes of the warp must call together (converged) with the same template arguments: the
//   amax reduction uses full-mask shuffles. The result is the same in every lane of a group.
// - Values are the fp32 inputs exactly as loaded (bf16/fp16 widened exactly); kVec % 4 == 0.
// - codes[w] receives the e4m3 bytes of v[4w .. 4w + 3], v[4w] in the low byte: storing the words
//   little-endian writes the bytes in element order.
// - Returns the scale to store: FP8 blocks the fp32 scale max(amax, 1e-4) / 448; MX the E8M0 bits.
// The results are bit-identical to epx::ref::quantize for the same block.
// ================================================================================================

template <int kGroup, int kVec>
__device__ __forceinline__ float quantize_fp8_block_group(const float (&v)[kVec], uint32_t (&codes)[kVec / 4]) {
  static_assert(kVec % 4 == 0, "kVec must be a multiple of 4");
  const uint32_t amax = group_max<kGroup>(lane_finite_amax_bits(v));
  const float mul = fp8_block_multiplier(amax);
#pragma unroll
  for (int w = 0; w < kVec / 4; ++w) codes[w] = encode_e4m3x4(v[4 * w], v[4 * w + 1], v[4 * w + 2], v[4 * w + 3], mul);
  return fp8_block_scale(amax);
}

template <int kGroup, int kVec>
__device__ __forceinline__ uint32_t quantize_mx_block_group(const float (&v)[kVec], bool ceil_rounding,
                                                            uint32_t (&codes)[kVec / 4]) {
  static_assert(kVec % 4 == 0, "kVec must be a multiple of 4");
  const uint32_t amax = group_max<kGroup>(lane_finite_amax_bits(v));
  const uint32_t bits = mx_scale_bits(amax, ceil_rounding);
  const float inv = mx_inv_scale(bits);
#pragma unroll
  for (int w = 0; w < kVec / 4; ++w) codes[w] = encode_e4m3x4(v[4 * w], v[4 * w + 1], v[4 * w + 2], v[4 * w + 3], inv);
  return bits;
}

// ================================================================================================
// Vector access: 16 bytes of input per thread, as four 32-bit words.
// ================================================================================================

template <class T>
struct Vec {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(T));  // 8 bf16/fp16, 4 fp32
};

struct Raw16 {
  uint32_t w[4];
};

/// Element e (a compile-time constant after unrolling) of a raw vector, widened exactly to fp32.
template <class T>
__device__ __forceinline__ float raw_elem(const Raw16& r, int e);
template <>
__device__ __forceinline__ float raw_elem<float>(const Raw16& r, int e) {
  return __uint_as_float(r.w[e]);
}
template <>
__device__ __forceinline__ float raw_elem<__nv_bfloat16>(const Raw16& r, int e) {
  return bf16_word_half_to_float(r.w[e >> 1], e & 1);
}
template <>
__device__ __forceinline__ float raw_elem<__half>(const Raw16& r, int e) {
  const uint32_t w = r.w[e >> 1];
  return __half2float(__ushort_as_half(static_cast<unsigned short>((e & 1) ? (w >> 16) : (w & 0xffffu))));
}

/// The kElems elements of x[i, j0 ..] (row-major, N columns) as raw bits; zeros outside the matrix.
/// kAligned: x is 16-byte aligned and N % kElems == 0, so a vector is wholly inside or outside.
template <class T, bool kAligned>
__device__ __forceinline__ Raw16 load_vec(const T* __restrict__ x, int64_t i, int64_t j0, int64_t M, int64_t N) {
  Raw16 r = {{0u, 0u, 0u, 0u}};
  if (i >= M) return r;
  if constexpr (kAligned) {
    if (j0 < N) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(x + i * N + j0));
      r.w[0] = u.x;
      r.w[1] = u.y;
      r.w[2] = u.z;
      r.w[3] = u.w;
    }
  } else {
    constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int e = 0; e < Vec<T>::kElems; ++e) {
      if (j0 + e < N) {
        uint32_t bits;
        if constexpr (sizeof(T) == 4) bits = __ldg(reinterpret_cast<const uint32_t*>(x) + i * N + j0 + e);
        else bits = __ldg(reinterpret_cast<const unsigned short*>(x) + i * N + j0 + e);
        r.w[e / kPerWord] |= bits << (16 * (e % kPerWord));
      }
    }
  }
  return r;
}

/// Stores the kBytes codes of q[i, j0 ..] (kBytes / 4 words). kAligned: q + i * N + j0 is
/// kBytes-aligned and the run is wholly inside or outside the row.
template <int kBytes, bool kAligned>
__device__ __forceinline__ void store_codes(uint8_t* __restrict__ q, int64_t i, int64_t j0, int64_t M, int64_t N,
                                            const uint32_t (&codes)[kBytes / 4]) {
  if (i >= M) return;
  uint8_t* p = q + i * N + j0;
  if constexpr (kAligned) {
    if (j0 >= N) return;
    if constexpr (kBytes == 4) *reinterpret_cast<uint32_t*>(p) = codes[0];
    else if constexpr (kBytes == 8) *reinterpret_cast<uint2*>(p) = make_uint2(codes[0], codes[1]);
    else {
      static_assert(kBytes == 16, "4, 8 or 16 codes per store");
      *reinterpret_cast<uint4*>(p) = make_uint4(codes[0], codes[1], codes[2], codes[3]);
    }
  } else {
#pragma unroll
    for (int e = 0; e < kBytes; ++e)
      if (j0 + e < N) p[e] = static_cast<uint8_t>(codes[e / 4] >> (8 * (e % 4)));
  }
}

// ================================================================================================
// Row recipes (1x128 and MX rowwise): blocks of one row.
// CTA = 128 column lanes x 2 row lanes; a thread owns one 16-byte column vector in kRows rows of a
// tile of 2 * kRows rows, issues all their loads first (kRows x 16 bytes in flight per thread),
// then quantizes row by row. A block
// of bc columns is covered by kGroup = bc / kElems consecutive lanes of one warp (128 and 32 are
// multiples of kGroup, so groups never straddle warps or CTAs). grid.x covers the column blocks of
// a row, grid.y strides over row tiles.
// ================================================================================================

constexpr int kRowLanesX = 128;
constexpr int kRowLanesY = kThreads / kRowLanesX;  // 2
/// Rows per CTA iteration when each thread keeps kRows rows in flight.
template <int kRows>
constexpr int row_tile() {
  return kRowLanesY * kRows;
}

/// Minimum resident CTAs per SM the row kernels are compiled for: caps registers at 51 (4 rows)
/// or 64 (8 rows). Measured on H200 (bf16 [4096, 7168]) with an earlier version of this kernel:
/// uncapped, the compiler took 52-56 registers, 4 CTAs fit instead of 5, and 1x128 lost ~5%.
template <int kRows>
constexpr int row_min_blocks() {
  return kRows >= 8 ? 4 : 5;
}

template <class T, bool kMx, bool kAligned, int kRows>
__global__ void __launch_bounds__(kThreads, row_min_blocks<kRows>()) quantize_rowwise_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                                    void* __restrict__ scales, int64_t M, int64_t N,
                                                                    int64_t scale_cols, int64_t row_tiles,
                                                                    bool ceil_rounding) {
  constexpr int kElems = Vec<T>::kElems;
  constexpr int kRowTile = row_tile<kRows>();
  constexpr int kBlockCols = kMx ? 32 : 128;
  constexpr int kGroup = kBlockCols / kElems;
  static_assert(kRowLanesX % kGroup == 0 && 32 % kGroup == 0, "lane groups must stay inside a warp");

  const int tx = static_cast<int>(threadIdx.x) % kRowLanesX;
  const int ty = static_cast<int>(threadIdx.x) / kRowLanesX;
  const int64_t cv = static_cast<int64_t>(blockIdx.x) * kRowLanesX + tx;  // column vector index
  const int64_t j0 = cv * kElems;
  const int64_t cb = cv / kGroup;  // column block: j0 / kBlockCols
  // One lane per group writes the scale; cb < scale_cols implies cb * kBlockCols < N.
  const bool leader = (tx % kGroup) == 0 && cb < scale_cols;

  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y) {
    const int64_t i0 = tile * kRowTile + ty;
    Raw16 raw[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) raw[r] = load_vec<T, kAligned>(x, i0 + r * kRowLanesY, j0, M, N);
    // Row by row through the fusable group helpers. (Interleaving the rows' amax / shuffle /
    // division phases was measured slower on H200: it raises register pressure, and occupancy
    // matters more here than the per-row latency chain.)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = i0 + r * kRowLanesY;
      float v[kElems];
#pragma unroll
      for (int e = 0; e < kElems; ++e) v[e] = raw_elem<T>(raw[r], e);
      uint32_t codes[kElems / 4];
      if constexpr (kMx) {
        const uint32_t bits = quantize_mx_block_group<kGroup, kElems>(v, ceil_rounding, codes);
        if (leader && i < M) static_cast<uint8_t*>(scales)[i * scale_cols + cb] = static_cast<uint8_t>(bits);
      } else {
        const float s = quantize_fp8_block_group<kGroup, kElems>(v, codes);
        if (leader && i < M) static_cast<float*>(scales)[i * scale_cols + cb] = s;
      }
      store_codes<kElems, kAligned>(q, i, j0, M, N, codes);
    }
  }
}

// ================================================================================================
// 128x128 blocks: one CTA per block (grid.x = column blocks, grid.y strides over block rows).
// kLanes = 128 / kElems lanes cover the block's 128 columns, the CTA's 256 threads cover
// kRowsPerPass rows at a time, and kPasses passes cover 128 rows. The whole block stays in registers
// (8 bf16 or 16 fp32 vectors per thread), so x is read once. amax: warp shuffles, then the 8 warp
// maxima through shared memory.
// ================================================================================================

template <class T, bool kAligned>
__global__ void __launch_bounds__(kThreads) quantize_block128_kernel(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                                     float* __restrict__ scales, int64_t M, int64_t N,
                                                                     int64_t scale_cols, int64_t block_rows) {
  constexpr int kElems = Vec<T>::kElems;
  constexpr int kLanes = 128 / kElems;
  constexpr int kRowsPerPass = kThreads / kLanes;
  constexpr int kPasses = 128 / kRowsPerPass;
  constexpr int kWarps = kThreads / 32;
  __shared__ uint32_t warp_amax[kWarps];

  const int tx = static_cast<int>(threadIdx.x) % kLanes;
  const int ty = static_cast<int>(threadIdx.x) / kLanes;
  const int64_t bj = blockIdx.x;
  const int64_t j0 = bj * 128 + static_cast<int64_t>(tx) * kElems;

  for (int64_t bi = blockIdx.y; bi < block_rows; bi += gridDim.y) {
    const int64_t i0 = bi * 128 + ty;
    Raw16 raw[kPasses];
#pragma unroll
    for (int p = 0; p < kPasses; ++p) raw[p] = load_vec<T, kAligned>(x, i0 + p * kRowsPerPass, j0, M, N);
    uint32_t amax = 0;
#pragma unroll
    for (int p = 0; p < kPasses; ++p)
#pragma unroll
      for (int e = 0; e < kElems; ++e) amax = max(amax, finite_abs_bits(raw_elem<T>(raw[p], e)));
    amax = group_max<32>(amax);
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) amax = max(amax, warp_amax[w]);
    const float mul = fp8_block_multiplier(amax);
    if (threadIdx.x == 0) scales[bi * scale_cols + bj] = fp8_block_scale(amax);
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      uint32_t codes[kElems / 4];
#pragma unroll
      for (int w = 0; w < kElems / 4; ++w)
        codes[w] = encode_e4m3x4(raw_elem<T>(raw[p], 4 * w), raw_elem<T>(raw[p], 4 * w + 1),
                                 raw_elem<T>(raw[p], 4 * w + 2), raw_elem<T>(raw[p], 4 * w + 3), mul);
      store_codes<kElems, kAligned>(q, i0 + p * kRowsPerPass, j0, M, N, codes);
    }
    __syncthreads();  // warp_amax is rewritten by this CTA's next block row
  }
}

// ================================================================================================
// MX colwise: blocks of 32 rows x 1 column. A CTA takes a strip of 32 rows x (32 * kElems) columns:
// 32 column lanes x 8 row lanes, each thread one 16-byte column vector in 4 consecutive rows
// (warp = one row lane, so every load instruction reads one row's 32 * 16 contiguous bytes).
// Per-column partial amaxes go through shared memory ([row lane][element][column lane]: conflict
// free); thread (tx, ty < kElems) finishes column j0 + ty and writes its scale byte; after a barrier
// every thread reads its kElems columns' scales and quantizes its 4 x kElems elements.
// grid.x = column stripes, grid.y strides over 32-row strips.
// ================================================================================================

constexpr int kColLanesX = 32;
constexpr int kColLanesY = kThreads / kColLanesX;  // 8
constexpr int kColRowsPerThread = 32 / kColLanesY;  // 4

template <class T, bool kAligned>
__global__ void __launch_bounds__(kThreads) quantize_mx_colwise_kernel(const T* __restrict__ x,
                                                                       uint8_t* __restrict__ q,
                                                                       uint8_t* __restrict__ scales, int64_t M,
                                                                       int64_t N, int64_t strips, bool ceil_rounding) {
  constexpr int kElems = Vec<T>::kElems;
  static_assert(kElems <= kColLanesY, "one finishing thread per column");
  __shared__ uint32_t partial[kColLanesY][kElems][kColLanesX];
  __shared__ uint32_t col_bits[kElems][kColLanesX];

  const int tx = static_cast<int>(threadIdx.x) % kColLanesX;
  const int ty = static_cast<int>(threadIdx.x) / kColLanesX;
  const int64_t j0 = (static_cast<int64_t>(blockIdx.x) * kColLanesX + tx) * kElems;

  for (int64_t s = blockIdx.y; s < strips; s += gridDim.y) {
    const int64_t i0 = s * 32 + static_cast<int64_t>(ty) * kColRowsPerThread;
    Raw16 raw[kColRowsPerThread];
#pragma unroll
    for (int r = 0; r < kColRowsPerThread; ++r) raw[r] = load_vec<T, kAligned>(x, i0 + r, j0, M, N);
#pragma unroll
    for (int e = 0; e < kElems; ++e) {
      uint32_t m = 0;
#pragma unroll
      for (int r = 0; r < kColRowsPerThread; ++r) m = max(m, finite_abs_bits(raw_elem<T>(raw[r], e)));
      partial[ty][e][tx] = m;
    }
    __syncthreads();
    if (ty < kElems) {
      uint32_t m = 0;
#pragma unroll
      for (int k = 0; k < kColLanesY; ++k) m = max(m, partial[k][ty][tx]);
      const uint32_t bits = mx_scale_bits(m, ceil_rounding);
      col_bits[ty][tx] = bits;
      if (j0 + ty < N) scales[s * N + j0 + ty] = static_cast<uint8_t>(bits);
    }
    // Orders col_bits for the readers below; the next strip's partial writes come after this
    // barrier and its col_bits writes after the next one, when every reader here is done.
    __syncthreads();
    float inv[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) inv[e] = mx_inv_scale(col_bits[e][tx]);
#pragma unroll
    for (int r = 0; r < kColRowsPerThread; ++r) {
      uint32_t codes[kElems / 4];
#pragma unroll
      for (int w = 0; w < kElems / 4; ++w)
        codes[w] = encode_e4m3x4(raw_elem<T>(raw[r], 4 * w), raw_elem<T>(raw[r], 4 * w + 1),
                                 raw_elem<T>(raw[r], 4 * w + 2), raw_elem<T>(raw[r], 4 * w + 3), inv[4 * w],
                                 inv[4 * w + 1], inv[4 * w + 2], inv[4 * w + 3]);
      store_codes<kElems, kAligned>(q, i0 + r, j0, M, N, codes);
    }
  }
}

// ================================================================================================
// Dequantize: x_out = e4m3 * scale (one fp32 multiply), stored with RNE. The CTA layout is that of
// the row recipes (128 column lanes x 2 row lanes, kRows rows per thread, all loads of a tile
// issued before the first use). A warp owns a span of 512 columns of a row; a thread owns 16 of
// them as kChunks chunks of kC = 16 / sizeof(TOut) codes, chunk k of lane l at span offset
// k * 32 * kC + l * kC. So every warp-wide store instruction writes 512 contiguous bytes of x_out
// (whole 32-byte sectors), and every load reads 32 * kC contiguous codes. (Giving each thread 16
// adjacent codes instead makes each 16-byte store instruction fill half of every sector it touches;
// measured on H200 that sent up to 1.6x the write sectors to L2 and made it the bottleneck.)
// Scales: kBc >= 16 gives one scale per chunk (a chunk never straddles a block); kBc == 1 (MX
// colwise) one E8M0 byte per code, kC contiguous bytes of scale row i / 32.
// ================================================================================================

constexpr int kDequantCodes = 16;                    // codes per thread per row
constexpr int kDequantSpan = 32 * kDequantCodes;      // columns per warp per row
constexpr int kDequantCtaCols = 4 * kDequantSpan;     // 128 column lanes = 4 warps

template <class TOut>
__device__ __forceinline__ uint32_t pack_out2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack_out2<__nv_bfloat16>(float a, float b) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(a))) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(b))) << 16);
}
template <>
__device__ __forceinline__ uint32_t pack_out2<__half>(float a, float b) {
  return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(a))) |
         (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(b))) << 16);
}

/// One 16-byte global store.
__device__ __forceinline__ void store16(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

/// e4m3 codes b0 (low byte) and b1 of a 16-bit pair to fp32 (exact: via f16x2).
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t pair) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<unsigned short>(pair & 0xffffu)));
  return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(h2 & 0xffffu))),
                     __half2float(__ushort_as_half(static_cast<unsigned short>(h2 >> 16))));
}

/// kBytes (4 or 8) bytes at p as words; kAligned: p is kBytes-aligned and wholly inside the row,
/// else byte by byte while col + e < N.
template <int kBytes, bool kAligned>
__device__ __forceinline__ void load_bytes(const uint8_t* __restrict__ p, int64_t col, int64_t N,
                                           uint32_t (&w)[kBytes / 4]) {
  if constexpr (kAligned) {
    if constexpr (kBytes == 8) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = u.x;
      w[1] = u.y;
    } else {
      w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    }
  } else {
#pragma unroll
    for (int e = 0; e < kBytes; ++e)
      if (col + e < N) w[e / 4] |= static_cast<uint32_t>(__ldg(p + e)) << (8 * (e % 4));
  }
}

template <class TOut, int kBr, int kBc, bool kAligned, int kRows>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* __restrict__ q,
                                                              const void* __restrict__ scales,
                                                              TOut* __restrict__ out, int64_t M, int64_t N,
                                                              int64_t scale_cols, int64_t row_tiles) {
  constexpr int kC = 16 / static_cast<int>(sizeof(TOut));  // codes per chunk = one 16-byte store
  constexpr int kChunks = kDequantCodes / kC;               // 2 (bf16, fp16) or 4 (fp32)
  constexpr int kW = kC / 4;                                // 32-bit words of codes per chunk
  static_assert(kBc == 1 || kBc % kC == 0, "a chunk shares one scale unless the block is a column");
  constexpr bool kFp32Scale = kBc == 128;  // the FP8 block recipes; MX scales are E8M0 bytes
  constexpr int kRowTile = row_tile<kRows>();
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int tx = static_cast<int>(threadIdx.x) % kRowLanesX;
  const int ty = static_cast<int>(threadIdx.x) / kRowLanesX;
  const int64_t span0 = static_cast<int64_t>(blockIdx.x) * kDequantCtaCols + (tx / 32) * kDequantSpan;
  if (span0 >= N) return;  // no shuffles or barriers below: idle warps may leave

  for (int64_t tile = blockIdx.y; tile < row_tiles; tile += gridDim.y) {
    const int64_t i0 = tile * kRowTile + ty;
    // Codes AND scales of every row are requested before the first use, so a thread waits for
    // memory once per tile, not once per row.
    uint32_t code[kRows][kChunks][kW];
    uint32_t sraw[kRows][kChunks][kBc == 1 ? kW : 1];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = i0 + r * kRowLanesY;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
#pragma unroll
        for (int w = 0; w < kW; ++w) code[r][k][w] = 0u;
#pragma unroll
        for (int w = 0; w < (kBc == 1 ? kW : 1); ++w) sraw[r][k][w] = 0u;
        const int64_t j = span0 + k * 32 * kC + lane * kC;
        if (i >= M || j >= N) continue;
        const int64_t srow = (i / kBr) * scale_cols;
        load_bytes<kC, kAligned>(q + i * N + j, j, N, code[r][k]);
        if constexpr (kBc == 1) {
          load_bytes<kC, kAligned>(static_cast<const uint8_t*>(scales) + srow + j, j, N, sraw[r][k]);
        } else if constexpr (kFp32Scale) {
          sraw[r][k][0] = __float_as_uint(__ldg(static_cast<const float*>(scales) + srow + j / kBc));
        } else {
          sraw[r][k][0] = __ldg(static_cast<const uint8_t*>(scales) + srow + j / kBc);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = i0 + r * kRowLanesY;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) {
        const int64_t j = span0 + k * 32 * kC + lane * kC;
        if (i >= M || j >= N) continue;
        float v[kC];
#pragma unroll
        for (int p = 0; p < kC / 2; ++p) {
          float s0, s1;
          if constexpr (kBc == 1) {
            s0 = e8m0_to_float((sraw[r][k][(2 * p) / 4] >> (8 * ((2 * p) % 4))) & 0xffu);
            s1 = e8m0_to_float((sraw[r][k][(2 * p + 1) / 4] >> (8 * ((2 * p + 1) % 4))) & 0xffu);
          } else if constexpr (kFp32Scale) {
            s0 = s1 = __uint_as_float(sraw[r][k][0]);
          } else {
            s0 = s1 = e8m0_to_float(sraw[r][k][0]);
          }
          const float2 f = e4m3x2_to_float2(code[r][k][p / 2] >> (16 * (p % 2)));
          v[2 * p] = __fmul_rn(f.x, s0);
          v[2 * p + 1] = __fmul_rn(f.y, s1);
        }
        TOut* o = out + i * N + j;
        if constexpr (kAligned) {
          if constexpr (sizeof(TOut) == 4)
            store16(o, __float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
          else
            store16(o, pack_out2<TOut>(v[0], v[1]), pack_out2<TOut>(v[2], v[3]), pack_out2<TOut>(v[4], v[5]),
                    pack_out2<TOut>(v[6], v[7]));
        } else {
#pragma unroll
          for (int e = 0; e < kC; ++e)
            if (j + e < N) o[e] = from_float<TOut>(v[e]);
        }
      }
    }
  }
}

}  // namespace epx::cuda::quant
