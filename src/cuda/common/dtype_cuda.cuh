// Element types on the device: load as fp32, store with round-to-nearest-even, exactly as the host
// conversions in epx/dtype.h (the hardware cvt instructions are the definition both follow).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace epx::cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

/// The bf16 in the low (high = false) or high half of a 32-bit word, widened exactly to fp32: one
/// shift or mask, where converting the halves as __nv_bfloat16 values lets the compiler first copy
/// them into registers of their own.
__device__ __forceinline__ float bf16_word_half_to_float(uint32_t w, bool high) {
  return __uint_as_float(high ? (w & 0xffff0000u) : (w << 16));
}

template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

/// W consecutive elements moved as one access (up to 16 bytes; wider ones split into 16-byte
/// accesses): memory-bound kernels keep more bytes in flight per thread this way. The address
/// must be aligned to the whole width.
template <class T, int W>
struct alignas(W * sizeof(T)) Lanes {
  T v[W];
};
template <class T, int W>
__device__ __forceinline__ Lanes<T, W> load_lanes(const T* p) {
  return *reinterpret_cast<const Lanes<T, W>*>(p);
}
template <class T, int W>
__device__ __forceinline__ void store_lanes(T* p, const Lanes<T, W>& x) {
  *reinterpret_cast<Lanes<T, W>*>(p) = x;
}

/// Saturating RNE conversion to e4m3 (cvt.rn.satfinite.e4m3x2.f32): NaN -> 0x7F, +-inf -> +-448.
__device__ __forceinline__ uint8_t float_to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}
__device__ __forceinline__ float e4m3_to_float(uint8_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
  return __half2float(__half(h));
}

/// Floats as unsigned keys whose integer order is the float order (NaN excluded by the caller).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

}  // namespace epx::cuda
