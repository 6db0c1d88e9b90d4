// Element types and exact host conversions.
//
// Every narrow float type is converted with round-to-nearest-even on the way down, exactly as the
// hardware cvt.rn instructions do, so the CPU reference and the GPU kernels agree bit for bit. Like
// the hardware, the float-to-narrow conversions ignore the host's fenv rounding mode (the
// double-to-float step of the double forms below is an ordinary C++ cast and does not).
// - bf16 / fp16: IEEE-style; overflow goes to +-inf (fp16: 65520, the tie above the largest value
//   65504, already rounds to inf); NaN becomes the canonical 0x7FFF, as the hardware's
//   cvt.rn.{bf16,f16}.f32 does.
// - fp8 e4m3 (OCP "E4M3FN"): bias 7, no infinities, one NaN pattern per sign (S.1111.111), max 448,
//   subnormals in steps of 2^-9. Saturating conversion (the default, PTX .satfinite) clamps finite
//   overflow AND +-inf to +-448; the non-saturating one turns anything that rounds above 448 into
//   NaN (S.1111.111, keeping the sign). 464, the tie between 448 and the absent 480, rounds to 448
//   in both modes.
// - fp8 e5m2: bias 15, IEEE-like with infinities (0x7C), NaN 0x7D..0x7F, max 57344. Saturating
//   clamps finite overflow and +-inf to +-57344; the non-saturating one rounds overflow to +-inf.
// - e8m0 (OCP MX scale): an unsigned power of two 2^(bits-127), 0xFF = NaN, no zero, no sign.
//   Conversion takes a rounding mode because the two conventions in use differ (the MX spec floors
//   the exponent, NVIDIA's recipe rounds up so that the scaled block never saturates).
// NaN inputs to fp8 give the canonical NaN 0x7F (e4m3) / 0x7F (e5m2), whatever their sign.
// Doubles reach a narrow format through fp32 (round_to_dtype, store_from_double, store_row), like
// a GPU kernel that computes in fp32 and then converts: that is two roundings, not one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace epx {

enum class DType : uint8_t {
  kBF16,
  kF16,
  kF32,
  kF64,  // reference only: finite-difference gradient checks
  kI32,
  kI64,
  kF8E4M3,
  kF8E5M2,
  kE8M0,
  kU8,  // raw bytes (opaque payloads, flags)
};

/// Bytes per element.
size_t dtype_size(DType t);
/// Lower-case name ("bf16", "fp8_e4m3", ...), stable: used in JSON output and error messages.
const char* dtype_name(DType t);
/// Inverse of dtype_name; throws epx::Error naming the accepted spellings.
DType parse_dtype(const std::string& name);
bool is_floating(DType t);
bool is_integer(DType t);

enum class Saturation : uint8_t { kSatFinite, kNoSat };
enum class E8M0Rounding : uint8_t { kFloor, kCeil };

// ---- bit-exact host conversions --------------------------------------------------------------
uint16_t float_to_bf16_bits(float x);
float bf16_bits_to_float(uint16_t b);
uint16_t float_to_f16_bits(float x);
float f16_bits_to_float(uint16_t b);
uint8_t float_to_e4m3_bits(float x, Saturation sat = Saturation::kSatFinite);
float e4m3_bits_to_float(uint8_t b);
uint8_t float_to_e5m2_bits(float x, Saturation sat = Saturation::kSatFinite);
float e5m2_bits_to_float(uint8_t b);
/// Power-of-two scale 2^e for |x| (sign ignored); x = 0 gives the smallest scale 2^-127,
/// NaN/inf give 0xFF (NaN); results are clamped to [2^-127, 2^127].
uint8_t float_to_e8m0_bits(float x, E8M0Rounding mode = E8M0Rounding::kCeil);
float e8m0_bits_to_float(uint8_t b);

/// Rounds x to a value representable in `t` (identity for fp64; narrow floats via fp32, see above;
/// fp8 saturating, e8m0 kCeil); integers truncate toward zero. Used by the reference to model the
/// storage precision of an op's output.
double round_to_dtype(double x, DType t);

/// Reads element i of a typed array as double / writes it with round-to-nearest-even.
double load_as_double(const void* base, DType t, int64_t i);
void store_from_double(void* base, DType t, int64_t i, double v);
/// Bulk forms of the two above (a double reaches a narrow format through fp32, like the GPU) for n contiguous elements starting at element `offset`.
void load_row(const void* base, DType t, int64_t offset, int64_t n, double* out);
void load_row(const void* base, DType t, int64_t offset, int64_t n, float* out);
void store_row(void* base, DType t, int64_t offset, int64_t n, const double* in);
void store_row(void* base, DType t, int64_t offset, int64_t n, const float* in);

}  // namespace epx
