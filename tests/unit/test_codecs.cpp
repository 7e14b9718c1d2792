// Exhaustive tests of core/codecs.h against references built here in FP64 from the format
// definitions (sign / exponent / mantissa / subnormal formula, nearest value with ties to even,
// saturation), never from the code under test. Covers every code, every rounding midpoint, the
// saturation and special-value boundaries, FP32 subnormals, random sweeps and stochastic rounding.
#include "core/codecs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace packmoe {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr float kInfF = std::numeric_limits<float>::infinity();

float bits_f(uint32_t b) { return f32_from_bits(b); }

// ---- FP64 reference: minifloat formats ---------------------------------------------------------

struct MiniFormat {
  int exp_bits;
  int man_bits;
  int bias;
  uint32_t max_code;  // largest finite positive code (satfinite target)
  uint32_t sign_bit;  // 0x80 for FP8, 0x8 for FP4
  const char* name;
};

constexpr MiniFormat kE4M3{4, 3, 7, 0x7E, 0x80, "e4m3"};
constexpr MiniFormat kE5M2{5, 2, 15, 0x7B, 0x80, "e5m2"};
constexpr MiniFormat kE2M1{2, 1, 1, 0x7, 0x8, "e2m1"};

// Magnitude of a finite positive code from the format definition.
double ref_magnitude(const MiniFormat& f, uint32_t code) {
  const uint32_t e = (code >> f.man_bits) & ((1u << f.exp_bits) - 1u);
  const uint32_t m = code & ((1u << f.man_bits) - 1u);
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - f.bias - f.man_bits);  // subnormal
  return std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -f.man_bits),
                    static_cast<int>(e) - f.bias);
}

std::vector<double> ref_positive_values(const MiniFormat& f) {
  std::vector<double> v;
  for (uint32_t c = 0; c <= f.max_code; ++c) v.push_back(ref_magnitude(f, c));
  return v;
}

// Nearest finite value, ties to the even code (= even mantissa), |x| beyond max -> max (satfinite),
// sign kept (also for results of 0). x must not be NaN.
uint32_t ref_encode(const MiniFormat& f, const std::vector<double>& values, double x) {
  const uint32_t sign = std::signbit(x) ? f.sign_bit : 0u;
  const double a = std::fabs(x);
  if (a >= values.back()) return sign | f.max_code;
  // lo = largest code with value <= a (values ascending, values[0] = 0 <= a).
  const auto it = std::upper_bound(values.begin(), values.end(), a);
  const uint32_t lo = static_cast<uint32_t>(it - values.begin()) - 1u;
  if (values[lo] == a) return sign | lo;
  const double d_lo = a - values[lo];      // exact: a is an FP32 value, values have <= 4 bits
  const double d_hi = values[lo + 1] - a;  // exact likewise
  uint32_t code;
  if (d_lo < d_hi) {
    code = lo;
  } else if (d_hi < d_lo) {
    code = lo + 1;
  } else {
    code = (lo % 2 == 0) ? lo : lo + 1;
  }
  return sign | code;
}

// TE reference thresholds for E2M1 (reference_nvfp4.py::cast_to_fp4x2, formats doc B.3).
uint32_t ref_e2m1_thresholds(float x) {
  const uint32_t sign = std::signbit(x) ? 8u : 0u;
  const float a = std::fabs(x);
  uint32_t c;
  if (a <= 0.25f) c = 0;
  else if (a < 0.75f) c = 1;
  else if (a <= 1.25f) c = 2;
  else if (a < 1.75f) c = 3;
  else if (a <= 2.5f) c = 4;
  else if (a < 3.5f) c = 5;
  else if (a <= 5.0f) c = 6;
  else c = 7;
  return sign | c;
}

// ---- FP64 reference: BF16 ----------------------------------------------------------------------

// Nearest of the two BF16 neighbours of x (chosen by FP64 distance), ties to even, overflow to Inf
// (the neighbour above the largest finite BF16 is treated as 2^128, as unbounded RNE would).
uint16_t ref_bf16(float x) {
  const uint32_t b = f32_bits(x);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a == 0x7F800000u) return sign | 0x7F80u;
  const uint32_t lo_h = a >> 16;
  const double av = static_cast<double>(bits_f(a));
  const double lo = static_cast<double>(bits_f(lo_h << 16));
  const uint32_t hi_h = lo_h + 1;
  const double hi =
      hi_h == 0x7F80u ? std::ldexp(1.0, 128) : static_cast<double>(bits_f(hi_h << 16));
  if (av == lo) return static_cast<uint16_t>(sign | lo_h);
  const double d_lo = av - lo, d_hi = hi - av;
  uint32_t h;
  if (d_lo < d_hi) h = lo_h;
  else if (d_hi < d_lo) h = hi_h;
  else h = (lo_h % 2 == 0) ? lo_h : hi_h;
  return static_cast<uint16_t>(sign | h);
}

// ---- Codec dispatch so one test body covers each minifloat ------------------------------------

uint32_t encode(const MiniFormat& f, float x) {
  if (&f == &kE4M3) return f32_to_e4m3(x);
  if (&f == &kE5M2) return f32_to_e5m2(x);
  return f32_to_e2m1(x);
}

float decode(const MiniFormat& f, uint32_t code) {
  if (&f == &kE4M3) return e4m3_to_f32(static_cast<uint8_t>(code));
  if (&f == &kE5M2) return e5m2_to_f32(static_cast<uint8_t>(code));
  return e2m1_to_f32(static_cast<uint8_t>(code));
}

// Same value and same sign (distinguishes +0 / -0); NaN only equals NaN.
::testing::AssertionResult same_float(float got, double want) {
  if (std::isnan(want)) {
    if (std::isnan(got)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "got " << got << ", want NaN";
  }
  if (static_cast<double>(got) == want && std::signbit(got) == std::signbit(want)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "got " << got << " (0x" << std::hex << f32_bits(got)
                                       << "), want " << want;
}

const MiniFormat* const kAllMini[] = {&kE4M3, &kE5M2, &kE2M1};

// ---- Decode: every code ------------------------------------------------------------------------

TEST(Codecs, E4M3DecodeAll256) {
  for (uint32_t c = 0; c < 256; ++c) {
    const double sign = (c & 0x80u) ? -1.0 : 1.0;
    const uint32_t mag = c & 0x7Fu;
    const double want = mag == 0x7Fu ? std::nan("") : sign * ref_magnitude(kE4M3, mag);
    EXPECT_TRUE(same_float(e4m3_to_f32(static_cast<uint8_t>(c)), want)) << "code " << c;
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_f32(0x07), 7.0f * std::ldexp(1.0f, -9));
}

TEST(Codecs, E5M2DecodeAll256) {
  for (uint32_t c = 0; c < 256; ++c) {
    const double sign = (c & 0x80u) ? -1.0 : 1.0;
    const uint32_t mag = c & 0x7Fu;
    double want;
    if (mag == 0x7Cu) want = sign * kInf;
    else if (mag > 0x7Cu) want = std::nan("");
    else want = sign * ref_magnitude(kE5M2, mag);
    EXPECT_TRUE(same_float(e5m2_to_f32(static_cast<uint8_t>(c)), want)) << "code " << c;
  }
  EXPECT_EQ(e5m2_to_f32(0x7B), 57344.0f);
  EXPECT_EQ(e5m2_to_f32(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(e5m2_to_f32(0x04), std::ldexp(1.0f, -14));
}

TEST(Codecs, E2M1DecodeAll16) {
  const double table[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (uint32_t c = 0; c < 16; ++c) {
    const double sign = (c & 8u) ? -1.0 : 1.0;
    EXPECT_EQ(ref_magnitude(kE2M1, c & 7u), table[c & 7u]);
    EXPECT_TRUE(same_float(e2m1_to_f32(static_cast<uint8_t>(c)), sign * table[c & 7u]))
        << "code " << c;
    // Only the low nibble is used.
    EXPECT_EQ(f32_bits(e2m1_to_f32(static_cast<uint8_t>(c | 0xF0u))),
              f32_bits(e2m1_to_f32(static_cast<uint8_t>(c))));
  }
}

TEST(Codecs, E8M0DecodeAndReciprocalAll256) {
  for (uint32_t c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    if (c == 255) {
      EXPECT_TRUE(std::isnan(e8m0_to_f32(code)));
      EXPECT_TRUE(std::isnan(e8m0_reciprocal(code)));
      continue;
    }
    const int e = static_cast<int>(c) - 127;
    EXPECT_TRUE(same_float(e8m0_to_f32(code), std::ldexp(1.0, e))) << "code " << c;
    EXPECT_TRUE(same_float(e8m0_reciprocal(code), std::ldexp(1.0, -e))) << "code " << c;
    // scale * multiplier == 1 exactly (FP64 product of two powers of two).
    EXPECT_EQ(static_cast<double>(e8m0_to_f32(code)) * e8m0_reciprocal(code), 1.0);
  }
  EXPECT_EQ(f32_bits(e8m0_to_f32(0)), 0x00400000u);      // 2^-127, FP32 subnormal
  EXPECT_EQ(f32_bits(e8m0_reciprocal(254)), 0x00400000u);
  EXPECT_EQ(f32_bits(e8m0_reciprocal(0)), 0x7F000000u);  // 2^127
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_reciprocal(127), 1.0f);
}

TEST(Codecs, BF16DecodeIsUpperHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    EXPECT_EQ(f32_bits(bf16_to_f32(static_cast<uint16_t>(h))), h << 16);
  }
}

// ---- Round trip --------------------------------------------------------------------------------

TEST(Codecs, MinifloatRoundTripEveryNonNanCode) {
  for (uint32_t c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    if ((c & 0x7Fu) != 0x7Fu) {
      EXPECT_EQ(encode(kE4M3, decode(kE4M3, code)), code) << "e4m3 " << c;
    }
    if ((c & 0x7Fu) < 0x7Cu) {
      EXPECT_EQ(encode(kE5M2, decode(kE5M2, code)), code) << "e5m2 " << c;
    }
  }
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(encode(kE2M1, decode(kE2M1, c)), c) << "e2m1 " << c;
  }
  // E5M2 Inf codes decode to Inf, which the satfinite cast turns into the largest finite value.
  EXPECT_EQ(f32_to_e5m2(e5m2_to_f32(0x7C)), 0x7B);
  EXPECT_EQ(f32_to_e5m2(e5m2_to_f32(0xFC)), 0xFB);
}

TEST(Codecs, BF16RoundTripEveryNonNanCode) {
  for (uint32_t h = 0; h < 65536; ++h) {
    if ((h & 0x7F80u) == 0x7F80u && (h & 0x7Fu) != 0) continue;  // NaN payloads
    EXPECT_EQ(f32_to_bf16(bf16_to_f32(static_cast<uint16_t>(h))), h) << h;
  }
}

// ---- Rounding: every midpoint ------------------------------------------------------------------

TEST(Codecs, MinifloatMidpointsTieToEvenAndNeighboursGoToNearer) {
  for (const MiniFormat* f : kAllMini) {
    const std::vector<double> v = ref_positive_values(*f);
    for (uint32_t i = 0; i + 1 < v.size(); ++i) {
      const double mid = (v[i] + v[i + 1]) / 2;
      const float mid_f = static_cast<float>(mid);
      ASSERT_EQ(static_cast<double>(mid_f), mid) << f->name << " midpoint not FP32";
      const uint32_t even = (i % 2 == 0) ? i : i + 1;
      const float above = std::nextafter(mid_f, kInfF);
      const float below = std::nextafter(mid_f, 0.0f);
      for (const uint32_t sign : {0u, f->sign_bit}) {
        const float s = sign ? -1.0f : 1.0f;
        EXPECT_EQ(encode(*f, s * mid_f), sign | even) << f->name << " mid " << mid;
        EXPECT_EQ(encode(*f, s * above), sign | (i + 1)) << f->name << " above " << mid;
        EXPECT_EQ(encode(*f, s * below), sign | i) << f->name << " below " << mid;
        // Each representable value and its FP32 neighbours stay put.
        const float exact = static_cast<float>(v[i + 1]);
        EXPECT_EQ(encode(*f, s * exact), sign | (i + 1));
        EXPECT_EQ(encode(*f, s * std::nextafter(exact, kInfF)), sign | (i + 1));
        EXPECT_EQ(encode(*f, s * std::nextafter(exact, 0.0f)), sign | (i + 1));
      }
    }
  }
}

TEST(Codecs, BF16MidpointsTieToEvenAndNeighboursGoToNearer) {
  // Every pair of adjacent finite positive BF16 values (including subnormals and the pair
  // (largest finite, Inf), whose midpoint is finite in FP32 and rounds to the even code: Inf).
  for (uint32_t h = 0; h < 0x7F80u; ++h) {
    const double lo = bf16_to_f32(static_cast<uint16_t>(h));
    const double hi = h + 1 == 0x7F80u ? std::ldexp(1.0, 128)
                                       : static_cast<double>(bf16_to_f32(static_cast<uint16_t>(h + 1)));
    const double mid = (lo + hi) / 2;
    const float mid_f = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(mid_f), mid) << h;
    ASSERT_EQ(f32_bits(mid_f), (h << 16) | 0x8000u) << h;
    const uint32_t even = (h % 2 == 0) ? h : h + 1;
    for (const uint32_t sign : {0u, 0x8000u}) {
      const float s = sign ? -1.0f : 1.0f;
      EXPECT_EQ(f32_to_bf16(s * mid_f), sign | even) << h;
      EXPECT_EQ(f32_to_bf16(s * std::nextafter(mid_f, kInfF)), sign | (h + 1)) << h;
      EXPECT_EQ(f32_to_bf16(s * std::nextafter(mid_f, 0.0f)), sign | h) << h;
    }
  }
  EXPECT_EQ(f32_to_bf16(FLT_MAX), 0x7F80u);  // 0x7F7FFFFF is above the last midpoint: Inf
  EXPECT_EQ(f32_to_bf16(-FLT_MAX), 0xFF80u);
}

// ---- Saturation, specials, FP32 subnormal inputs -----------------------------------------------

TEST(Codecs, E4M3SaturationAndSpecials) {
  const float big[] = {448.0f, std::nextafter(448.0f, kInfF), 456.0f, 464.0f,
                       std::nextafter(464.0f, kInfF), 480.0f, 512.0f, 1e30f, FLT_MAX, kInfF};
  for (const float x : big) {
    EXPECT_EQ(f32_to_e4m3(x), 0x7E) << x;
    EXPECT_EQ(f32_to_e4m3(-x), 0xFE) << x;
  }
  EXPECT_EQ(f32_to_e4m3(std::nextafter(448.0f, 0.0f)), 0x7E);
  EXPECT_EQ(f32_to_e4m3(432.0f), 0x7E);                           // tie 416/448 -> even 448 (0x7E)
  EXPECT_EQ(f32_to_e4m3(std::nextafter(432.0f, 0.0f)), 0x7D);     // 416
  EXPECT_EQ(f32_to_e4m3(std::nan("")), 0x7F);
  EXPECT_EQ(f32_to_e4m3(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(f32_to_e4m3(bits_f(0x7F800001u)), 0x7F);  // signalling NaN pattern
  EXPECT_EQ(f32_to_e4m3(bits_f(0xFFFFFFFFu)), 0xFF);
  EXPECT_EQ(f32_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
}

TEST(Codecs, E5M2SaturationAndSpecials) {
  const float big[] = {57344.0f, std::nextafter(57344.0f, kInfF), 61440.0f,
                       std::nextafter(61440.0f, kInfF), 65536.0f, 1e30f, FLT_MAX, kInfF};
  for (const float x : big) {
    EXPECT_EQ(f32_to_e5m2(x), 0x7B) << x;
    EXPECT_EQ(f32_to_e5m2(-x), 0xFB) << x;
  }
  EXPECT_EQ(f32_to_e5m2(std::nan("")), 0x7F);
  EXPECT_EQ(f32_to_e5m2(-std::numeric_limits<float>::quiet_NaN()), 0xFF);
  EXPECT_EQ(f32_to_e5m2(bits_f(0x7F800001u)), 0x7F);
  EXPECT_EQ(f32_to_e5m2(-0.0f), 0x80);
}

TEST(Codecs, E2M1SaturationAndSpecials) {
  const float big[] = {6.0f, std::nextafter(6.0f, kInfF), 7.0f, 8.0f, 1e30f, FLT_MAX, kInfF};
  for (const float x : big) {
    EXPECT_EQ(f32_to_e2m1(x), 0x7) << x;
    EXPECT_EQ(f32_to_e2m1(-x), 0xF) << x;
  }
  // NaN -> +6 (0x7) whatever its sign: TE kernel satfinite behaviour.
  EXPECT_EQ(f32_to_e2m1(std::nan("")), 0x7);
  EXPECT_EQ(f32_to_e2m1(-std::numeric_limits<float>::quiet_NaN()), 0x7);
  EXPECT_EQ(f32_to_e2m1(bits_f(0xFFFFFFFFu)), 0x7);
  EXPECT_EQ(f32_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(f32_to_e2m1(-0.25f), 0x8);  // negative input rounding to zero keeps the sign
  EXPECT_EQ(f32_to_e2m1(-std::nextafter(0.25f, 1.0f)), 0x9);
  EXPECT_EQ(f32_to_e2m1(5.0f), 0x6);    // tie 4/6 -> even (4)
  EXPECT_EQ(f32_to_e2m1(std::nextafter(5.0f, kInfF)), 0x7);
}

TEST(Codecs, BF16Specials) {
  EXPECT_EQ(f32_to_bf16(kInfF), 0x7F80u);
  EXPECT_EQ(f32_to_bf16(-kInfF), 0xFF80u);
  EXPECT_EQ(f32_to_bf16(std::nan("")), 0x7FC0u);
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::quiet_NaN()), 0xFFC0u);
  // NaN whose payload lives only in the low half must stay NaN (not round to Inf).
  EXPECT_EQ(f32_to_bf16(bits_f(0x7F800001u)), 0x7FC0u);
  EXPECT_EQ(f32_to_bf16(bits_f(0xFF80FFFFu)), 0xFFC0u);
  EXPECT_EQ(f32_to_bf16(bits_f(0x7FFFFFFFu)), 0x7FC0u);
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000u);
}

TEST(Codecs, Fp32SubnormalInputs) {
  const uint32_t subs[] = {0x00000001u, 0x00000002u, 0x00001234u, 0x00400000u, 0x007FFFFFu};
  for (const uint32_t s : subs) {
    const float x = bits_f(s);
    ASSERT_NE(x, 0.0f);  // the host is not flushing subnormals
    EXPECT_EQ(f32_to_e4m3(x), 0x00);
    EXPECT_EQ(f32_to_e4m3(-x), 0x80);
    EXPECT_EQ(f32_to_e5m2(x), 0x00);
    EXPECT_EQ(f32_to_e5m2(-x), 0x80);
    EXPECT_EQ(f32_to_e2m1(x), 0x0);
    EXPECT_EQ(f32_to_e2m1(-x), 0x8);
    EXPECT_EQ(f32_to_bf16(x), ref_bf16(x)) << std::hex << s;
    EXPECT_EQ(f32_to_bf16(-x), ref_bf16(-x)) << std::hex << s;
  }
  // BF16 keeps FP32's exponent range, so subnormals round within the subnormal grid.
  EXPECT_EQ(f32_to_bf16(bits_f(0x00008000u)), 0x0000u);  // tie -> even 0
  EXPECT_EQ(f32_to_bf16(bits_f(0x00008001u)), 0x0001u);
  EXPECT_EQ(f32_to_bf16(bits_f(0x00018000u)), 0x0002u);  // tie -> even 2
  EXPECT_EQ(f32_to_bf16(bits_f(0x007FFFFFu)), 0x0080u);  // rounds up to the smallest normal
  // Smallest E4M3/E5M2 subnormals and the round-to-zero boundary (2^-10 / 2^-17 are ties to 0).
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(f32_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(f32_to_e4m3(3.0f * std::ldexp(1.0f, -10)), 0x02);  // tie 1/2 (x 2^-9) -> even
  EXPECT_EQ(f32_to_e5m2(std::ldexp(1.0f, -17)), 0x00);
  EXPECT_EQ(f32_to_e5m2(std::nextafter(std::ldexp(1.0f, -17), 1.0f)), 0x01);
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -40)), 0x00);
}

// ---- Random sweeps against the FP64 references -------------------------------------------------

// Mix of raw random bit patterns (every exponent, NaN/Inf included) and values concentrated on the
// format's range (random sign, exponent in [lo_exp, hi_exp], random mantissa).
std::vector<float> sweep_inputs(uint64_t seed, int count, int lo_exp, int hi_exp) {
  std::mt19937_64 rng(seed);
  std::vector<float> xs;
  xs.reserve(count);
  for (int i = 0; i < count; ++i) {
    const uint32_t r = static_cast<uint32_t>(rng());
    if (i % 4 == 0) {
      xs.push_back(bits_f(r));
    } else {
      const int e = lo_exp + static_cast<int>(rng() % static_cast<uint64_t>(hi_exp - lo_exp + 1));
      const uint32_t man = r & 0x7FFFFFu;
      const uint32_t sign = (r >> 31) << 31;
      const double mag = std::ldexp(1.0 + std::ldexp(static_cast<double>(man), -23), e);
      xs.push_back(bits_f(sign | f32_bits(static_cast<float>(mag))));
    }
  }
  return xs;
}

TEST(Codecs, MinifloatRandomSweepMatchesFp64Reference) {
  constexpr int kCount = 1'000'000;
  const int ranges[3][2] = {{-12, 10}, {-19, 17}, {-4, 4}};
  for (int fi = 0; fi < 3; ++fi) {
    const MiniFormat& f = *kAllMini[fi];
    const std::vector<double> v = ref_positive_values(f);
    const std::vector<float> xs = sweep_inputs(1234 + fi, kCount, ranges[fi][0], ranges[fi][1]);
    int failures = 0;
    for (const float x : xs) {
      uint32_t want;
      if (std::isnan(x)) want = (&f == &kE2M1) ? 0x7u : ((std::signbit(x) ? 0x80u : 0u) | 0x7Fu);
      else want = ref_encode(f, v, x);
      const uint32_t got = encode(f, x);
      if (got != want && ++failures <= 10) {
        ADD_FAILURE() << f.name << " x=" << x << " (0x" << std::hex << f32_bits(x) << ") got 0x"
                      << got << " want 0x" << want;
      }
      if (&f == &kE2M1 && !std::isnan(x)) {
        if (got != ref_e2m1_thresholds(x) && ++failures <= 10) {
          ADD_FAILURE() << "e2m1 thresholds x=" << x;
        }
      }
    }
    EXPECT_EQ(failures, 0) << f.name;
  }
}

TEST(Codecs, BF16RandomSweepMatchesFp64Reference) {
  const std::vector<float> xs = sweep_inputs(99, 1'000'000, -140, 127);
  int failures = 0;
  for (const float x : xs) {
    const uint16_t got = f32_to_bf16(x);
    if (std::isnan(x)) {
      const uint16_t want = static_cast<uint16_t>((std::signbit(x) ? 0x8000u : 0u) | 0x7FC0u);
      if (got != want && ++failures <= 10) ADD_FAILURE() << "bf16 NaN";
      continue;
    }
    const uint16_t want = ref_bf16(x);
    if (got != want && ++failures <= 10) {
      ADD_FAILURE() << "bf16 x=" << x << " (0x" << std::hex << f32_bits(x) << ") got 0x" << got
                    << " want 0x" << want;
    }
  }
  EXPECT_EQ(failures, 0);
}

// ---- E8M0 RCEIL --------------------------------------------------------------------------------

// Smallest code e in [0, 254] with 2^(e-127) >= v (FP64, exact), saturating at 254.
uint32_t ref_e8m0_rceil(float v) {
  if (std::isnan(v)) return 0xFF;
  const double a = std::fabs(static_cast<double>(v));
  for (int e = 0; e <= 254; ++e) {
    if (std::ldexp(1.0, e - 127) >= a) return static_cast<uint32_t>(e);
  }
  return 254;
}

TEST(Codecs, E8M0RceilHandPicked) {
  EXPECT_EQ(f32_to_e8m0_rceil(0.0f), 0);
  EXPECT_EQ(f32_to_e8m0_rceil(std::nan("")), 0xFF);
  EXPECT_EQ(f32_to_e8m0_rceil(kInfF), 0xFE);
  EXPECT_EQ(f32_to_e8m0_rceil(FLT_MAX), 0xFE);
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x7F000000u)), 0xFE);  // 2^127 exactly
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x7F000001u)), 0xFE);  // above 2^127: satfinite
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x7E800000u)), 0xFD);  // 2^126
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x7E800001u)), 0xFE);
  EXPECT_EQ(f32_to_e8m0_rceil(1.0f), 127);
  EXPECT_EQ(f32_to_e8m0_rceil(std::nextafter(1.0f, 2.0f)), 128);
  EXPECT_EQ(f32_to_e8m0_rceil(std::nextafter(1.0f, 0.0f)), 127);
  EXPECT_EQ(f32_to_e8m0_rceil(0.5f), 126);
  // FP32 subnormals: <= 2^-127 -> code 0 (2^-127 covers them), above rounds up to 2^-126.
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x00000001u)), 0);
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x003FFFFFu)), 0);
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x00400000u)), 0);  // exactly 2^-127
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x00400001u)), 1);
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x007FFFFFu)), 1);
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x00800000u)), 1);  // 2^-126
  EXPECT_EQ(f32_to_e8m0_rceil(bits_f(0x00800001u)), 2);
  // Sign bit is ignored (v = amax * rcp is never negative in use).
  EXPECT_EQ(f32_to_e8m0_rceil(-3.0f), f32_to_e8m0_rceil(3.0f));

  // The MXFP8 scale rule: v = amax * fp32(1/448).
  const float rcp448 = bits_f(0x3B124925u);
  const float rcp57344 = bits_f(0x37924925u);
  EXPECT_EQ(rcp448, static_cast<float>(1.0 / 448.0));
  EXPECT_EQ(rcp57344, static_cast<float>(1.0 / 57344.0));
  EXPECT_EQ(f32_to_e8m0_rceil(448.0f * rcp448), 127);  // amax == max_norm: scale 1
  EXPECT_EQ(f32_to_e8m0_rceil(449.0f * rcp448), 128);  // just above: scale 2
  EXPECT_EQ(f32_to_e8m0_rceil(57344.0f * rcp57344), 127);
  EXPECT_EQ(f32_to_e8m0_rceil(0.0f * rcp448), 0);
  // Closed form (formats doc A.2): amax = m * 2^E -> unbiased exponent E-8 if m <= 1.75, else E-7.
  for (int E = -100; E <= 120; ++E) {
    for (const float m : {1.0f, 1.25f, 1.5f, 1.75f, 1.7578125f, 1.9921875f}) {
      const float amax = std::ldexp(m, E);
      const int want = 127 + E - 8 + (m > 1.75f ? 1 : 0);
      if (want < 1 || want > 254) continue;
      EXPECT_EQ(f32_to_e8m0_rceil(amax * rcp448), want) << "amax=" << amax;
    }
  }
}

TEST(Codecs, E8M0RceilEveryBf16AmaxMatchesDivision) {
  // Formats doc A.2 [checked]: for every BF16-representable amax, amax * fp32(1/max) gives the same
  // code as the exact quotient. The exact code: smallest e with max * 2^(e-127) >= amax.
  const float rcp448 = bits_f(0x3B124925u);
  const float rcp57344 = bits_f(0x37924925u);
  for (uint32_t h = 0; h < 0x7F80u; ++h) {
    const float amax = bf16_to_f32(static_cast<uint16_t>(h));
    for (const double max_norm : {448.0, 57344.0}) {
      const float rcp = max_norm == 448.0 ? rcp448 : rcp57344;
      uint32_t want = 254;
      for (int e = 0; e <= 254; ++e) {
        if (max_norm * std::ldexp(1.0, e - 127) >= amax) {
          want = static_cast<uint32_t>(e);
          break;
        }
      }
      ASSERT_EQ(f32_to_e8m0_rceil(amax * rcp), want) << "amax=" << amax << " max=" << max_norm;
    }
  }
}

TEST(Codecs, E8M0RceilRandomSweep) {
  std::mt19937_64 rng(7);
  int failures = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    const float v = bits_f(static_cast<uint32_t>(rng()));
    const uint32_t got = f32_to_e8m0_rceil(v);
    const uint32_t want = ref_e8m0_rceil(v);
    if (got != want && ++failures <= 10) {
      ADD_FAILURE() << "v=" << v << " (0x" << std::hex << f32_bits(v) << ") got " << std::dec
                    << got << " want " << want;
    }
  }
  EXPECT_EQ(failures, 0);
}

// ---- E2M1 stochastic rounding ------------------------------------------------------------------

struct Bracket {
  double lo;
  double step;
  uint32_t lo_code;
};

Bracket ref_bracket(double a) {
  const double grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  uint32_t i = 0;
  while (i + 1 < 8 && grid[i + 1] <= a) ++i;
  return Bracket{grid[i], grid[i + 1] - grid[i], i};
}

// For |x| < 6: the up-value is chosen for exactly the top floor(256 * (|x| - lo) / step) rbits.
void check_sr_all_rbits(float x) {
  const uint32_t sign = std::signbit(x) ? 8u : 0u;
  const double a = std::fabs(static_cast<double>(x));
  ASSERT_LT(a, 6.0);
  const Bracket b = ref_bracket(a);
  const uint32_t count = static_cast<uint32_t>(std::floor((a - b.lo) / b.step * 256.0));
  double sum = 0;
  for (uint32_t r = 0; r < 256; ++r) {
    const uint8_t got = f32_to_e2m1_sr(x, static_cast<uint8_t>(r));
    const bool up = r >= 256 - count;
    ASSERT_EQ(got, sign | (b.lo_code + (up ? 1u : 0u)))
        << "x=" << x << " (0x" << std::hex << f32_bits(x) << ") rbits=" << std::dec << r;
    sum += std::fabs(static_cast<double>(e2m1_to_f32(got)));
  }
  // Mean over the 256 rbits: exactly lo + step * count / 256, within step/256 below |x|.
  const double mean = sum / 256;
  EXPECT_EQ(mean, b.lo + b.step * count / 256.0);
  EXPECT_LE(mean, a);
  EXPECT_LT(a - mean, b.step / 256.0);
}

TEST(Codecs, E2M1StochasticRoundingHandDerived) {
  // 0.3f: lo 0, step .5, 256 * 0.3f / 0.5 = 153.6.. -> up for rbits >= 103.
  EXPECT_EQ(f32_to_e2m1_sr(0.3f, 0), 0);
  EXPECT_EQ(f32_to_e2m1_sr(0.3f, 102), 0);
  EXPECT_EQ(f32_to_e2m1_sr(0.3f, 103), 1);
  EXPECT_EQ(f32_to_e2m1_sr(0.3f, 255), 1);
  // 1.25 halfway between 1 and 1.5: up for rbits >= 128.
  EXPECT_EQ(f32_to_e2m1_sr(1.25f, 127), 2);
  EXPECT_EQ(f32_to_e2m1_sr(1.25f, 128), 3);
  // -2.75: lo 2 step 1, f = .75 -> up for rbits >= 64; sign kept.
  EXPECT_EQ(f32_to_e2m1_sr(-2.75f, 63), 0xC);
  EXPECT_EQ(f32_to_e2m1_sr(-2.75f, 64), 0xD);
  // 5: lo 4 step 2, up (to 6) for rbits >= 128.
  EXPECT_EQ(f32_to_e2m1_sr(5.0f, 127), 6);
  EXPECT_EQ(f32_to_e2m1_sr(5.0f, 128), 7);
  // 1.9f crosses the binade at 2: 256 * (1.9f - 1.5) / 0.5 = 204.79.. -> up for rbits >= 52.
  EXPECT_EQ(f32_to_e2m1_sr(1.9f, 51), 3);
  EXPECT_EQ(f32_to_e2m1_sr(1.9f, 52), 4);
  // 2^-9: count 1, only rbits 255 rounds up; 2^-10: count 0, never.
  EXPECT_EQ(f32_to_e2m1_sr(std::ldexp(1.0f, -9), 254), 0);
  EXPECT_EQ(f32_to_e2m1_sr(std::ldexp(1.0f, -9), 255), 1);
  EXPECT_EQ(f32_to_e2m1_sr(std::ldexp(1.0f, -10), 255), 0);
  // The case where TE's FP32 formula t = |x| + u*step would round: x = 2^-9 - 2^-26, rbits 255:
  // t = 0.5 - 2^-26 exactly, a tie in FP32 that rounds to 0.5 (up); the exact rule says
  // 256 * x / 0.5 = 1 - 2^-17 < 1, so never up.
  const float hazard = std::ldexp(1.0f, -9) - std::ldexp(1.0f, -26);
  EXPECT_EQ(hazard + 255.0f / 512.0f, 0.5f);  // documents the FP32 rounding we avoid
  EXPECT_EQ(f32_to_e2m1_sr(hazard, 255), 0);
  // Saturation and specials.
  for (uint32_t r = 0; r < 256; ++r) {
    const uint8_t rb = static_cast<uint8_t>(r);
    EXPECT_EQ(f32_to_e2m1_sr(6.0f, rb), 7);
    EXPECT_EQ(f32_to_e2m1_sr(-6.5f, rb), 0xF);
    EXPECT_EQ(f32_to_e2m1_sr(FLT_MAX, rb), 7);
    EXPECT_EQ(f32_to_e2m1_sr(kInfF, rb), 7);
    EXPECT_EQ(f32_to_e2m1_sr(-kInfF, rb), 0xF);
    EXPECT_EQ(f32_to_e2m1_sr(std::nan(""), rb), 7);
    EXPECT_EQ(f32_to_e2m1_sr(-std::numeric_limits<float>::quiet_NaN(), rb), 7);
    EXPECT_EQ(f32_to_e2m1_sr(0.0f, rb), 0);
    EXPECT_EQ(f32_to_e2m1_sr(-0.0f, rb), 8);
    EXPECT_EQ(f32_to_e2m1_sr(bits_f(0x00000001u), rb), 0);
    EXPECT_EQ(f32_to_e2m1_sr(-bits_f(0x007FFFFFu), rb), 8);
    // Representable values never move.
    for (uint32_t c = 0; c < 16; ++c) {
      EXPECT_EQ(f32_to_e2m1_sr(e2m1_to_f32(static_cast<uint8_t>(c)), rb), c);
    }
  }
  // rbits = 0 always rounds toward zero.
  for (const float x : {0.1f, 0.49f, 0.74f, 1.1f, 1.99f, 2.9f, 3.99f, 5.9f}) {
    EXPECT_EQ(f32_to_e2m1_sr(x, 0), static_cast<uint8_t>(ref_bracket(x).lo_code)) << x;
    EXPECT_EQ(f32_to_e2m1_sr(-x, 0), static_cast<uint8_t>(8u | ref_bracket(x).lo_code)) << x;
  }
}

TEST(Codecs, E2M1StochasticRoundingAllRbitsSweep) {
  std::vector<float> xs;
  // Grid values, midpoints, quarter points and their FP32 neighbours.
  for (int q = 0; q < 6 * 8; ++q) {
    const float x = static_cast<float>(q) / 8.0f;
    xs.push_back(x);
    xs.push_back(std::nextafter(x, 8.0f));
    if (x > 0) xs.push_back(std::nextafter(x, 0.0f));
  }
  // Points just below and at every rbits threshold step*(256-r)/256 above each grid value.
  const double grid[7] = {0, 0.5, 1, 1.5, 2, 3, 4};
  const double steps[7] = {0.5, 0.5, 0.5, 0.5, 1, 1, 2};
  for (int g = 0; g < 7; ++g) {
    for (int k = 1; k < 256; k += 17) {
      const float x = static_cast<float>(grid[g] + steps[g] * k / 256.0);
      xs.push_back(x);
      xs.push_back(std::nextafter(x, 0.0f));
    }
  }
  // Random values in (0, 6), tiny values and subnormals.
  std::mt19937_64 rng(2024);
  std::uniform_real_distribution<float> uni(0.0f, 6.0f);
  for (int i = 0; i < 20000; ++i) xs.push_back(uni(rng));
  for (int e = -149; e < -5; ++e) xs.push_back(std::ldexp(1.3f, e));
  xs.push_back(std::ldexp(1.0f, -9) - std::ldexp(1.0f, -26));
  for (const float x : xs) {
    if (!(x < 6.0f)) continue;
    check_sr_all_rbits(x);
    check_sr_all_rbits(-x);
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace packmoe
