// One quantized operand copy of one group for the grouped GEMM's exact dequantize to BF16: what
// the pre-pass kernels (grouped_gemm_operands.cu) and the sm_90a kernel's streaming converter
// (grouped_gemm_sm90.cu) read; the device code is in grouped_gemm_dequant.cuh.
#pragma once

#include <cstdint>

namespace packmoe::gemm_convert {

// How a stored copy's elements and scales are laid out.
enum class DequantKind : uint8_t {
  kE4m3Rowwise,     // MXFP8 (rows, cols) E4M3, scales (rows, cols / 32)
  kE4m3Columnwise,  // MXFP8 (rows, cols) E4M3, scales (rows / 32, cols)
  kE5m2Rowwise,
  kE5m2Columnwise,
  kNvfp4,  // 16-element blocks in stored order (8 bytes), one E4M3 scale each
};

// One stored copy of one group: elems = rows * cols elements to BF16 at `out`, row-major.
// Elements are handled 8 or 16 at a time from 8- or 16-aligned flat indices: elements of one row
// (cols is a multiple of 16) sharing one block scale (MXFP8 rowwise, NVFP4) or a code each
// (columnwise). data, scale (columnwise) and out are 16-byte aligned.
struct DequantJob {
  const uint8_t* data;
  const uint8_t* scale;
  uint8_t* out;        // BF16, 16-byte aligned
  int64_t elems;       // multiple of 32 (MXFP8) / 16 (NVFP4)
  int64_t cols;        // MXFP8: row length; NVFP4: unused
  uint32_t begin;      // first work item (pre-pass tile, converter chunk) of this job
  DequantKind kind;
};

}  // namespace packmoe::gemm_convert
