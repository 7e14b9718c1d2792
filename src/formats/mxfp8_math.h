// MXFP8 per-block arithmetic (docs/formats.md), one source for the CPU reference and the CUDA
// kernels: both call exactly these functions, so their bytes agree. Invariant: every step is a
// single exactly-rounded FP32 operation or bit manipulation (no FMA-contractible a*b+c, no
// dependence on FTZ), so host and device give the same bits.
#pragma once

#include <cstdint>

#include "core/codecs.h"
#include "core/dtype.h"
#include "core/hd.h"

namespace packmoe {

// FP32 bit patterns of fp32(1/max_norm): TE's Quantized_Limits<T>::max_norm_rcp.
inline constexpr uint32_t kE4M3MaxNormRcpBits = 0x3B124925u;  // fp32(1/448)
inline constexpr uint32_t kE5M2MaxNormRcpBits = 0x37924925u;  // fp32(1/57344)

// max(a, |x|) where a NaN x never wins (PTX max / fmaxf return the non-NaN operand): a block of
// NaNs keeps amax 0 and a NaN element never decides the scale.
PACKMOE_HD float amax_update(float a, float x) {
  const float ax = f32_from_bits(f32_bits(x) & 0x7FFFFFFFu);
  return ax > a ? ax : a;
}

// element must be kE4M3 or kE5M2 (callers validate).
PACKMOE_HD float mxfp8_max_norm_rcp(DType element) {
  return f32_from_bits(element == DType::kE5M2 ? kE5M2MaxNormRcpBits : kE4M3MaxNormRcpBits);
}

// E8M0 code of a block: RCEIL of amax * fp32(1/max_norm), one FP32 multiply.
// Guarantees amax * 2^(127-code) <= max_norm, so the block max never saturates.
PACKMOE_HD uint8_t mxfp8_scale_code(float amax, DType element) {
  return f32_to_e8m0_rceil(amax * mxfp8_max_norm_rcp(element));
}

// Element byte: FP8 RNE satfinite of x * q with q = e8m0_reciprocal(code) (exact power of two).
// NaN gives 0x7F whatever its sign: on the GPU x * q turns any NaN into the canonical positive NaN
// before the cvt, so the CPU copies that instead of keeping the sign of a negative NaN input.
PACKMOE_HD uint8_t mxfp8_encode(float x, float q, DType element) {
  const float y = x * q;
  if ((f32_bits(y) & 0x7FFFFFFFu) > 0x7F800000u) return 0x7F;
  return element == DType::kE5M2 ? f32_to_e5m2(y) : f32_to_e4m3(y);
}

// The one NaN every dequantized MXFP8 NaN becomes (element NaN or scale code 255).
inline constexpr uint32_t kMxfp8DecodedNan = 0x7FFFFFFFu;

// x = fp8 * 2^(code-127); code 0 is 2^-127, code 255 gives NaN.
PACKMOE_HD float mxfp8_decode(uint8_t v, uint8_t code, DType element) {
  const float e = element == DType::kE5M2 ? e5m2_to_f32(v) : e4m3_to_f32(v);
  const float x = e * e8m0_to_f32(code);
  // A multiply's NaN payload differs between x86 (propagates the operand) and the GPU (canonical
  // 0x7FFFFFFF): emit one NaN so CPU and CUDA write the same bytes.
  return x != x ? f32_from_bits(kMxfp8DecodedNan) : x;
}

}  // namespace packmoe
