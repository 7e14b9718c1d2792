// The exact FP8 -> BF16 conversion of the grouped GEMM (grouped_gemm_dequant.cuh: the dequantize
// pre-pass and the sm_90a kernel's streaming converter) and of the MXFP8 quantizer's BF16 values,
// so all of them write the same BF16 bits for every code and scale: the FP8 code
// converted exactly to F16 (hardware cvt), widened to FP32, multiplied by the FP32 scale (one
// rounding at most, only below FP32's normal range) and rounded once to BF16 (RNE, no FTZ).
// Every user is compiled with --fmad=false and without FTZ.
#pragma once

#include <cstdint>

namespace packmoe::gemm_convert {

// Two FP8 codes (low byte = first element) -> two exact F16 values (low half = first).
template <bool kE5M2>
__device__ __forceinline__ uint32_t fp8x2_to_f16x2(uint32_t v) {
  uint32_t r;
  const uint16_t h = static_cast<uint16_t>(v);
  if constexpr (kE5M2)
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(h));
  else
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
  return r;
}

__device__ __forceinline__ float2 f16x2_to_f32x2(uint32_t h) {
  float lo, hi;
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi)
      : "r"(h));
  return make_float2(lo, hi);
}

// RNE to BF16, `lo` in the low half.
__device__ __forceinline__ uint32_t f32x2_to_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Two FP8 codes (low byte first) times the block scale `sc` -> two BF16 values (low half first).
template <bool kE5M2>
__device__ __forceinline__ uint32_t fp8x2_scaled_to_bf16x2(uint32_t v, float sc) {
  const float2 f = f16x2_to_f32x2(fp8x2_to_f16x2<kE5M2>(v));
  return f32x2_to_bf16x2(f.x * sc, f.y * sc);
}

}  // namespace packmoe::gemm_convert
