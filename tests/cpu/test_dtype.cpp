// Tests of the exact conversions (src/core/dtype.cpp) against the formats' specifications, written
// independently of the implementation: every format is described here only by its field widths,
// bias and special-value rule, decoded with the textbook formula
//   normal    (-1)^s * (1 + m / 2^M) * 2^(e - bias)
//   subnormal (-1)^s * m * 2^(1 - bias - M)            (e == 0)
// and encoded by a nearest-value search over that decoded table, ties going to the even code
// (the code's last bit is the mantissa's last bit). One code past the largest finite value is kept
// in the table as an "overflow" entry, so that the tie between the maximum and the next, absent,
// value is decided by the same rule as any other tie: e4m3's 464 goes down to 448 (0x7E is even),
// fp16's 65520 goes up to inf (0x7BFF is odd). fp16 is also compared with the compiler's
// _Float16 conversion where g++ provides it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfenv>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "epx/dtype.h"
#include "epx/error.h"

namespace epx {
namespace {

uint32_t fbits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float bits_to_f(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
// Same value and same sign of zero (NaN == NaN).
bool same_float(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

// ---- the formats as the specifications write them --------------------------------------------

enum class Special {
  kIeee,   // all-ones exponent: mantissa 0 = inf, otherwise NaN (bf16, fp16, e5m2)
  kFinite  // OCP E4M3FN: only S.1111.111 is NaN, no inf
};

struct Format {
  int ebits, mbits, bias;
  Special special;
  uint32_t max_code;    // largest finite magnitude code
  uint32_t nan_bits;    // canonical NaN the encoder must produce
  uint32_t sign_bit;
};

const Format kBF16{8, 7, 127, Special::kIeee, 0x7F7F, 0x7FFF, 0x8000};
const Format kF16{5, 10, 15, Special::kIeee, 0x7BFF, 0x7FFF, 0x8000};
const Format kE4M3{4, 3, 7, Special::kFinite, 0x7E, 0x7F, 0x80};
const Format kE5M2{5, 2, 15, Special::kIeee, 0x7B, 0x7F, 0x80};

// Value of a code read as if every exponent field were a normal or subnormal number.
double formula(const Format& f, uint32_t code) {
  uint32_t e = code >> f.mbits, m = code & ((1u << f.mbits) - 1);
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - f.bias - f.mbits);
  return std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -f.mbits), static_cast<int>(e) - f.bias);
}

double spec_decode(const Format& f, uint32_t bits) {
  const double sign = (bits & f.sign_bit) ? -1.0 : 1.0;
  const uint32_t code = bits & (f.sign_bit - 1);
  const uint32_t e = code >> f.mbits, m = code & ((1u << f.mbits) - 1);
  const uint32_t e_ones = (1u << f.ebits) - 1, m_ones = (1u << f.mbits) - 1;
  if (f.special == Special::kIeee && e == e_ones) return m ? NAN : sign * INFINITY;
  if (f.special == Special::kFinite && e == e_ones && m == m_ones) return NAN;
  return sign * formula(f, code);
}

// Ascending finite magnitudes (code 0 .. max_code) plus the overflow entry max_code + 1.
struct Table {
  std::vector<double> value;
  uint32_t overflow_code;
};

Table make_table(const Format& f) {
  Table t;
  for (uint32_t c = 0; c <= f.max_code + 1; ++c) t.value.push_back(formula(f, c));
  t.overflow_code = f.max_code + 1;
  return t;
}

// Nearest code to the magnitude a >= 0, ties to the even code; overflow_code means "past max".
uint32_t nearest_code(const Table& t, double a) {
  if (a >= t.value.back()) return t.overflow_code;
  size_t hi = std::upper_bound(t.value.begin(), t.value.end(), a) - t.value.begin();
  size_t lo = hi - 1;
  if (t.value[lo] == a) return static_cast<uint32_t>(lo);
  const double mid = (t.value[lo] + t.value[hi]) / 2;  // exact: one bit more than either
  if (a < mid) return static_cast<uint32_t>(lo);
  if (a > mid) return static_cast<uint32_t>(hi);
  return static_cast<uint32_t>(lo % 2 == 0 ? lo : hi);
}

// What the encoder must return for x, from the table search and the format's policies.
uint32_t expected_bits(const Format& f, const Table& t, float x, Saturation sat) {
  if (std::isnan(x)) return f.nan_bits;
  const uint32_t sign = std::signbit(x) ? f.sign_bit : 0;
  uint32_t code = std::isinf(x) ? t.overflow_code : nearest_code(t, std::fabs(static_cast<double>(x)));
  if (code > f.max_code) {
    if (f.special == Special::kIeee && f.sign_bit == 0x8000) return sign | t.overflow_code;  // 16-bit: inf
    if (sat == Saturation::kSatFinite) return sign | f.max_code;
    return sign | (f.special == Special::kFinite ? 0x7Fu : 0x7Cu);  // e4m3 NaN, e5m2 inf
  }
  return sign | code;
}

uint32_t encode(const Format& f, float x, Saturation sat) {
  if (&f == &kBF16) return float_to_bf16_bits(x);
  if (&f == &kF16) return float_to_f16_bits(x);
  if (&f == &kE4M3) return float_to_e4m3_bits(x, sat);
  return float_to_e5m2_bits(x, sat);
}

float decode(const Format& f, uint32_t b) {
  if (&f == &kBF16) return bf16_bits_to_float(static_cast<uint16_t>(b));
  if (&f == &kF16) return f16_bits_to_float(static_cast<uint16_t>(b));
  if (&f == &kE4M3) return e4m3_bits_to_float(static_cast<uint8_t>(b));
  return e5m2_bits_to_float(static_cast<uint8_t>(b));
}

uint32_t num_patterns(const Format& f) { return f.sign_bit << 1; }

// Checks decode of every bit pattern against the formula; returns the number of mismatches.
int check_decode_all(const Format& f) {
  int bad = 0;
  for (uint32_t b = 0; b < num_patterns(f); ++b) {
    const double want = spec_decode(f, b);
    const float got = decode(f, b);
    if (!same_float(got, want)) {
      if (++bad <= 5) ADD_FAILURE() << "decode(0x" << std::hex << b << ") = " << got << ", expected " << want;
    }
  }
  return bad;
}

// Every pattern decoded and re-encoded gives itself; NaN patterns give the canonical NaN.
int check_round_trip_all(const Format& f, Saturation sat) {
  int bad = 0;
  for (uint32_t b = 0; b < num_patterns(f); ++b) {
    const float v = decode(f, b);
    uint32_t want = std::isnan(v) ? f.nan_bits : b;
    if (std::isinf(v) && sat == Saturation::kSatFinite && f.sign_bit == 0x80) want = (b & f.sign_bit) | f.max_code;
    const uint32_t got = encode(f, v, sat);
    if (got != want && ++bad <= 5)
      ADD_FAILURE() << "encode(decode(0x" << std::hex << b << ")) = 0x" << got << ", expected 0x" << want;
  }
  return bad;
}

// The exact midpoint between every pair of adjacent finite magnitudes (and between max and the
// overflow entry), its two float neighbours, in both signs, against the table search.
int check_midpoints(const Format& f, Saturation sat) {
  const Table t = make_table(f);
  int bad = 0, ties = 0;
  for (size_t i = 0; i + 1 < t.value.size(); ++i) {
    const double mid_d = (t.value[i] + t.value[i + 1]) / 2;
    const float mid = static_cast<float>(mid_d);
    if (static_cast<double>(mid) != mid_d) {
      ADD_FAILURE() << "midpoint " << mid_d << " is not a float";
      return 1;
    }
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)})
      for (float s : {1.0f, -1.0f}) {
        const float v = s * x;
        const uint32_t want = expected_bits(f, t, v, sat), got = encode(f, v, sat);
        if (got != want && ++bad <= 5)
          ADD_FAILURE() << "encode(" << v << ") = 0x" << std::hex << got << ", expected 0x" << want;
      }
    // The tie itself must land on the even code, whichever neighbour that is.
    const uint32_t tie = encode(f, mid, sat) & (f.sign_bit - 1);
    const uint32_t even = (i % 2 == 0) ? static_cast<uint32_t>(i) : static_cast<uint32_t>(i + 1);
    if (even <= f.max_code) {
      if (tie != even && ++bad <= 5)
        ADD_FAILURE() << "tie " << mid << " gave code 0x" << std::hex << tie << ", expected even 0x" << even;
      ++ties;
    }
  }
  EXPECT_GT(ties, 0);
  return bad;
}

// Random floats: uniform bit patterns over all floats, plus log-uniform magnitudes over the range
// the format resolves (where rounding is interesting), against the table search.
int check_random(const Format& f, Saturation sat, int lo_exp, int hi_exp, int n, uint32_t seed) {
  const Table t = make_table(f);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_real_distribution<double> expo(lo_exp, hi_exp);
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    float x = (i % 4 == 0) ? bits_to_f(any_bits(rng))
                           : static_cast<float>((rng() & 1 ? -1.0 : 1.0) * std::exp2(expo(rng)));
    const uint32_t want = expected_bits(f, t, x, sat), got = encode(f, x, sat);
    if (got != want && ++bad <= 5)
      ADD_FAILURE() << "encode(" << x << " = 0x" << std::hex << fbits(x) << ") = 0x" << got << ", expected 0x" << want;
  }
  return bad;
}

// ---- general -------------------------------------------------------------------------------

const DType kAllDTypes[] = {DType::kBF16, DType::kF16,    DType::kF32,    DType::kF64,  DType::kI32,
                            DType::kI64,  DType::kF8E4M3, DType::kF8E5M2, DType::kE8M0, DType::kU8};

TEST(DTypeInfo, SizesNamesAndParseRoundTrip) {
  const size_t sizes[] = {2, 2, 4, 8, 4, 8, 1, 1, 1, 1};
  const char* names[] = {"bf16", "fp16", "fp32", "fp64", "int32", "int64", "fp8_e4m3", "fp8_e5m2", "e8m0", "uint8"};
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(dtype_size(kAllDTypes[i]), sizes[i]) << names[i];
    EXPECT_STREQ(dtype_name(kAllDTypes[i]), names[i]);
    EXPECT_EQ(parse_dtype(names[i]), kAllDTypes[i]);
  }
  EXPECT_TRUE(is_integer(DType::kI32) && is_integer(DType::kI64));
  EXPECT_FALSE(is_integer(DType::kF32) || is_integer(DType::kU8) || is_integer(DType::kE8M0));
  EXPECT_TRUE(is_floating(DType::kBF16) && is_floating(DType::kF8E4M3) && is_floating(DType::kE8M0));
  EXPECT_FALSE(is_floating(DType::kU8) || is_floating(DType::kI64));
}

TEST(DTypeInfo, ParseDtypeRejectsUnknownNames) {
  for (const char* bad : {"", "BF16", "bfloat16", "fp8", "float32", "e4m3", " fp32"}) {
    try {
      parse_dtype(bad);
      ADD_FAILURE() << "parse_dtype('" << bad << "') did not throw";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      EXPECT_NE(msg.find("epx::parse_dtype"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::string("'") + bad + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("bf16, fp16, fp32"), std::string::npos) << msg;
    }
  }
}

// ---- bf16 ----------------------------------------------------------------------------------

TEST(DTypeBF16, AllPatternsDecodeToSpec) { EXPECT_EQ(check_decode_all(kBF16), 0); }

TEST(DTypeBF16, AllPatternsRoundTrip) { EXPECT_EQ(check_round_trip_all(kBF16, Saturation::kSatFinite), 0); }

TEST(DTypeBF16, MidpointsRoundToEven) {
  EXPECT_EQ(check_midpoints(kBF16, Saturation::kSatFinite), 0);
  // By hand: bf16 has 8 significant bits, so between 1 and 2 the step is 2^-7.
  EXPECT_EQ(float_to_bf16_bits(1.0f + 0x1p-8f), 0x3F80);               // tie, 1.0 is even
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * 0x1p-8f), 0x3F82);           // tie, 1 + 2^-6 is even
  EXPECT_EQ(float_to_bf16_bits(std::nextafter(1.0f + 0x1p-8f, 2.0f)), 0x3F81);
  EXPECT_EQ(float_to_bf16_bits(-(1.0f + 0x1p-8f)), 0xBF80);
}

TEST(DTypeBF16, RandomFloatsMatchNearestSearch) {
  EXPECT_EQ(check_random(kBF16, Saturation::kSatFinite, -140, 128, 400000, 1), 0);
}

TEST(DTypeBF16, SpecialValues) {
  EXPECT_EQ(float_to_bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_TRUE(std::signbit(bf16_bits_to_float(0x8000)));
  EXPECT_EQ(float_to_bf16_bits(INFINITY), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(-INFINITY), 0xFF80);
  EXPECT_EQ(float_to_bf16_bits(FLT_MAX), 0x7F80);   // rounds past the largest bf16
  EXPECT_EQ(float_to_bf16_bits(-FLT_MAX), 0xFF80);
  EXPECT_EQ(float_to_bf16_bits(bits_to_f(0x7F7F7FFF)), 0x7F7F);  // just below the tie to inf
  EXPECT_EQ(float_to_bf16_bits(bits_to_f(0x7F7F8000)), 0x7F80);  // the tie: 0x7F7F is odd
  // NaNs of any sign and payload, quiet or signalling, become 0x7FFF (a plain truncation would
  // turn the signalling NaN 0x7F800001 into inf).
  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0x7F80FFFFu})
    EXPECT_EQ(float_to_bf16_bits(bits_to_f(nan)), 0x7FFF) << std::hex << nan;
  EXPECT_EQ(float_to_bf16_bits(bits_to_f(0x00000001)), 0x0000);  // float subnormals round in place
  EXPECT_EQ(float_to_bf16_bits(bits_to_f(0x00010000)), 0x0001);
}

// ---- fp16 ----------------------------------------------------------------------------------

TEST(DTypeF16, AllPatternsDecodeToSpec) { EXPECT_EQ(check_decode_all(kF16), 0); }

TEST(DTypeF16, AllPatternsRoundTrip) { EXPECT_EQ(check_round_trip_all(kF16, Saturation::kSatFinite), 0); }

TEST(DTypeF16, MidpointsRoundToEven) {
  EXPECT_EQ(check_midpoints(kF16, Saturation::kSatFinite), 0);
  EXPECT_EQ(float_to_f16_bits(1.0f + 0x1p-11f), 0x3C00);      // tie, 1.0 is even
  EXPECT_EQ(float_to_f16_bits(1.0f + 3 * 0x1p-11f), 0x3C02);  // tie, 1 + 2^-9 is even
  EXPECT_EQ(float_to_f16_bits(2049.0f), 0x6800);             // tie between 2048 and 2050
  EXPECT_EQ(float_to_f16_bits(2051.0f), 0x6802);             // tie between 2050 and 2052
}

TEST(DTypeF16, Overflow) {
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(f16_bits_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(float_to_f16_bits(65519.99f), 0x7BFF);
  EXPECT_EQ(float_to_f16_bits(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(float_to_f16_bits(65520.0f), 0x7C00);  // the tie with 2^16: 0x7BFF is odd, so inf
  EXPECT_EQ(float_to_f16_bits(-65520.0f), 0xFC00);
  EXPECT_EQ(float_to_f16_bits(1e30f), 0x7C00);
  EXPECT_EQ(float_to_f16_bits(-FLT_MAX), 0xFC00);
  EXPECT_EQ(float_to_f16_bits(INFINITY), 0x7C00);
  EXPECT_EQ(float_to_f16_bits(-INFINITY), 0xFC00);
}

TEST(DTypeF16, Subnormals) {
  EXPECT_EQ(float_to_f16_bits(0x1p-24f), 0x0001);                 // smallest subnormal
  EXPECT_EQ(f16_bits_to_float(0x0001), 0x1p-24f);
  EXPECT_EQ(float_to_f16_bits(0x1p-25f), 0x0000);                 // half of it: tie to 0
  EXPECT_EQ(float_to_f16_bits(-0x1p-25f), 0x8000);                // ... keeping the sign
  EXPECT_EQ(float_to_f16_bits(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  EXPECT_EQ(float_to_f16_bits(3 * 0x1p-25f), 0x0002);             // tie between 1 and 2 quanta
  EXPECT_EQ(float_to_f16_bits(5 * 0x1p-25f), 0x0002);             // tie between 2 and 3 quanta
  EXPECT_EQ(float_to_f16_bits(1023 * 0x1p-24f), 0x03FF);          // largest subnormal
  EXPECT_EQ(float_to_f16_bits(1023.5f * 0x1p-24f), 0x0400);       // tie into the first normal
  EXPECT_EQ(float_to_f16_bits(0x1p-14f), 0x0400);                 // smallest normal
  EXPECT_EQ(float_to_f16_bits(0x1p-30f), 0x0000);
  EXPECT_EQ(float_to_f16_bits(bits_to_f(0x80000001)), 0x8000);
}

TEST(DTypeF16, SignedZerosAndNaN) {
  EXPECT_EQ(float_to_f16_bits(0.0f), 0x0000);
  EXPECT_EQ(float_to_f16_bits(-0.0f), 0x8000);
  EXPECT_TRUE(std::signbit(f16_bits_to_float(0x8000)));
  EXPECT_EQ(f16_bits_to_float(0x8000), 0.0f);
  for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu})
    EXPECT_EQ(float_to_f16_bits(bits_to_f(nan)), 0x7FFF) << std::hex << nan;
  EXPECT_TRUE(std::isnan(f16_bits_to_float(0x7C01)));
  EXPECT_TRUE(std::isnan(f16_bits_to_float(0xFE00)));
}

TEST(DTypeF16, RandomFloatsMatchNearestSearch) {
  EXPECT_EQ(check_random(kF16, Saturation::kSatFinite, -27, 17, 400000, 2), 0);
}

#if defined(__FLT16_MAX__)
// The compiler's _Float16 conversion (libgcc / F16C on x86-64) as an independent implementation:
// a sweep over float bit patterns with a prime stride, every fp16 midpoint and its neighbours.
TEST(DTypeF16, MatchesCompilerFloat16) {
  auto compiler = [](float x) {
    _Float16 h = static_cast<_Float16>(x);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return std::isnan(x) ? uint16_t{0x7FFF} : b;
  };
  int bad = 0;
  long checked = 0;
  auto check = [&](float x) {
    ++checked;
    const uint16_t want = compiler(x), got = float_to_f16_bits(x);
    if (got != want && ++bad <= 5)
      ADD_FAILURE() << "float_to_f16_bits(" << x << ") = 0x" << std::hex << got << ", _Float16 gives 0x" << want;
  };
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 509) check(bits_to_f(static_cast<uint32_t>(u)));
  for (uint32_t b = 0; b < 0x7C00; ++b) {
    const float lo = f16_bits_to_float(static_cast<uint16_t>(b));
    const float hi = b + 1 < 0x7C00 ? f16_bits_to_float(static_cast<uint16_t>(b + 1)) : 65536.0f;
    const float mid = (lo + hi) / 2;
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      check(x);
      check(-x);
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(checked, 8000000);
}
#endif

// ---- fp8 e4m3 ------------------------------------------------------------------------------

TEST(DTypeE4M3, DecodeAllPatterns) {
  EXPECT_EQ(check_decode_all(kE4M3), 0);
  EXPECT_EQ(e4m3_bits_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_bits_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3_bits_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_bits_to_float(0x08), 0x1p-6f);       // smallest normal
  EXPECT_EQ(e4m3_bits_to_float(0x01), 0x1p-9f);       // smallest subnormal
  EXPECT_EQ(e4m3_bits_to_float(0x07), 7 * 0x1p-9f);   // largest subnormal
  EXPECT_EQ(e4m3_bits_to_float(0x78), 256.0f);        // 0x78 is a number in E4M3FN, not inf
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(0xFF)));
  EXPECT_TRUE(std::signbit(e4m3_bits_to_float(0x80)));
}

TEST(DTypeE4M3, RoundTripAllPatterns) {
  EXPECT_EQ(check_round_trip_all(kE4M3, Saturation::kSatFinite), 0);
  EXPECT_EQ(check_round_trip_all(kE4M3, Saturation::kNoSat), 0);
}

TEST(DTypeE4M3, MidpointsRoundToEven) {
  EXPECT_EQ(check_midpoints(kE4M3, Saturation::kSatFinite), 0);
  EXPECT_EQ(check_midpoints(kE4M3, Saturation::kNoSat), 0);
  EXPECT_EQ(float_to_e4m3_bits(1.0625f), 0x38);  // tie between 1 and 1.125: 1 is even
  EXPECT_EQ(float_to_e4m3_bits(1.1875f), 0x3A);  // tie between 1.125 and 1.25: 1.25 is even
  EXPECT_EQ(float_to_e4m3_bits(-1.1875f), 0xBA);
}

TEST(DTypeE4M3, RandomFloatsMatchNearestSearch) {
  EXPECT_EQ(check_random(kE4M3, Saturation::kSatFinite, -12, 10, 200000, 3), 0);
  EXPECT_EQ(check_random(kE4M3, Saturation::kNoSat, -12, 10, 200000, 4), 0);
}

TEST(DTypeE4M3, Saturation) {
  const float above_tie = std::nextafter(464.0f, INFINITY);
  EXPECT_EQ(float_to_e4m3_bits(448.0f, Saturation::kSatFinite), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(448.0f, Saturation::kNoSat), 0x7E);
  // 464 is the tie between 448 (0x7E, even) and the absent 480 (0x7F): it stays finite either way.
  EXPECT_EQ(float_to_e4m3_bits(464.0f, Saturation::kSatFinite), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(464.0f, Saturation::kNoSat), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(-464.0f, Saturation::kNoSat), 0xFE);
  EXPECT_EQ(float_to_e4m3_bits(above_tie, Saturation::kSatFinite), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(above_tie, Saturation::kNoSat), 0x7F);
  EXPECT_EQ(float_to_e4m3_bits(-above_tie, Saturation::kSatFinite), 0xFE);
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(float_to_e4m3_bits(-above_tie, Saturation::kNoSat))));
  EXPECT_EQ(float_to_e4m3_bits(480.0f, Saturation::kSatFinite), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(1e30f, Saturation::kSatFinite), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(FLT_MAX, Saturation::kNoSat), 0x7F);
  EXPECT_EQ(float_to_e4m3_bits(INFINITY, Saturation::kSatFinite), 0x7E);
  EXPECT_EQ(float_to_e4m3_bits(-INFINITY, Saturation::kSatFinite), 0xFE);
  EXPECT_EQ(float_to_e4m3_bits(INFINITY, Saturation::kNoSat), 0x7F);
  EXPECT_TRUE(std::isnan(e4m3_bits_to_float(float_to_e4m3_bits(-INFINITY, Saturation::kNoSat))));
  EXPECT_EQ(float_to_e4m3_bits(1e30f), 0x7E) << "the default must be kSatFinite";
}

TEST(DTypeE4M3, NaNAndSignedZero) {
  for (Saturation s : {Saturation::kSatFinite, Saturation::kNoSat})
    for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u})
      EXPECT_EQ(float_to_e4m3_bits(bits_to_f(nan), s), 0x7F) << std::hex << nan;
  EXPECT_EQ(float_to_e4m3_bits(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3_bits(-0.0f), 0x80);
  EXPECT_EQ(float_to_e4m3_bits(-0x1p-11f), 0x80);  // underflow keeps the sign
}

TEST(DTypeE4M3, Subnormals) {
  EXPECT_EQ(float_to_e4m3_bits(0x1p-9f), 0x01);
  EXPECT_EQ(float_to_e4m3_bits(0x1p-10f), 0x00);                           // tie to 0
  EXPECT_EQ(float_to_e4m3_bits(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3_bits(3 * 0x1p-10f), 0x02);                       // tie between 1 and 2
  EXPECT_EQ(float_to_e4m3_bits(5 * 0x1p-10f), 0x02);                       // tie between 2 and 3
  EXPECT_EQ(float_to_e4m3_bits(-5 * 0x1p-9f), 0x85);
  EXPECT_EQ(float_to_e4m3_bits(15 * 0x1p-10f), 0x08);                      // tie 7 | 8: into the normals
  EXPECT_EQ(float_to_e4m3_bits(0.01f), 0x05);                              // 5.12 quanta
}

// ---- fp8 e5m2 ------------------------------------------------------------------------------

TEST(DTypeE5M2, DecodeAllPatterns) {
  EXPECT_EQ(check_decode_all(kE5M2), 0);
  EXPECT_EQ(e5m2_bits_to_float(0x7B), 57344.0f);
  EXPECT_EQ(e5m2_bits_to_float(0x3C), 1.0f);
  EXPECT_EQ(e5m2_bits_to_float(0x01), 0x1p-16f);
  EXPECT_EQ(e5m2_bits_to_float(0x04), 0x1p-14f);
  EXPECT_EQ(e5m2_bits_to_float(0x7C), INFINITY);
  EXPECT_EQ(e5m2_bits_to_float(0xFC), -INFINITY);
  for (uint8_t b : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(e5m2_bits_to_float(b))) << int(b);
}

TEST(DTypeE5M2, RoundTripAllPatterns) {
  EXPECT_EQ(check_round_trip_all(kE5M2, Saturation::kNoSat), 0);
  EXPECT_EQ(check_round_trip_all(kE5M2, Saturation::kSatFinite), 0);
}

TEST(DTypeE5M2, MidpointsRoundToEven) {
  EXPECT_EQ(check_midpoints(kE5M2, Saturation::kSatFinite), 0);
  EXPECT_EQ(check_midpoints(kE5M2, Saturation::kNoSat), 0);
  EXPECT_EQ(float_to_e5m2_bits(1.125f), 0x3C);  // tie between 1 and 1.25
  EXPECT_EQ(float_to_e5m2_bits(1.375f), 0x3E);  // tie between 1.25 and 1.5
}

TEST(DTypeE5M2, RandomFloatsMatchNearestSearch) {
  EXPECT_EQ(check_random(kE5M2, Saturation::kSatFinite, -19, 18, 200000, 5), 0);
  EXPECT_EQ(check_random(kE5M2, Saturation::kNoSat, -19, 18, 200000, 6), 0);
}

TEST(DTypeE5M2, SaturationAndSpecials) {
  // 61440 is the tie between 57344 (0x7B, odd) and 65536 (0x7C, even): it overflows.
  EXPECT_EQ(float_to_e5m2_bits(57344.0f, Saturation::kNoSat), 0x7B);
  EXPECT_EQ(float_to_e5m2_bits(std::nextafter(61440.0f, 0.0f), Saturation::kNoSat), 0x7B);
  EXPECT_EQ(float_to_e5m2_bits(61440.0f, Saturation::kNoSat), 0x7C);
  EXPECT_EQ(float_to_e5m2_bits(61440.0f, Saturation::kSatFinite), 0x7B);
  EXPECT_EQ(float_to_e5m2_bits(-1e20f, Saturation::kNoSat), 0xFC);
  EXPECT_EQ(float_to_e5m2_bits(-1e20f, Saturation::kSatFinite), 0xFB);
  EXPECT_EQ(float_to_e5m2_bits(INFINITY, Saturation::kNoSat), 0x7C);
  EXPECT_EQ(float_to_e5m2_bits(-INFINITY, Saturation::kNoSat), 0xFC);
  EXPECT_EQ(float_to_e5m2_bits(INFINITY, Saturation::kSatFinite), 0x7B);
  EXPECT_EQ(float_to_e5m2_bits(-INFINITY, Saturation::kSatFinite), 0xFB);
  EXPECT_EQ(float_to_e5m2_bits(1e20f), 0x7B) << "the default must be kSatFinite";
  for (Saturation s : {Saturation::kSatFinite, Saturation::kNoSat})
    for (uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u})
      EXPECT_EQ(float_to_e5m2_bits(bits_to_f(nan), s), 0x7F) << std::hex << nan;
  EXPECT_EQ(float_to_e5m2_bits(-0.0f), 0x80);
  EXPECT_EQ(float_to_e5m2_bits(0x1p-17f), 0x00);                 // tie to 0
  EXPECT_EQ(float_to_e5m2_bits(3 * 0x1p-17f), 0x02);             // tie between 1 and 2 quanta
  EXPECT_EQ(float_to_e5m2_bits(-0x1p-16f), 0x81);
}

// ---- e8m0 ----------------------------------------------------------------------------------

TEST(DTypeE8M0, DecodeAllPatterns) {
  for (int b = 0; b < 255; ++b) {
    const double want = std::ldexp(1.0, b - 127);
    EXPECT_EQ(static_cast<double>(e8m0_bits_to_float(static_cast<uint8_t>(b))), want) << b;
  }
  EXPECT_TRUE(std::isnan(e8m0_bits_to_float(0xFF)));
  EXPECT_EQ(e8m0_bits_to_float(127), 1.0f);
  EXPECT_EQ(e8m0_bits_to_float(0), 0x1p-127f);  // a float subnormal, not zero
  EXPECT_EQ(e8m0_bits_to_float(254), 0x1p127f);
}

TEST(DTypeE8M0, PowersOfTwoAreExactInBothModes) {
  for (int k = -127; k <= 127; ++k) {
    const float x = std::ldexp(1.0f, k);
    EXPECT_EQ(float_to_e8m0_bits(x, E8M0Rounding::kFloor), k + 127) << k;
    EXPECT_EQ(float_to_e8m0_bits(x, E8M0Rounding::kCeil), k + 127) << k;
    EXPECT_EQ(float_to_e8m0_bits(-x, E8M0Rounding::kCeil), k + 127) << "sign is ignored, k = " << k;
  }
}

TEST(DTypeE8M0, FloorAndCeilBetweenPowers) {
  for (int k = -126; k <= 126; ++k) {
    const float p = std::ldexp(1.0f, k);
    const float mid = 1.5f * p, above = std::nextafter(p, INFINITY), below = std::nextafter(p, 0.0f);
    EXPECT_EQ(float_to_e8m0_bits(mid, E8M0Rounding::kFloor), k + 127) << k;
    EXPECT_EQ(float_to_e8m0_bits(mid, E8M0Rounding::kCeil), k + 128) << k;
    EXPECT_EQ(float_to_e8m0_bits(above, E8M0Rounding::kFloor), k + 127) << k;
    EXPECT_EQ(float_to_e8m0_bits(above, E8M0Rounding::kCeil), k + 128) << k;
    EXPECT_EQ(float_to_e8m0_bits(below, E8M0Rounding::kFloor), k + 126) << k;
    EXPECT_EQ(float_to_e8m0_bits(below, E8M0Rounding::kCeil), k + 127) << k;
  }
  EXPECT_EQ(float_to_e8m0_bits(3.0f), 129) << "the default must be kCeil";
  EXPECT_EQ(float_to_e8m0_bits(-3.0f, E8M0Rounding::kFloor), 128);
}

TEST(DTypeE8M0, ZeroClampingAndNonFinite) {
  for (E8M0Rounding m : {E8M0Rounding::kFloor, E8M0Rounding::kCeil}) {
    EXPECT_EQ(float_to_e8m0_bits(0.0f, m), 0x00);
    EXPECT_EQ(float_to_e8m0_bits(-0.0f, m), 0x00);
    EXPECT_EQ(float_to_e8m0_bits(bits_to_f(1), m), 0x00);   // 2^-149 clamps up to 2^-127
    EXPECT_EQ(float_to_e8m0_bits(0x1p-128f, m), 0x00);
    EXPECT_EQ(float_to_e8m0_bits(FLT_MAX, m), 254);         // ceil would be 2^128: clamps to 2^127
    EXPECT_EQ(float_to_e8m0_bits(-FLT_MAX, m), 254);
    EXPECT_EQ(float_to_e8m0_bits(INFINITY, m), 0xFF);
    EXPECT_EQ(float_to_e8m0_bits(-INFINITY, m), 0xFF);
    EXPECT_EQ(float_to_e8m0_bits(NAN, m), 0xFF);
  }
  EXPECT_EQ(float_to_e8m0_bits(1.5f * 0x1p-127f, E8M0Rounding::kFloor), 0);
  EXPECT_EQ(float_to_e8m0_bits(1.5f * 0x1p-127f, E8M0Rounding::kCeil), 1);
  EXPECT_EQ(float_to_e8m0_bits(1.5f * 0x1p127f, E8M0Rounding::kFloor), 254);
  EXPECT_EQ(float_to_e8m0_bits(1.5f * 0x1p127f, E8M0Rounding::kCeil), 254);
}

// ---- round_to_dtype, rounding mode, rows --------------------------------------------------------

TEST(DTypeRounding, RoundToDtype) {
  EXPECT_EQ(round_to_dtype(1.0 + 0x1p-40, DType::kF64), 1.0 + 0x1p-40);
  EXPECT_EQ(round_to_dtype(1.0 + 0x1p-40, DType::kF32), 1.0);
  EXPECT_EQ(round_to_dtype(1.0 + 0x1p-24, DType::kF32), 1.0);                 // fp32 tie, even
  EXPECT_EQ(round_to_dtype(1.0 + 3 * 0x1p-24, DType::kF32), 1.0 + 0x1p-22);
  EXPECT_EQ(round_to_dtype(1.0 + 3 * 0x1p-9, DType::kBF16), 1.0 + 0x1p-7);
  EXPECT_EQ(round_to_dtype(1.0 + 0x1p-8, DType::kBF16), 1.0);
  // A double reaches a narrow format through fp32, like the GPU: 1 + 2^-8 + 2^-40 is above the bf16
  // tie, but its fp32 rounding lands on the tie, which goes to even.
  EXPECT_EQ(round_to_dtype(1.0 + 0x1p-8 + 0x1p-40, DType::kBF16), 1.0);
  EXPECT_EQ(round_to_dtype(65520.0, DType::kF16), INFINITY);
  EXPECT_EQ(round_to_dtype(-65519.0, DType::kF16), -65504.0);
  EXPECT_EQ(round_to_dtype(464.0, DType::kF8E4M3), 448.0);
  EXPECT_EQ(round_to_dtype(-1e9, DType::kF8E4M3), -448.0);                  // saturating
  EXPECT_EQ(round_to_dtype(1e9, DType::kF8E5M2), 57344.0);
  EXPECT_EQ(round_to_dtype(0.3, DType::kF8E5M2), 0.3125);
  EXPECT_EQ(round_to_dtype(3.0, DType::kE8M0), 4.0);                         // kCeil
  EXPECT_EQ(round_to_dtype(-2.7, DType::kI32), -2.0);
  EXPECT_EQ(round_to_dtype(2.7, DType::kI64), 2.0);
  EXPECT_EQ(round_to_dtype(200.9, DType::kU8), 200.0);
  EXPECT_TRUE(std::isnan(round_to_dtype(NAN, DType::kBF16)));
  EXPECT_TRUE(std::signbit(round_to_dtype(-0.0, DType::kF8E4M3)));
}

// The hardware ignores the host's fenv rounding mode; so must the oracle.
TEST(DTypeRounding, IndependentOfFenvRoundingMode) {
  const int saved = std::fegetround();
  const float ties[] = {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 0x1p-25f, 3 * 0x1p-25f, 65520.0f, 1.0625f, 1.1875f, 464.0f};
  std::vector<uint32_t> want;
  for (float x : ties)
    for (float s : {1.0f, -1.0f}) {
      want.push_back(float_to_f16_bits(s * x));
      want.push_back(float_to_e4m3_bits(s * x));
      want.push_back(float_to_e5m2_bits(s * x));
      want.push_back(float_to_bf16_bits(s * x));
    }
  for (int mode : {FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO}) {
    ASSERT_EQ(std::fesetround(mode), 0);
    std::vector<uint32_t> got;
    for (float x : ties)
      for (float s : {1.0f, -1.0f}) {
        got.push_back(float_to_f16_bits(s * x));
        got.push_back(float_to_e4m3_bits(s * x));
        got.push_back(float_to_e5m2_bits(s * x));
        got.push_back(float_to_bf16_bits(s * x));
      }
    std::fesetround(saved);
    EXPECT_EQ(got, want) << "rounding mode " << mode;
  }
  EXPECT_EQ(want[0], 0x3C00u);  // the reference run itself rounded half to even
}

// Values exactly representable in each dtype survive store_row/load_row (both overloads) at an
// offset, and the neighbouring elements are left alone.
TEST(DTypeRows, StoreLoadRoundTripAtOffset) {
  for (DType t : kAllDTypes) {
    std::vector<double> vals;
    if (t == DType::kE8M0) vals = {1.0, 0.5, 4.0, 0x1p-20};
    else if (t == DType::kU8) vals = {0.0, 1.0, 77.0, 255.0};
    else if (is_integer(t)) vals = {0.0, -2.0, 7.0, 100.0};
    else vals = {0.0, -2.0, 0.5, 1.5};
    const int64_t n = static_cast<int64_t>(vals.size()), offset = 3, total = 10;
    std::vector<uint8_t> buf(total * dtype_size(t), 0xAB);
    store_row(buf.data(), t, offset, n, vals.data());
    std::vector<double> back_d(n);
    std::vector<float> back_f(n);
    load_row(buf.data(), t, offset, n, back_d.data());
    load_row(buf.data(), t, offset, n, back_f.data());
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(back_d[i], vals[i]) << dtype_name(t) << " element " << i;
      EXPECT_EQ(back_f[i], static_cast<float>(vals[i])) << dtype_name(t) << " element " << i;
      EXPECT_EQ(load_as_double(buf.data(), t, offset + i), vals[i]) << dtype_name(t);
    }
    for (size_t byte = 0; byte < buf.size(); ++byte) {
      const int64_t elem = static_cast<int64_t>(byte / dtype_size(t));
      if (elem < offset || elem >= offset + n) {
        EXPECT_EQ(buf[byte], 0xAB) << dtype_name(t) << " wrote outside its row at byte " << byte;
      }
    }
    // store_row(float) agrees with the scalar store for values that round (floating types only:
    // out-of-range float-to-integer casts are undefined).
    if (!is_floating(t)) continue;
    const std::vector<float> f_in = {1.0f + 0x1p-8f, 65520.0f, 464.1f, -3.3f};
    std::vector<uint8_t> a(4 * dtype_size(t)), b(4 * dtype_size(t));
    store_row(a.data(), t, 0, 4, f_in.data());
    for (int i = 0; i < 4; ++i) store_from_double(b.data(), t, i, f_in[i]);
    EXPECT_EQ(a, b) << dtype_name(t);
  }
}

// The row loaders' fast paths (fp32, bf16) and the generic path give the scalar conversions.
TEST(DTypeRows, RowsMatchScalarConversionsOnAllPatterns) {
  std::vector<uint16_t> pat(65536);
  for (uint32_t i = 0; i < 65536; ++i) pat[i] = static_cast<uint16_t>(i);
  std::vector<float> out(65536);
  load_row(pat.data(), DType::kBF16, 0, 65536, out.data());
  int bad = 0;
  for (uint32_t i = 0; i < 65536; ++i) bad += !same_float(out[i], bf16_bits_to_float(pat[i]));
  load_row(pat.data(), DType::kF16, 0, 65536, out.data());
  for (uint32_t i = 0; i < 65536; ++i) bad += !same_float(out[i], f16_bits_to_float(pat[i]));
  EXPECT_EQ(bad, 0);
  // Store of the decoded values reproduces the patterns (NaNs canonical).
  std::vector<uint16_t> back(65536);
  load_row(pat.data(), DType::kBF16, 0, 65536, out.data());
  store_row(back.data(), DType::kBF16, 0, 65536, out.data());
  for (uint32_t i = 0; i < 65536; ++i) bad += back[i] != (std::isnan(out[i]) ? 0x7FFF : pat[i]);
  EXPECT_EQ(bad, 0);
  // A double stored to bf16 goes through fp32 (documented): the double-rounding case lands on 1.0.
  const double d = 1.0 + 0x1p-8 + 0x1p-40;
  uint16_t r = 0;
  store_row(&r, DType::kBF16, 0, 1, &d);
  EXPECT_EQ(r, 0x3F80);
  store_row(&r, DType::kF16, 0, 1, &d);
  EXPECT_EQ(r, 0x3C04);  // fp16 resolves 2^-10: 1 + 2^-8 is exact there, the 2^-40 is lost in fp32
}

}  // namespace
}  // namespace epx
