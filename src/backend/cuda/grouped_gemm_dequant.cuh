// The exact MXFP8 / NVFP4 -> BF16 dequantize of the grouped GEMM's operands, 8 elements at a
// time, shared by the dequantize pre-pass (grouped_gemm_operands.cu) and the sm_90a kernel's
// streaming converter (grouped_gemm_sm90.cu), so both write the same BF16 bits: the FP32 product
// of the exactly converted element and its block scale, rounded once to BF16 (RNE, no FTZ), i.e.
// f32_to_bf16(mxfp8_decode(...)) / f32_to_bf16(nvfp4_decode(..., S_dec = 1)).
#pragma once

#include <cstdint>

#include "backend/cuda/grouped_gemm_dequant_job.h"
#include "backend/cuda/grouped_gemm_sm90_convert.cuh"
#include "core/codecs.h"
#include "formats/mxfp8.h"  // kMxfp8Block
#include "formats/mxfp8_math.h"
#include "formats/nvfp4.h"  // kNvfp4Block
#include "formats/nvfp4_math.h"

namespace packmoe::gemm_convert {

// The raw bytes of 8 elements: MXFP8 d = 8 codes, s.x = the block's scale code (rowwise) or s =
// the 8 columns' codes (columnwise); NVFP4 d.x = 4 bytes (low nibble first), s.x = the E4M3 code.
struct Raw8 {
  uint2 d;
  uint2 s;
};

__device__ __forceinline__ uint2 load_stream8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t load_stream4(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Index of the first scale code of element e in a columnwise copy: (e / cols / 32, e % cols) of
// the (rows / 32, cols) codes; 32-bit division when the copy allows it.
__device__ __forceinline__ int64_t columnwise_scale_index(const DequantJob& j, int64_t e) {
  int64_t row, col;
  if (j.elems <= 0xFFFFFFFFll) {
    const uint32_t q = static_cast<uint32_t>(e) / static_cast<uint32_t>(j.cols);
    row = q;
    col = static_cast<uint32_t>(e) - q * static_cast<uint32_t>(j.cols);
  } else {
    row = e / j.cols;
    col = e - row * j.cols;
  }
  return (row / kMxfp8Block) * j.cols + col;
}

// Elements [e, e + 8) of job `j` (e < j.elems, e % 8 == 0).
template <DequantKind kKind>
__device__ __forceinline__ Raw8 load8(const DequantJob& j, int64_t e) {
  Raw8 r;
  if constexpr (kKind == DequantKind::kNvfp4) {
    r.d.x = load_stream4(j.data + e / 2);
    r.s.x = __ldg(j.scale + e / kNvfp4Block);
  } else if constexpr (kKind == DequantKind::kE4m3Columnwise ||
                       kKind == DequantKind::kE5m2Columnwise) {
    r.d = load_stream8(j.data + e);
    // (rows / 32, cols) codes; 8-byte aligned (scale 16-byte aligned, cols % 16 == 0)
    r.s = __ldg(reinterpret_cast<const uint2*>(j.scale + columnwise_scale_index(j, e)));
  } else {
    r.d = load_stream8(j.data + e);
    r.s.x = __ldg(j.scale + (e >> 5));  // (rows, cols / 32): index e / 32
  }
  return r;
}

// Elements [e, e + 16) of job `j` (e % 16 == 0) as two Raw8 of load8: one 16-byte (MXFP8) or
// 8-byte (NVFP4) load of the codes and one of the scales (the 16 elements share a block scale, or
// are 16 columns of one scale row).
template <DequantKind kKind>
__device__ __forceinline__ void load16(const DequantJob& j, int64_t e, Raw8& lo, Raw8& hi) {
  if constexpr (kKind == DequantKind::kNvfp4) {
    const uint2 d = __ldg(reinterpret_cast<const uint2*>(j.data + e / 2));
    lo.d.x = d.x;
    hi.d.x = d.y;
    lo.s.x = hi.s.x = __ldg(j.scale + e / kNvfp4Block);
  } else {
    const uint4 d = __ldg(reinterpret_cast<const uint4*>(j.data + e));
    lo.d = make_uint2(d.x, d.y);
    hi.d = make_uint2(d.z, d.w);
    if constexpr (kKind == DequantKind::kE4m3Columnwise || kKind == DequantKind::kE5m2Columnwise) {
      const uint4 s = __ldg(reinterpret_cast<const uint4*>(j.scale + columnwise_scale_index(j, e)));
      lo.s = make_uint2(s.x, s.y);
      hi.s = make_uint2(s.z, s.w);
    } else {
      lo.s.x = hi.s.x = __ldg(j.scale + (e >> 5));
    }
  }
}

// The two E2M1 codes of byte j of `w` (low nibble first) as two exact BF16 values: the magnitude
// {0, .5, 1, 1.5, 2, 3, 4, 6} (codes & 7) from two byte tables (low and high byte of each BF16)
// with prmt, the sign bit moved to bit 15 / 31.
__device__ __forceinline__ uint32_t e2m1x2_to_bf16x2(uint32_t w, int j) {
  constexpr uint32_t kLo03 = 0xC0800000u, kLo47 = 0xC0804000u;  // low bytes of codes 0-3, 4-7
  constexpr uint32_t kHi03 = 0x3F3F3F00u, kHi47 = 0x40404040u;  // high bytes
  uint32_t sel, lo, hi, mag;
  // sel = nibbles [c0, c1, c0, c1] of byte j (bit 3 cleared: prmt's sign-replicate mode off)
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(sel) : "r"(w & 0x77777777u), "r"(0u), "r"(0x4400u | (j * 0x11u)));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(lo) : "r"(kLo03), "r"(kLo47), "r"(sel));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(hi) : "r"(kHi03), "r"(kHi47), "r"(sel));
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(mag) : "r"(lo), "r"(hi), "r"(0x5140u));  // [lo c0, hi c0, lo c1, hi c1]
  const uint32_t b = w >> (8 * j);
  return mag | ((b & 0x8u) << 12) | ((b & 0x80u) << 24);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
#endif

// The 8 BF16 values of `r` (low half of .x = the first element).
template <DequantKind kKind>
__device__ __forceinline__ uint4 convert8(const Raw8& r) {
  uint32_t o[4];
  if constexpr (kKind == DequantKind::kNvfp4) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The scale by the hardware E4M3 -> F16 conversion (exact, as e4m3_to_f32). e2m1 * e4m3 has
    // at most 6 significant bits in [2^-10, 2688]: exact in BF16, so one BF16 multiply by the
    // scale gives f32_to_bf16(e2m1 * sc) bit for bit (NaN scales give a NaN either way).
    const float sc = f16x2_to_f32x2(fp8x2_to_f16x2<false>(r.s.x & 0xFFu)).x;
    const uint32_t sc2 = f32x2_to_bf16x2(sc, sc);
#pragma unroll
    for (int j = 0; j < 4; ++j) o[j] = bf16x2_mul(e2m1x2_to_bf16x2(r.d.x, j), sc2);
#else
    const float sc = e4m3_to_f32(static_cast<uint8_t>(r.s.x));
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t m = e2m1x2_to_bf16x2(r.d.x, j);  // BF16 -> FP32: the bits shifted up
      o[j] = f32x2_to_bf16x2(__uint_as_float(m << 16) * sc, __uint_as_float(m & 0xFFFF0000u) * sc);
    }
#endif
  } else {
    constexpr bool kE5M2 =
        kKind == DequantKind::kE5m2Rowwise || kKind == DequantKind::kE5m2Columnwise;
    const uint32_t w[2] = {r.d.x, r.d.y};
    if constexpr (kKind == DequantKind::kE4m3Rowwise || kKind == DequantKind::kE5m2Rowwise) {
      const float sc = e8m0_to_f32(static_cast<uint8_t>(r.s.x));
#pragma unroll
      for (int j = 0; j < 4; ++j) o[j] = fp8x2_scaled_to_bf16x2<kE5M2>(w[j >> 1] >> (16 * (j & 1)), sc);
    } else {
      const uint32_t sw[2] = {r.s.x, r.s.y};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = f16x2_to_f32x2(fp8x2_to_f16x2<kE5M2>(w[j >> 1] >> (16 * (j & 1))));
        const uint32_t sv = sw[j >> 1] >> (16 * (j & 1));
        o[j] = f32x2_to_bf16x2(f.x * e8m0_to_f32(static_cast<uint8_t>(sv)),
                               f.y * e8m0_to_f32(static_cast<uint8_t>(sv >> 8)));
      }
    }
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// 16 bytes of BF16 at out + 2 e: kStreaming marks them evict-first (nothing reads them soon).
template <bool kStreaming>
__device__ __forceinline__ void store8(uint8_t* out, int64_t e, uint4 v) {
  if constexpr (kStreaming)
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(out + e * 2), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  else
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(out + e * 2), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

}  // namespace packmoe::gemm_convert
