// MXFP8 (docs/formats.md): E4M3/E5M2 elements, one E8M0 scale per 32 elements along the
// reduction dim, rounded UP from amax * fp32(1/max_norm) so the block max never saturates.
// Rowwise (1x32 along K) and columnwise (32x1 along rows, same (rows, K) shape, NOT transposed)
// are both computed from the high-precision input. Optional 2D 32x32 tiles for weights.
// This file is the CPU reference; the CUDA kernels must produce the same bytes.
#pragma once

#include <vector>

#include "formats/grouped.h"

namespace packmoe {

inline constexpr int kMxfp8Block = 32;

struct Mxfp8Config {
  DType element = DType::kE4M3;  // kE4M3 or kE5M2
  bool rowwise = true;           // 1x32 blocks along K
  bool columnwise = false;       // 32x1 blocks along rows
  bool two_d = false;            // one scale per 32x32 tile, written into both scale layouts
};

// Per-group output pointers; a copy that is not requested has empty vectors.
struct Mxfp8Outputs {
  std::vector<void*> row_data;   // (rows_g, K) elements
  std::vector<void*> row_scale;  // (rows_g, K/32) E8M0, compact row-major
  std::vector<void*> col_data;   // (rows_g, K) elements
  std::vector<void*> col_scale;  // (rows_g/32, K) E8M0, compact row-major
  // Optional, 1D copies only: (rows_g, K) BF16, a copy's values f32_to_bf16(mxfp8_decode(code,
  // scale)), exactly what a GEMM dequantizes the copy to, so a GEMM that is given them
  // (GemmOperand::bf16) reads them instead. Empty: not written. A requested copy given only
  // these (its data and scale vectors empty) is written as its values only.
  std::vector<void*> row_bf16;
  std::vector<void*> col_bf16;
  bool row_values_only() const { return !row_bf16.empty() && row_data.empty() && row_scale.empty(); }
  bool col_values_only() const { return !col_bf16.empty() && col_data.empty() && col_scale.empty(); }
};

// One copy of quantized grouped data, for dequantization.
struct Mxfp8Copy {
  DType element = DType::kE4M3;
  bool columnwise = false;         // which scale layout `scale` has
  int64_t cols = 0;                // K
  std::vector<int64_t> rows;       // per group
  std::vector<const void*> data;   // (rows_g, K)
  std::vector<const void*> scale;  // (rows_g, K/32) or (rows_g/32, K)
};

// The rowwise (columnwise = false) or columnwise copy of quantize outputs `out` of input `in`,
// for dequantization.
Mxfp8Copy mxfp8_copy_of(const GroupedMatrices& in, DType element, bool columnwise,
                        const Mxfp8Outputs& out);

// Shape/usage checks (no memory is touched): K % 32, rows % 32 for columnwise/2D, pointers.
Status validate_mxfp8(const GroupedMatrices& in, const Mxfp8Config& cfg, const Mxfp8Outputs& out);
Status validate_mxfp8_copy(const Mxfp8Copy& q, DType out_dtype, const std::vector<void*>& out);

// CPU reference. Host pointers. Returns the validation error, if any, before touching memory.
Status quantize_mxfp8_cpu(const GroupedMatrices& in, const Mxfp8Config& cfg, const Mxfp8Outputs& out);
// x = element * 2^(scale-127), written as f32 or bf16 (rows_g, K).
Status dequantize_mxfp8_cpu(const Mxfp8Copy& q, DType out_dtype, const std::vector<void*>& out);

}  // namespace packmoe
