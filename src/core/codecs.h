// Bit-exact scalar codecs FP32 <-> BF16 / E4M3 / E5M2 / E8M0 / E2M1, one header for CPU and CUDA.
// Invariant: every function is integer/bit manipulation or exactly-rounded FP32 arithmetic whose
// result does not depend on FTZ/DAZ or FMA contraction, so host and device agree bit for bit.
// Rounding is TransformerEngine's (docs/formats.md):
// RNE + satfinite for FP8/FP4, round-up (RCEIL) for E8M0 scales.
#pragma once

#include <cstdint>

#include "core/hd.h"

namespace packmoe {

// __builtin_bit_cast is a compiler builtin in both g++ and nvcc (host and device), so no memcpy or
// union punning is needed and the helpers stay usable in device code.
PACKMOE_HD uint32_t f32_bits(float x) { return __builtin_bit_cast(uint32_t, x); }
PACKMOE_HD float f32_from_bits(uint32_t b) { return __builtin_bit_cast(float, b); }

namespace codecs_detail {

inline constexpr uint32_t kF32SignMask = 0x80000000u;
inline constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
inline constexpr uint32_t kF32Inf = 0x7F800000u;
inline constexpr uint32_t kF32QuietNan = 0x7FC00000u;

PACKMOE_HD bool abs_bits_is_nan(uint32_t abs_bits) { return abs_bits > kF32Inf; }

// Round |x| (given as FP32 bits without sign, not NaN; Inf allowed) to the unsigned minifloat with
// kExpBits exponent bits, kManBits mantissa bits and bias kBias, round-to-nearest-even, assuming
// an unbounded exponent range above, then clamp to kMaxCode (satfinite). Pure integer arithmetic:
// FP32 subnormal inputs are handled exactly whatever the FTZ mode. Returns the code without sign.
//
// Why it works: |x| = sig * 2^(e - 23) with a 24-bit sig (normal) or sig = mantissa, e = -126
// (FP32 subnormal). The target quantum at that magnitude is 2^(max(e, emin) - kManBits), so the
// target integer significand is RNE(sig >> shift). Writing the code as ((eb) << kManBits) + q with
// eb = max(e, emin) + kBias - 1 makes a mantissa carry (q == 2^(kManBits+1)) roll into the
// exponent field, and a subnormal that rounds up to 2^kManBits become the smallest normal, for free.
template <int kManBits, int kBias, uint32_t kMaxCode>
PACKMOE_HD uint32_t round_abs_to_minifloat(uint32_t abs_bits) {
  constexpr int kEmin = 1 - kBias;  // unbiased exponent of the smallest normal
  const uint32_t f32_exp = abs_bits >> 23;
  const uint32_t f32_man = abs_bits & 0x7FFFFFu;
  if (f32_exp == 0xFF) return kMaxCode;  // Inf saturates (NaN handled by the caller)
  uint32_t sig;
  int e;
  if (f32_exp == 0) {
    sig = f32_man;
    e = -126;
  } else {
    sig = f32_man | 0x800000u;
    e = static_cast<int>(f32_exp) - 127;
  }
  if (sig == 0) return 0;
  const int e_target = e > kEmin ? e : kEmin;
  const int shift = (23 - kManBits) + (e_target - e);
  // sig < 2^24, so for shift >= 25 it is below half a quantum: rounds to zero (also keeps the
  // shifts below 32 bits).
  if (shift >= 25) return 0;
  uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  // e_target + kBias - 1 >= 0 by construction; e_target <= 127 so nothing overflows 32 bits.
  const uint32_t code = (static_cast<uint32_t>(e_target + kBias - 1) << kManBits) + q;
  return code > kMaxCode ? kMaxCode : code;
}

}  // namespace codecs_detail

// ---- BF16 --------------------------------------------------------------------------------------

// RNE; overflow rounds to Inf (no saturation, like __float2bfloat16_rn); NaN -> quiet NaN with sign.
PACKMOE_HD uint16_t f32_to_bf16(float x) {
  const uint32_t b = f32_bits(x);
  if (codecs_detail::abs_bits_is_nan(b & codecs_detail::kF32AbsMask)) {
    return static_cast<uint16_t>(((b >> 16) & 0x8000u) | 0x7FC0u);
  }
  const uint32_t rounding_bias = 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>((b + rounding_bias) >> 16);
}

PACKMOE_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// ---- E4M3 (float8_e4m3fn): s.eeee.mmm, bias 7, max 448, no Inf, NaN = s.1111.111 --------------

inline constexpr uint8_t kE4M3MaxCode = 0x7E;  // 448
inline constexpr float kE4M3Max = 448.0f;

// RNE, satfinite (|x| > 448 incl. Inf -> +-448), NaN -> 0x7F | sign, subnormals down to 2^-9.
PACKMOE_HD uint8_t f32_to_e4m3(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t sign = (b >> 24) & 0x80u;
  const uint32_t a = b & codecs_detail::kF32AbsMask;
  if (codecs_detail::abs_bits_is_nan(a)) return static_cast<uint8_t>(sign | 0x7Fu);
  return static_cast<uint8_t>(sign | codecs_detail::round_abs_to_minifloat<3, 7, kE4M3MaxCode>(a));
}

// Exact; 0x7F / 0xFF -> NaN (carrying the sign).
PACKMOE_HD float e4m3_to_f32(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code >> 3) & 0xFu;
  const uint32_t man = code & 0x7u;
  if (exp == 0xF && man == 0x7) return f32_from_bits(sign | codecs_detail::kF32QuietNan);
  if (exp == 0) {
    // man * 2^-9, built exactly in bits (normal in FP32): avoids relying on FP multiply modes.
    if (man == 0) return f32_from_bits(sign);
    // Normalise: man in {1..7}; leading bit position p gives 2^(p-9) * (man / 2^p).
    const uint32_t p = man >= 4 ? 2u : (man >= 2 ? 1u : 0u);
    const uint32_t frac = (man << (23 - p)) & 0x7FFFFFu;
    return f32_from_bits(sign | ((118u + p) << 23) | frac);
  }
  return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));  // rebias 7 -> 127
}

// ---- E5M2: s.eeeee.mm, bias 15, max 57344, IEEE-like Inf (0x7C) and NaN -----------------------

inline constexpr uint8_t kE5M2MaxCode = 0x7B;  // 57344
inline constexpr float kE5M2Max = 57344.0f;

// RNE, satfinite (|x| > 57344 incl. Inf -> +-57344), NaN -> 0x7F | sign, subnormals to 2^-16.
PACKMOE_HD uint8_t f32_to_e5m2(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t sign = (b >> 24) & 0x80u;
  const uint32_t a = b & codecs_detail::kF32AbsMask;
  if (codecs_detail::abs_bits_is_nan(a)) return static_cast<uint8_t>(sign | 0x7Fu);
  return static_cast<uint8_t>(sign |
                              codecs_detail::round_abs_to_minifloat<2, 15, kE5M2MaxCode>(a));
}

// Exact; 0x7C / 0xFC -> +-Inf, 0x7D..0x7F (and negatives) -> NaN.
PACKMOE_HD float e5m2_to_f32(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code >> 2) & 0x1Fu;
  const uint32_t man = code & 0x3u;
  if (exp == 0x1F) {
    return f32_from_bits(sign | (man == 0 ? codecs_detail::kF32Inf : codecs_detail::kF32QuietNan));
  }
  if (exp == 0) {
    if (man == 0) return f32_from_bits(sign);
    const uint32_t p = man >= 2 ? 1u : 0u;  // man * 2^-16 = 2^(p-16) * (man / 2^p)
    const uint32_t frac = (man << (23 - p)) & 0x7FFFFFu;
    return f32_from_bits(sign | ((111u + p) << 23) | frac);
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 21));  // rebias 15 -> 127
}

// ---- E8M0 (MX shared scale): 2^(code-127), code 255 = NaN, no zero ---------------------------

// TE float_to_e8m0: round UP to a power of two, satfinite. v = amax * (1/max_norm) is
// never negative, so the sign bit is ignored (|v| is encoded). NaN -> 0xFF, Inf -> 0xFE, 0 -> 0,
// v <= 2^-127 -> 0.
PACKMOE_HD uint8_t f32_to_e8m0_rceil(float v) {
  const uint32_t a = f32_bits(v) & codecs_detail::kF32AbsMask;
  if (codecs_detail::abs_bits_is_nan(a)) return 0xFF;
  if (a == codecs_detail::kF32Inf) return 0xFE;
  if (a == 0) return 0x00;
  uint32_t exp = a >> 23;
  const uint32_t man = a & 0x7FFFFFu;
  // exp == 0 && man <= 0x400000: FP32 subnormal <= 2^-127 is covered by code 0 (2^-127) already.
  if (man > 0 && exp != 0xFE && !(exp == 0 && man <= 0x400000u)) ++exp;
  return static_cast<uint8_t>(exp);
}

// 2^(code-127); code 0 -> 2^-127 (FP32 subnormal 0x00400000); 255 -> NaN. Exact.
PACKMOE_HD float e8m0_to_f32(uint8_t code) {
  if (code == 0xFF) return f32_from_bits(codecs_detail::kF32QuietNan);
  if (code == 0) return f32_from_bits(0x00400000u);
  return f32_from_bits(static_cast<uint32_t>(code) << 23);
}

// TE exp2f_rcp: the quantization multiplier 1 / 2^(code-127) = 2^(127-code), exact.
// 255 -> NaN; 254 -> 2^-127 (0x00400000); code 0 -> 2^127.
PACKMOE_HD float e8m0_reciprocal(uint8_t code) {
  if (code == 0xFF) return f32_from_bits(codecs_detail::kF32QuietNan);
  if (code == 0xFE) return f32_from_bits(0x00400000u);
  return f32_from_bits(static_cast<uint32_t>(254u - code) << 23);
}

// ---- E2M1 (FP4): s.ee.m, bias 1, {0, .5, 1, 1.5, 2, 3, 4, 6}; codes 8..15 are the negatives ----

inline constexpr uint8_t kE2M1MaxCode = 0x7;  // 6
inline constexpr float kE2M1Max = 6.0f;

// RNE with saturation at 6 (TE cvt.rn.satfinite.e2m1x2.f32), identical to the reference thresholds
// |v|<=0.25->0, <0.75->0.5, <=1.25->1, <1.75->1.5, <=2.5->2, <3.5->3, <=5->4, >5->6. Negative
// inputs that round to zero keep the sign (code 8). Inf -> +-6. NaN -> 0x7 (+6) whatever its sign:
// the kernel's satfinite behaviour (the Python reference would give +0).
PACKMOE_HD uint8_t f32_to_e2m1(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t a = b & codecs_detail::kF32AbsMask;
  if (codecs_detail::abs_bits_is_nan(a)) return kE2M1MaxCode;
  const uint32_t sign = (b >> 28) & 0x8u;
  return static_cast<uint8_t>(sign | codecs_detail::round_abs_to_minifloat<1, 1, kE2M1MaxCode>(a));
}

// Exact; only the low 4 bits of code are used.
PACKMOE_HD float e2m1_to_f32(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x8u) << 28;
  const uint32_t exp = (code >> 1) & 0x3u;
  const uint32_t man = code & 0x1u;
  if (exp == 0) return f32_from_bits(sign | (man ? 0x3F000000u : 0u));  // 0 or 0.5
  return f32_from_bits(sign | ((exp + 126u) << 23) | (man << 22));  // rebias 1 -> 127
}

// Stochastic rounding to E2M1 (TE cvt.rs.satfinite.e2m1x4.f32; docs/formats.md), 8 random bits.
// TE's software model is t = |x| + (rbits/256) * step, result floor-to-grid(t), capped at 6. In
// exact arithmetic that rounds UP to the next grid value exactly when
//     |x| - lo >= step * (256 - rbits) / 256,
// where lo is the largest E2M1 value <= |x| and step the grid spacing above lo (0.5 below 2, 1 in
// [2, 4), 2 in [4, 6)). Computing t in FP32 could round it across the grid point (e.g. tiny |x|
// plus 255/512), so we evaluate the comparison instead, and every term is exact in FP32:
//   - |x| - lo is exact by Sterbenz (lo <= |x| < lo + step <= 2 lo for lo > 0; trivially for lo = 0);
//   - step * (256 - rbits) / 256 is a small integer times a power of two.
// The threshold is >= 2^-9, so FTZ of a subnormal |x| - lo cannot change the decision.
// Properties: the result is lo or lo + step (one of the two E2M1 values bracketing |x|); rbits = 0
// always rounds toward zero; an exactly representable |x| is returned unchanged; over all 256
// rbits, lo + step is chosen floor(256 * (|x| - lo) / step) times, so the mean is within step/256
// below |x|. |x| >= 6 and Inf -> 6; NaN -> 0x7 (+6) like the RN cast; sign kept (so -0 is code 8).
PACKMOE_HD uint8_t f32_to_e2m1_sr(float x, uint8_t rbits) {
  const uint32_t b = f32_bits(x);
  const uint32_t a_bits = b & codecs_detail::kF32AbsMask;
  if (codecs_detail::abs_bits_is_nan(a_bits)) return kE2M1MaxCode;
  const uint32_t sign = (b >> 28) & 0x8u;
  const float a = f32_from_bits(a_bits);
  if (a >= kE2M1Max) return static_cast<uint8_t>(sign | kE2M1MaxCode);
  // Codes 0..7 are the grid values in increasing order, so code + 1 is the value above lo.
  uint32_t lo_code;
  float lo, step;
  if (a < 2.0f) {
    // 2a is exact (a < 2); truncation is floor for a >= 0. Codes 0..3 are 0, .5, 1, 1.5 = k / 2.
    lo_code = static_cast<uint32_t>(a * 2.0f);
    lo = static_cast<float>(lo_code) * 0.5f;
    step = 0.5f;
  } else if (a < 4.0f) {
    lo_code = a < 3.0f ? 4u : 5u;
    lo = a < 3.0f ? 2.0f : 3.0f;
    step = 1.0f;
  } else {
    lo_code = 6u;
    lo = 4.0f;
    step = 2.0f;
  }
  const float threshold = step * static_cast<float>(256u - rbits) * (1.0f / 256.0f);
  const uint32_t code = (a - lo >= threshold) ? lo_code + 1u : lo_code;
  return static_cast<uint8_t>(sign | code);
}

}  // namespace packmoe
