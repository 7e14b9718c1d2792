// NVFP4 per-block arithmetic (docs/formats.md, NVFP4) and the 16-point Random Hadamard
// Transform, one source for the CPU reference and the CUDA kernels: both call exactly these
// functions, so their bytes agree. Invariant: every step is one exactly-rounded FP32 (or FP64)
// operation in a fixed order, or bit manipulation; nothing depends on FMA contraction or FTZ.
#pragma once

#include <cfloat>
#include <cstdint>

#include "core/codecs.h"
#include "core/hd.h"
#include "core/philox.h"

namespace packmoe {

inline constexpr float kNvfp4GlobalMax = 2688.0f;  // 6 * 448: E2M1 max times E4M3 max
inline constexpr float kOneSixth = 1.0f / 6.0f;    // fp32(1/6) = 0x3E2AAAAB, TE's constant

// Per-tensor (per-group) encode scale S_enc = 2688 / amax (FP32 divide), capped at FLT_MAX
// (amax = 0 -> Inf -> FLT_MAX) and replaced by 1 when amax == 0 or S_enc == 0 (amax = Inf), as
// TE's kernel does. The ternary form maps a NaN quotient to FLT_MAX like TE's fminf.
PACKMOE_HD float nvfp4_encode_scale(float amax) {
  float s = kNvfp4GlobalMax / amax;
  s = s < FLT_MAX ? s : FLT_MAX;
  if (amax == 0.0f || s == 0.0f) s = 1.0f;
  return s;
}

// Per-tensor decode scale S_dec = 1 / S_enc, divided in FP64 and rounded once to FP32 (TE kernel).
// It is amax / 2688 up to FP32 rounding, and 1 when amax is 0 or Inf. This exact float is also
// the per-tensor scale stored in files ("X_scale_2") and the one dequantization multiplies by.
PACKMOE_HD float nvfp4_decode_scale(float amax) {
  return static_cast<float>(1.0 / static_cast<double>(nvfp4_encode_scale(amax)));
}

// E4M3 block decode scale s_b = e4m3_RNE_sat(block_amax * (S_enc * fp32(1/6))): the product
// S_enc * (1/6) is formed FIRST, as TE's kernel and reference do (the order changes the bits).
PACKMOE_HD uint8_t nvfp4_block_scale(float block_amax, float s_enc) {
  const float s_enc_over_6 = s_enc * kOneSixth;
  return f32_to_e4m3(block_amax * s_enc_over_6);
}

// Block encode multiplier r_b = min(1 / (float(s_b) * S_dec), FLT_MAX); s_b == 0 (or a product
// that underflows to 0) gives 1/0 = Inf -> FLT_MAX. The _of form takes float(s_b) decoded.
PACKMOE_HD float nvfp4_block_rcp_of(float s_b_value, float s_dec) {
  const float r = 1.0f / (s_b_value * s_dec);
  return r < FLT_MAX ? r : FLT_MAX;
}
PACKMOE_HD float nvfp4_block_rcp(uint8_t s_b, float s_dec) {
  return nvfp4_block_rcp_of(e4m3_to_f32(s_b), s_dec);
}

// E2M1 code (4 bits, sign in bit 3) of x * r_b, RNE with saturation at 6; NaN -> 0x7 (+6).
PACKMOE_HD uint8_t nvfp4_encode(float x, float r) { return f32_to_e2m1(x * r); }

// Stochastic-rounding variant with 8 random bits (codecs.h f32_to_e2m1_sr).
PACKMOE_HD uint8_t nvfp4_encode_sr(float x, float r, uint8_t rbits) {
  return f32_to_e2m1_sr(x * r, rbits);
}

// x = (e2m1 * e4m3(s_b)) * S_dec, in this order (the first product is exact).
PACKMOE_HD float nvfp4_decode(uint8_t code, uint8_t s_b, float s_dec) {
  return (e2m1_to_f32(code) * e4m3_to_f32(s_b)) * s_dec;
}

// Random byte of element j (0..15) of a 16-element block from that block's 128-bit Philox draw:
// byte j % 4 (least significant first) of word j / 4, i.e. one 32-bit word per 4 values as
// cvt.rs.satfinite.e2m1x4 consumes them.
PACKMOE_HD uint8_t nvfp4_sr_byte(const Philox4& draw, int j) {
  return static_cast<uint8_t>(draw.v[j >> 2] >> (8 * (j & 3)));
}

// ---- Random Hadamard Transform (docs/formats.md)
// -------------------------------------------------------------

inline constexpr int kRhtSize = 16;
// Bit i set where TE's fixed sign s_i = -1, s = [1,1,1,-1,1,-1,-1,-1,-1,-1,-1,1,-1,1,-1,-1].
inline constexpr uint16_t kRhtSignMask = 0xD7E8;

// y = H16 diag(s) v in place, on FP32 values: the signs, then the fast Walsh-Hadamard transform's
// four butterfly stages, pairs (i, i + h) with i & h == 0 for h = 1, 2, 4, 8, each pair becoming
// (a + b, a - b) in FP32 (RNE). H16 is Sylvester's Hadamard matrix in natural order, H16[i][j] =
// (-1)^popcount(i & j), so in exact arithmetic y_j = sum_i s_i H16[i][j] v_i. packmoe DEFINES the
// transform's arithmetic as these 64 operations in this order (CPU and CUDA both call this).
PACKMOE_HD void rht16_butterflies(float v[kRhtSize]) {
  PACKMOE_UNROLL
  for (int i = 0; i < kRhtSize; ++i)
    if ((kRhtSignMask >> i) & 1u) v[i] = -v[i];
  PACKMOE_UNROLL
  for (int h = 1; h < kRhtSize; h <<= 1) {
    PACKMOE_UNROLL
    for (int i = 0; i < kRhtSize; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = a + b;
      v[i + h] = a - b;
    }
  }
}

// The output j before its BF16 rounding: y_j / 4 (exact: every y_j is a multiple of the BF16
// spacing 2^-133, so the quotient is an FP32 value), with an exact zero as +0 (the butterflies can
// leave -0, e.g. -0 + -0).
PACKMOE_HD float rht16_scaled(float y) { return (y + 0.0f) * 0.25f; }

// out = bf16(bf16(in) @ R), R = diag(s) * H16 / 4, on one 16-vector: the inputs rounded to BF16,
// rht16_butterflies, rht16_scaled, rounded to BF16 (RNE). Outputs are floats holding BF16 values.
// TE computes the same product with a BF16 tensor-core MMA whose internal accumulation order is
// unspecified, so TE's bytes may differ from these in the last BF16 bit for some inputs.
PACKMOE_HD void rht16(const float in[kRhtSize], float out[kRhtSize]) {
  float v[kRhtSize];
  for (int i = 0; i < kRhtSize; ++i) v[i] = bf16_to_f32(f32_to_bf16(in[i]));
  rht16_butterflies(v);
  for (int j = 0; j < kRhtSize; ++j) out[j] = bf16_to_f32(f32_to_bf16(rht16_scaled(v[j])));
}

}  // namespace packmoe
