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

}  // namespace packmoe
