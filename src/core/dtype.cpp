// Exact conversions. Every narrow format is encoded by one routine: the magnitude is split into a
// power-of-two quantum for its binade (or the subnormal quantum) and rounded half to even; the carry
// from rounding up to the next binade falls out of the integer code. Overflow and NaN policies
// differ per format and are applied after. The rounding is done by hand rather than with
// nearbyint/rint, which follow the caller's fenv rounding mode: the hardware cvt.rn instructions
// ignore that mode, so the oracle must too.
#include "epx/dtype.h"

#include <cmath>
#include <cstring>

#include "epx/error.h"

namespace epx {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kBF16: case DType::kF16: return 2;
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF64: case DType::kI64: return 8;
    case DType::kF8E4M3: case DType::kF8E5M2: case DType::kE8M0: case DType::kU8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16: return "bf16";
    case DType::kF16: return "fp16";
    case DType::kF32: return "fp32";
    case DType::kF64: return "fp64";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kF8E4M3: return "fp8_e4m3";
    case DType::kF8E5M2: return "fp8_e5m2";
    case DType::kE8M0: return "e8m0";
    case DType::kU8: return "uint8";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32, DType::kF64, DType::kI32, DType::kI64, DType::kF8E4M3,
                  DType::kF8E5M2, DType::kE8M0, DType::kU8})
    if (name == dtype_name(t)) return t;
  throw Error(Status::kInvalidArgument,
              "epx::parse_dtype: unknown dtype '" + name +
                  "', expected one of bf16, fp16, fp32, fp64, int32, int64, fp8_e4m3, fp8_e5m2, e8m0, uint8");
}

bool is_floating(DType t) { return !is_integer(t) && t != DType::kU8; }
bool is_integer(DType t) { return t == DType::kI32 || t == DType::kI64; }

namespace {

uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// v >= 0 and small (< 2^53) to the nearest integer, ties to even, whatever fesetround() says.
// floor and the subtraction are exact for such v, so no step depends on the rounding mode.
double round_half_even(double v) {
  double f = std::floor(v);
  double r = v - f;
  if (r > 0.5 || (r == 0.5 && std::fmod(f, 2.0) != 0)) f += 1;
  return f;
}

// Code (exponent field << M | mantissa) of the finite magnitude a >= 0 in a format with M mantissa
// bits and exponent bias B, rounded to nearest even; may exceed the format's largest code.
uint32_t encode_magnitude(double a, int M, int B) {
  if (a == 0) return 0;
  int e2 = 0;
  std::frexp(a, &e2);
  int unbiased = e2 - 1;  // a in [2^unbiased, 2^(unbiased+1))
  if (unbiased < 1 - B) {  // subnormal binade: quantum 2^(1-B-M); code == 2^M is the smallest normal
    double q = round_half_even(std::ldexp(a, M + B - 1));
    return static_cast<uint32_t>(q);
  }
  double q = round_half_even(std::ldexp(a, M - unbiased));  // in [2^M, 2^(M+1)]
  return (static_cast<uint32_t>(unbiased + B) << M) + static_cast<uint32_t>(q) - (1u << M);
}

double decode_magnitude(uint32_t code, int M, int B) {
  uint32_t e = code >> M, m = code & ((1u << M) - 1);
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - B - M);
  return std::ldexp(static_cast<double>((1u << M) | m), static_cast<int>(e) - B - M);
}

}  // namespace

uint16_t float_to_bf16_bits(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // canonical NaN, as cvt.rn.bf16.f32
  u += 0x7fffu + ((u >> 16) & 1u);                      // round half to even; overflow carries into inf
  return static_cast<uint16_t>(u >> 16);
}

float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_f16_bits(float x) {
  uint32_t u = float_bits(x);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(x)) return 0x7fff;  // canonical NaN, as cvt.rn.f16.f32
  if (std::isinf(x)) return sign | 0x7c00;
  uint32_t code = encode_magnitude(std::fabs(static_cast<double>(x)), 10, 15);
  if (code > 0x7bffu) return sign | 0x7c00;  // rounds past 65504: inf
  return sign | static_cast<uint16_t>(code);
}

float f16_bits_to_float(uint16_t b) {
  float sign = (b & 0x8000) ? -1.0f : 1.0f;
  uint32_t code = b & 0x7fffu;
  if ((code & 0x7c00u) == 0x7c00u) return (code & 0x3ffu) ? std::nanf("") : sign * INFINITY;
  return sign * static_cast<float>(decode_magnitude(code, 10, 15));
}

uint8_t float_to_e4m3_bits(float x, Saturation sat) {
  if (std::isnan(x)) return 0x7f;
  uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isinf(x)) return sat == Saturation::kSatFinite ? (sign | 0x7e) : (sign | 0x7f);
  uint32_t code = encode_magnitude(std::fabs(static_cast<double>(x)), 3, 7);
  if (code > 0x7eu) return sat == Saturation::kSatFinite ? (sign | 0x7e) : (sign | 0x7f);
  return sign | static_cast<uint8_t>(code);
}

float e4m3_bits_to_float(uint8_t b) {
  float sign = (b & 0x80) ? -1.0f : 1.0f;
  uint32_t code = b & 0x7fu;
  if (code == 0x7fu) return std::nanf("");
  return sign * static_cast<float>(decode_magnitude(code, 3, 7));
}

uint8_t float_to_e5m2_bits(float x, Saturation sat) {
  if (std::isnan(x)) return 0x7f;
  uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isinf(x)) return sat == Saturation::kSatFinite ? (sign | 0x7b) : (sign | 0x7c);
  uint32_t code = encode_magnitude(std::fabs(static_cast<double>(x)), 2, 15);
  if (code > 0x7bu) return sat == Saturation::kSatFinite ? (sign | 0x7b) : (sign | 0x7c);
  return sign | static_cast<uint8_t>(code);
}

float e5m2_bits_to_float(uint8_t b) {
  float sign = (b & 0x80) ? -1.0f : 1.0f;
  uint32_t code = b & 0x7fu;
  if ((code & 0x7cu) == 0x7cu) return (code & 0x3u) ? std::nanf("") : sign * INFINITY;
  return sign * static_cast<float>(decode_magnitude(code, 2, 15));
}

uint8_t float_to_e8m0_bits(float x, E8M0Rounding mode) {
  if (!std::isfinite(x)) return 0xff;
  double a = std::fabs(static_cast<double>(x));
  if (a == 0) return 0x00;
  int e2 = 0;
  double f = std::frexp(a, &e2);  // a = f * 2^e2, f in [0.5, 1)
  int e = e2 - 1;                 // floor(log2 a)
  if (mode == E8M0Rounding::kCeil && f != 0.5) e += 1;
  int biased = e + 127;
  if (biased < 0) biased = 0;
  if (biased > 254) biased = 254;
  return static_cast<uint8_t>(biased);
}

float e8m0_bits_to_float(uint8_t b) {
  if (b == 0xff) return std::nanf("");
  return std::ldexp(1.0f, static_cast<int>(b) - 127);
}

double round_to_dtype(double x, DType t) {
  switch (t) {
    case DType::kF64: return x;
    case DType::kF32: return static_cast<float>(x);
    case DType::kBF16: return bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(x)));
    case DType::kF16: return f16_bits_to_float(float_to_f16_bits(static_cast<float>(x)));
    case DType::kF8E4M3: return e4m3_bits_to_float(float_to_e4m3_bits(static_cast<float>(x)));
    case DType::kF8E5M2: return e5m2_bits_to_float(float_to_e5m2_bits(static_cast<float>(x)));
    case DType::kE8M0: return e8m0_bits_to_float(float_to_e8m0_bits(static_cast<float>(x)));
    case DType::kI32: return static_cast<double>(static_cast<int32_t>(x));
    case DType::kI64: return static_cast<double>(static_cast<int64_t>(x));
    case DType::kU8: return static_cast<double>(static_cast<uint8_t>(x));
  }
  return x;
}

double load_as_double(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kBF16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kF16: return f16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kF64: return static_cast<const double*>(base)[i];
    case DType::kI32: return static_cast<const int32_t*>(base)[i];
    case DType::kI64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DType::kF8E4M3: return e4m3_bits_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::kF8E5M2: return e5m2_bits_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::kE8M0: return e8m0_bits_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::kU8: return static_cast<const uint8_t*>(base)[i];
  }
  return 0;
}

void store_from_double(void* base, DType t, int64_t i, double v) {
  switch (t) {
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(static_cast<float>(v)); break;
    case DType::kF16: static_cast<uint16_t*>(base)[i] = float_to_f16_bits(static_cast<float>(v)); break;
    case DType::kF32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case DType::kF64: static_cast<double*>(base)[i] = v; break;
    case DType::kI32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); break;
    case DType::kI64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); break;
    case DType::kF8E4M3: static_cast<uint8_t*>(base)[i] = float_to_e4m3_bits(static_cast<float>(v)); break;
    case DType::kF8E5M2: static_cast<uint8_t*>(base)[i] = float_to_e5m2_bits(static_cast<float>(v)); break;
    case DType::kE8M0: static_cast<uint8_t*>(base)[i] = float_to_e8m0_bits(static_cast<float>(v)); break;
    case DType::kU8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); break;
  }
}

template <class T>
static void load_row_impl(const void* base, DType t, int64_t offset, int64_t n, T* out) {
  switch (t) {
    case DType::kF32: {
      const float* p = static_cast<const float*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(p[i]);
      return;
    }
    case DType::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(bf16_bits_to_float(p[i]));
      return;
    }
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(load_as_double(base, t, offset + i));
  }
}

template <class T>
static void store_row_impl(void* base, DType t, int64_t offset, int64_t n, const T* in) {
  switch (t) {
    case DType::kF32: {
      float* p = static_cast<float*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(in[i]);
      return;
    }
    case DType::kBF16: {
      uint16_t* p = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16_bits(static_cast<float>(in[i]));
      return;
    }
    default:
      for (int64_t i = 0; i < n; ++i) store_from_double(base, t, offset + i, static_cast<double>(in[i]));
  }
}

void load_row(const void* base, DType t, int64_t offset, int64_t n, double* out) { load_row_impl(base, t, offset, n, out); }
void load_row(const void* base, DType t, int64_t offset, int64_t n, float* out) { load_row_impl(base, t, offset, n, out); }
void store_row(void* base, DType t, int64_t offset, int64_t n, const double* in) { store_row_impl(base, t, offset, n, in); }
void store_row(void* base, DType t, int64_t offset, int64_t n, const float* in) { store_row_impl(base, t, offset, n, in); }

}  // namespace epx
