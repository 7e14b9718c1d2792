// GPU self-tests of the hardware conversions the CUDA kernels use instead of the shared software
// codecs. Plain C++ (no CUDA headers), so tests compiled by the host compiler can call it.
// Invariant: a kernel uses a hardware conversion only when its count here is 0 on that device.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace packmoe {

// Sweeps all 2^32 FP32 bit patterns y on the current GPU and counts the bytes where the hardware
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 of y * 1.0f (the MXFP8 kernels' exact instruction
// sequence, both halves of the x2 instruction) differs from mxfp8_encode(y, 1.0f, element)
// (formats/mxfp8_math.h). element: kE4M3 or kE5M2. When first_mismatch is given it receives the
// smallest mismatching input bit pattern (0xFFFFFFFF if none). Aborts when no GPU is usable.
uint64_t cuda_count_fp8_codec_mismatches(DType element, uint32_t* first_mismatch = nullptr);

// Mismatches of the E2M1 encoders (e2m1_rn_fast, e2m1_sr_fast of kernels_common.cuh) against
// f32_to_e2m1 / f32_to_e2m1_sr, of their rounded magnitudes (e2m1_rn_round, e2m1_sr_round) and
// signed values (e2m1_rn_value, e2m1_sr_value) against the codes' values, of the hardware BF16
// rounding (as values, one and two per cvt) and of the RHT's scaling FMA (rht16_scaled_fma against
// rht16_scaled), over all 2^32 FP32 products y * 1.0f (SR with two random bytes per input that
// together take every value 256 times), and of the hardware E4M3 decode (e4m3_to_f32_hw) against
// e4m3_to_f32 for all 256 codes; first_mismatch as above.
uint64_t cuda_count_e2m1_codec_mismatches(uint32_t* first_mismatch = nullptr);

// Mismatches of the branch-free E8M0 scale code and reciprocal (kernels_common.cuh) against
// mxfp8_scale_code / e8m0_reciprocal over every amax >= 0 that is not NaN, both FP8 elements.
uint64_t cuda_count_e8m0_scale_mismatches(uint32_t* first_mismatch = nullptr);

}  // namespace packmoe
